"""``bench/e2e/e2e.py --gpu``: end to end through mlx-lm on a GPU: time to first token, decode speed and
peak memory of random-weight 8B / 1B llama and Gemma 4 models, stock mlx-lm
against mlxq, at long contexts.

mlx-lm's ``generate_step`` (``prefill_step_size`` 2048, greedy) on models of
mlx-lm's own classes with random bf16 weights (``mlxq.random_models``; no
download):

  8b       mlx_lm.models.llama: hidden 4096, 32 layers, 32/8 heads x 128,
           intermediate 14336, vocab 128256, rope_theta 500000, untied head
  1b       mlx_lm.models.llama: hidden 2048, 16 layers, 32/8 heads x 64,
           intermediate 8192, vocab 128256, rope_theta 500000, tied embeddings
  gemma4   mlx_lm.models.gemma4_text with its ModelArgs defaults (35 layers,
           sliding window 512 every 4 of 5 layers, 20 KV-shared layers,
           1 KV head of 256 / 512 on the full-attention layers)

and three runs, back to back in one process for each (model, context):

  stock-bf16   stock mlx-lm, unquantized (bf16) KV cache
  stock-kv4    stock mlx-lm, kv_bits=4, kv_group_size=64, quantized_kv_start=0
               (mlx-lm's quantized attention composition; on MLX's CUDA
               backend its quantized_matmul raises, and Gemma 4's rotating
               caches cannot quantize in stock mlx-lm: any exception is
               recorded and the benchmark goes on)
  mlxq-kv4     mlxq.mlx_lm.enable(kv_recent=0, k_bits=4), then the same generate_step(..., kv_bits=4,
               kv_group_size=64, quantized_kv_start=0) call, with no
               prompt_cache argument (mlxq quantizes the cache it makes from
               the first token; on a GPU it may send many-row prefill calls
               to mx.fast over dequantized K/V: the JSON counts those,
               routed_to_mx_fast, next to attention_calls)

Per run: TTFT = seconds from calling generate_step to its first token (the
whole prefill included); decode ms/token = median gap between consecutive
tokens, the first two gaps skipped; peak GB = mx.get_peak_memory() over the
run (reset before; weights included) plus the peak of mlxq's own CUDA pool
(its kernels' outputs and scratch, which MLX does not count); KV GB is
*computed* from the model's args for the prompt length (see KV_NOTE), the bytes of the caches the run
actually made are saved too (kv_gb_measured); "x bf16" columns are this run's
time over stock-bf16's at the same model and context (< 1: faster). Each
model and run gets an untimed warm-up generation first (kernel compilation).
With --repeats R the runs alternate R rounds per model and context and each
row is the round with the median decode time (the lower middle for even R),
every round's numbers kept under "rounds": a shared GPU drifts between runs.
Results are written after every run, so a timeout keeps the finished rows.

    python bench/e2e/e2e.py --gpu                                   # everything
    python bench/e2e/e2e.py --gpu --models 8b --contexts 8192 32768
    python bench/e2e/e2e.py --gpu --models 1b --quick --layers 2    # CPU smoke test
"""

import argparse
import dataclasses
import gc
import importlib
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common  # noqa: E402
import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

import mlxq  # noqa: E402
import mlxq.mlx_lm as mlxq_lm  # noqa: E402
from mlxq.random_models import model_args, num_parameters, random_model  # noqa: E402

CONTEXTS = [8192, 32768, 131072]
CONFIGS = ["stock-bf16", "stock-kv4", "mlxq-kv4"]
KV_BITS, KV_GROUP = 4, 64
PREFILL_STEP = 2048
DECODE_TOKENS = 34
QUICK = dict(contexts=[1024], decode_tokens=4, layers=2, warmup_tokens=0)

_LLAMA = dict(
    vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072
)
MODELS = {
    "8b": (
        "llama",
        dict(
            _LLAMA,
            hidden_size=4096,
            num_hidden_layers=32,
            intermediate_size=14336,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            tie_word_embeddings=False,
        ),
    ),
    "1b": (
        "llama",
        dict(
            _LLAMA,
            hidden_size=2048,
            num_hidden_layers=16,
            intermediate_size=8192,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            tie_word_embeddings=True,
        ),
    ),
    "gemma4": ("gemma4", None),  # mlx_lm.models.gemma4_text.ModelArgs() defaults
}

KV_NOTE = (
    "kv_gb is computed, not measured: cache layers x prompt tokens x bytes per token from the "
    "model's args, bytes per token = 2 (K and V) x n_kv_heads x head_dim x bytes per element; "
    "bf16: 2 bytes per element; 4-bit group 64: 0.5 + 2*2/64 bytes per element (codes plus "
    "bf16 scales and biases). Gemma 4: full-attention layers hold the whole prompt at "
    "global_head_dim, sliding layers at most sliding_window tokens at head_dim, KV-shared "
    "layers nothing. kv_gb_measured is the sum of nbytes of the caches generate_step made "
    "(the list it hands the model, noted by wrapping the model class's __call__ for the run): "
    "it includes allocation rounding (256-token steps), the decode tokens, and "
    "rotating caches holding up to window + prefill chunk - 1 tokens after a chunk."
)

COLUMNS = [
    ("model", "model", "{}"),
    ("context", "context", "{}"),
    ("run", "config", "{}"),
    ("TTFT s", "ttft_s", "{:.3f}"),
    ("decode ms/token", "decode_ms", "{:.2f}"),
    ("peak GB", "peak_gb", "{:.2f}"),
    ("KV GB", "kv_gb", "{:.3f}"),
    ("x bf16 decode", "x_bf16_decode", "{:.2f}"),
    ("x bf16 TTFT", "x_bf16_ttft", "{:.2f}"),
]


# ------------------------------------------------------------------ models
def _gemma4_overrides(layers):
    """Every gemma4_text ModelArgs field at its default (so ``random_model``'s
    benchmark sizes do not apply); with ``layers``, that many layers and about
    the default's share of KV-shared layers, keeping at least one whole
    sliding/full pattern of layers with their own K/V (a shared layer reuses
    the last own-K/V layer of its type)."""
    module = importlib.import_module("mlx_lm.models.gemma4_text")
    defaults = {f.name: f.default for f in dataclasses.fields(module.ModelArgs)}
    if layers is not None:
        share = defaults["num_kv_shared_layers"] / defaults["num_hidden_layers"]
        own = max(defaults["sliding_window_pattern"], layers - round(layers * share))
        defaults.update(num_hidden_layers=layers, num_kv_shared_layers=max(0, layers - own))
    return module, defaults


def build_model(name, layers, seed):
    """(model, args, description) of ``name``, random bf16 weights, evaluated."""
    arch, spec = MODELS[name]
    if arch == "gemma4":
        module, overrides = _gemma4_overrides(layers)
    else:
        overrides = dict(spec)
        if layers is not None:
            overrides["num_hidden_layers"] = layers
    model, _ = random_model(arch, "small", seed=seed, dtype=mx.bfloat16, **overrides)
    _, args = model_args(arch, "small", **overrides)
    if arch == "gemma4" and layers is None:
        assert args == module.ModelArgs(), "gemma4 args differ from mlx-lm's defaults"
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    desc = dict(
        arch=f"{arch} (mlx_lm.models.{type(model).__module__.split('.')[-1]})",
        params=num_parameters(model),
        weights_gb=weights / 1e9,
        dtype="bfloat16",
        args=_jsonable(dataclasses.asdict(args)),
    )
    return model, args, desc


def _jsonable(x):
    return json.loads(json.dumps(x, default=str))


def kv_bytes(args, context, bits):
    """Computed KV cache bytes after a ``context``-token prompt (see KV_NOTE)."""
    per_element = 2.0 if bits is None else bits / 8 + 2 * 2 / KV_GROUP
    if args.model_type != "gemma4_text":
        heads, dim = args.num_key_value_heads, args.head_dim
        return args.num_hidden_layers * context * 2 * heads * dim * per_element
    total = 0.0
    own = args.num_hidden_layers - args.num_kv_shared_layers
    for i, kind in enumerate(args.layer_types[:own]):
        full = kind == "full_attention"
        dim = args.global_head_dim if full and args.global_head_dim else args.head_dim
        heads = (
            args.num_global_key_value_heads
            if full and args.attention_k_eq_v and args.num_global_key_value_heads
            else args.num_key_value_heads
        )
        tokens = context if full else min(context, args.sliding_window)
        total += tokens * 2 * heads * dim * per_element
    return total


def kv_layout(args):
    """How many layers hold which cache (for the JSON)."""
    if args.model_type != "gemma4_text":
        return {"full": args.num_hidden_layers}
    own = args.num_hidden_layers - args.num_kv_shared_layers
    types = args.layer_types[:own]
    return {
        "full": types.count("full_attention"),
        "sliding": types.count("sliding_attention"),
        "kv_shared": args.num_kv_shared_layers,
        "sliding_window": args.sliding_window,
    }


# -------------------------------------------------------------------- runs
def _first_line(e):
    text = f"{type(e).__name__}: {e}".strip()
    return text.splitlines()[0] if text else type(e).__name__


def _route_counts():
    """mlxq's count of quantized attention calls it sent to mx.fast over
    dequantized K/V since the last call (None where mlxq has no such route)."""
    try:
        from mlxq import routing
    except ImportError:
        return None
    take = getattr(routing, "take_route_counts", None)
    return take() if take else None


def generate(model, config, prompt, decode_tokens):
    """One generate_step run of ``config``: a row of timings (or the error)."""
    lm_generate = importlib.import_module("mlx_lm.generate")
    ours = config == "mlxq-kv4"
    kwargs = (
        {}
        if config == "stock-bf16"
        else dict(kv_bits=KV_BITS, kv_group_size=KV_GROUP, quantized_kv_start=0)
    )
    gc.collect()
    mx.clear_cache()
    mx.synchronize()
    r = {"config": config, "generate_step_kwargs": kwargs}
    if ours:
        mlxq_lm.enable(kv_recent=0, k_bits=KV_BITS)  # plain 4-bit: no window, 4-bit keys
        mlxq_lm.reset_counters()
        _route_counts()
    # Observe (not change) the cache generate_step makes for itself: the model
    # class's __call__ is wrapped for the run to note the cache list it is
    # handed (mlx-lm and mlxq replace the list's entries in place).
    seen = []
    cls = type(model)
    call = cls.__call__

    def noting(self, *a, **k):
        cache = k.get("cache", a[1] if len(a) > 1 else None)
        if not seen and cache is not None:
            seen.append(cache)
        return call(self, *a, **k)

    cls.__call__ = noting
    stamps = []
    try:
        mx.reset_peak_memory()
        mlxq._ext._device_memory()  # restarts mlxq's own pool peak
        t0 = time.perf_counter()
        for _token, _ in lm_generate.generate_step(
            prompt,
            model,
            max_tokens=decode_tokens,
            prefill_step_size=PREFILL_STEP,
            **kwargs,
        ):
            stamps.append(time.perf_counter())
        mx.synchronize()
    except Exception as e:  # noqa: BLE001 - stock-kv4 raises on CUDA; every run is kept
        r["error"] = f"{type(e).__name__}: {e}"
        r["error_first_line"] = _first_line(e)
    finally:
        cls.__call__ = call
        # mlxq's CUDA outputs and scratch come from its own pool, which
        # MLX's peak does not count: the sum of both peaks (an upper bound).
        pool_peak = mlxq._ext._device_memory()[1]
        r["mlxq_pool_peak_gb"] = pool_peak / 1e9
        r["peak_gb"] = (mx.get_peak_memory() + pool_peak) / 1e9
        if ours:
            r["attention_calls"] = dict(mlxq_lm.counters())
            routes = _route_counts()
            if routes is not None:
                r["routed_to_mx_fast"] = routes  # many-row GPU calls over dequantized K/V
            mlxq_lm.disable()
            mlxq_lm.reset_counters()
    if seen:
        cache = seen[0]
        r["cache_classes"] = sorted(
            {f"{type(c).__module__.split('.')[0]}.{type(c).__name__}" for c in cache}
        )
        try:
            r["kv_gb_measured"] = sum(c.nbytes for c in cache) / 1e9
        except Exception as e:  # noqa: BLE001
            r["kv_gb_measured_error"] = _first_line(e)
        del cache
    del seen
    r["tokens"] = len(stamps)
    if "error" not in r:
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]
        timed = gaps[2:] if len(gaps) > 2 else gaps
        r["ttft_s"] = stamps[0] - t0
        if timed:
            r["decode_ms"] = 1e3 * statistics.median(timed)
            r["decode_ms_min"] = 1e3 * min(timed)
            r["decode_ms_all"] = [1e3 * g for g in timed]
        r["prefill_tps"] = len(prompt) / r["ttft_s"]
        if ours:
            r["quantized_from_first_token"] = r["attention_calls"].get("mlx_lm", 0) == 0
    gc.collect()
    mx.clear_cache()
    return r


def median_round(runs):
    """One row from a run's rounds: the round with the median decode time
    (its TTFT, peak and per-token times), the highest peak of any round, and
    every round's decode ms / TTFT / peak under "rounds"."""
    if len(runs) == 1 or any("error" in r for r in runs):
        return runs[0]
    ranked = sorted(runs, key=lambda r: r.get("decode_ms") or 0.0)
    row = dict(ranked[(len(ranked) - 1) // 2])
    row["peak_gb"] = max(r["peak_gb"] for r in runs)
    row["rounds"] = [
        {k: r.get(k) for k in ("decode_ms", "ttft_s", "peak_gb", "mlxq_pool_peak_gb")} for r in runs
    ]
    return row


def add_ratios(rows):
    base = {
        (r["model"], r["context"]): r
        for r in rows
        if r["config"] == "stock-bf16" and "error" not in r
    }
    for r in rows:
        b = base.get((r["model"], r["context"]))
        if b is None or "error" in r:
            continue
        if r.get("decode_ms") and b.get("decode_ms"):
            r["x_bf16_decode"] = r["decode_ms"] / b["decode_ms"]
        r["x_bf16_ttft"] = r["ttft_s"] / b["ttft_s"]


def display(r):
    """The row as the table shows it: an error in the TTFT column."""
    if "error" not in r:
        return r
    msg = r["error_first_line"].replace("|", "\\|")
    return dict(r, ttft_s="raises: " + (msg if len(msg) <= 120 else msg[:117] + "..."))


# -------------------------------------------------------------------- device
def device_name():
    """(slug, name): "cpu" on the CPU; on a GPU its name ("NVIDIA H200" ->
    "nvidia_h200") from mx.device_info(), mx.metal.device_info() or
    nvidia-smi, else "gpu"."""
    if mx.default_device().type == mx.cpu:
        return "cpu", common.cpu_model()
    name = None
    for query in (
        lambda: mx.device_info(mx.default_device()),
        lambda: mx.metal.device_info() if mx.metal.is_available() else {},
    ):
        try:
            name = query().get("device_name")
        except Exception:  # noqa: BLE001
            name = None
        if name:
            break
    if not name:
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                check=True,
                timeout=30,
            )
            name = out.stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError, IndexError):
            name = None
    return (common.slug(name) or "gpu", name) if name else ("gpu", "gpu")


# -------------------------------------------------------------------- output
def plot(rows, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(len(models), 2, figsize=(11, 3.6 * len(models)), squeeze=False)
    for (ax_dec, ax_ttft), model in zip(axes, models):
        ok = [r for r in rows if r["model"] == model and "error" not in r]
        for config, style in zip(CONFIGS, ("o-", "s--", "^-")):
            pts = sorted((r["context"], r) for r in ok if r["config"] == config)
            if not pts:
                continue
            xs = [n for n, _ in pts]
            dec = [(n, r["decode_ms"]) for n, r in pts if r.get("decode_ms") is not None]
            if dec:
                ax_dec.plot([n for n, _ in dec], [v for _, v in dec], style, label=config)
            ax_ttft.plot(xs, [r["ttft_s"] for _, r in pts], style, label=config)
        contexts = sorted({r["context"] for r in rows if r["model"] == model})
        for ax, ylabel in ((ax_dec, "decode ms/token"), (ax_ttft, "time to first token (s)")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(
                contexts, [f"{n // 1024}k" if n % 1024 == 0 else str(n) for n in contexts]
            )
            ax.minorticks_off()
            ax.set_xlabel("context (prompt tokens)")
            ax.set_ylabel(ylabel)
            ax.set_ylim(bottom=0)
            ax.set_title(model, fontsize=9)
            ax.grid(True, alpha=0.3)
            if ax.get_lines():
                ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _order(r):
    return (
        list(MODELS).index(r["model"]) if r["model"] in MODELS else len(MODELS),
        r["context"],
        CONFIGS.index(r["config"]) if r["config"] in CONFIGS else len(CONFIGS),
    )


def save(out, payload, rows, title):
    rows.sort(key=_order)
    add_ratios(rows)
    common.save_json(out, dict(payload, results=rows), quiet=True)
    try:
        plot(rows, os.path.splitext(out)[0] + ".png", title)
    except ImportError:
        pass  # matplotlib is optional (pip install mlxq[bench])


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="e2e.py --gpu",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument(
        "--contexts",
        type=int,
        nargs="+",
        default=None,
        help=f"prompt lengths (default {CONTEXTS}; --quick: {QUICK['contexts']})",
    )
    p.add_argument("--configs", nargs="+", default=CONFIGS, choices=CONFIGS)
    p.add_argument(
        "--decode-tokens",
        type=int,
        default=None,
        help=f"tokens generated per run (default {DECODE_TOKENS}; --quick: "
        f"{QUICK['decode_tokens']}; the first two gaps are not timed)",
    )
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        help=f"override every model's layer count (--quick: {QUICK['layers']})",
    )
    p.add_argument(
        "--warmup-tokens",
        type=int,
        default=None,
        help=f"prompt of the untimed warm-up run per model and run (default "
        f"{2 * PREFILL_STEP + 1}; --quick: {QUICK['warmup_tokens']}; 0: none)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: contexts 1024, 4 decode tokens, 2 layers, no warm-up (unless given)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds per (model, context), alternating between the runs: a shared "
        "GPU drifts between runs, so each row reports the median round (its "
        "decode ms and TTFT) and keeps every round's numbers",
    )
    common.add_output_args(p)
    p.add_argument(
        "--append",
        action="store_true",
        help="keep the rows (and models) already in the JSON at --out, replacing "
        "those of the same model, context and run: one table from several "
        "shorter invocations",
    )
    args = p.parse_args(argv)
    pick = lambda v, key, full: v if v is not None else (QUICK[key] if args.quick else full)  # noqa: E731
    contexts = pick(args.contexts, "contexts", CONTEXTS)
    decode_tokens = pick(args.decode_tokens, "decode_tokens", DECODE_TOKENS)
    layers = pick(args.layers, "layers", None)
    warmup_tokens = pick(args.warmup_tokens, "warmup_tokens", 2 * PREFILL_STEP + 1)

    slug, name = device_name()
    out = common.output_path(args, f"e2e_{slug}", args.quick)
    previous = None
    if os.path.exists(out):
        with open(out) as f:
            previous = json.load(f)
        if previous.get("benchmark") != "e2e_gpu":
            sys.exit(
                f"{out} holds another benchmark's results "
                f"({previous.get('benchmark')!r}): pass --out"
            )
    info = common.machine_info()
    info["device"] = name
    try:
        import mlx_lm

        info["mlx_lm_version"] = mlx_lm.__version__
    except (ImportError, AttributeError):
        pass
    common.print_machine(info)
    print(f"device  : {name} ({slug})")
    print(
        f"runs    : {', '.join(args.configs)}; contexts {contexts}; prefill step {PREFILL_STEP}; "
        f"{decode_tokens} decode tokens; kv_bits {KV_BITS} group {KV_GROUP}; "
        f"warm-up prompt {warmup_tokens}" + (f"; {layers} layers" if layers else "")
    )
    title = (
        f"mlx-lm generate_step, random bf16 weights, kv_bits {KV_BITS} g{KV_GROUP} - "
        f"{name}, MLX {info['mlx_version']}"
    )
    payload = {
        "benchmark": "e2e_gpu",
        "description": __doc__,
        "machine": info,
        "device_slug": slug,
        "prefill_step_size": PREFILL_STEP,
        "kv_bits": KV_BITS,
        "kv_group_size": KV_GROUP,
        "decode_tokens": decode_tokens,
        "contexts": contexts,
        "configs": args.configs,
        "layers_override": layers,
        "warmup_tokens": warmup_tokens,
        "kv_note": KV_NOTE,
        "ratio_note": "x_bf16_*: this run's time / stock-bf16's at the same model and context",
        "models": {},
    }
    rows = []
    if args.append and previous:
        payload["models"].update(previous.get("models", {}))
        payload["appended_to"] = previous.get("machine", {}).get("date")
        rows = [
            r
            for r in previous.get("results", [])
            if not (
                r["model"] in args.models
                and r["context"] in contexts
                and r["config"] in args.configs
            )
        ]
    table = common.MarkdownTable(COLUMNS)
    printed_header = False
    for model_name in args.models:
        t = time.perf_counter()
        model, margs, desc = build_model(model_name, layers, args.seed)
        desc["kv_layout"] = kv_layout(margs)
        payload["models"][model_name] = desc
        print(
            f"\nmodel {model_name}: {desc['arch']}, {desc['params'] / 1e9:.2f}B params, "
            f"bf16 weights {desc['weights_gb']:.2f} GB, built in {time.perf_counter() - t:.1f} s; "
            f"KV layers {desc['kv_layout']}",
            flush=True,
        )
        if warmup_tokens:
            warm = mx.random.randint(
                0, margs.vocab_size, (warmup_tokens,), key=mx.random.key(args.seed + 1)
            )
            for config in args.configs:
                w = generate(model, config, warm, 4)
                desc.setdefault("warmup", {})[config] = w.get("error_first_line", "ok")
        if not printed_header:
            print()
            table.header()
            printed_header = True
        for n in contexts:
            prompt = mx.random.randint(0, margs.vocab_size, (n,), key=mx.random.key(args.seed))
            mx.eval(prompt)
            rounds = {config: [] for config in args.configs}
            for _ in range(max(1, args.repeats)):
                for config in args.configs:
                    if rounds[config] and "error" in rounds[config][0]:
                        continue  # a run that raised once raises again
                    print(f"  [{model_name} {n} {config}] ...", file=sys.stderr, flush=True)
                    rounds[config].append(generate(model, config, prompt, decode_tokens))
            for config in args.configs:
                r = dict(model=model_name, context=n, **median_round(rounds[config]))
                if "error" not in r:
                    r["kv_gb"] = (
                        kv_bytes(margs, n, None if config == "stock-bf16" else KV_BITS) / 1e9
                    )
                rows.append(r)
                save(out, payload, rows, title)
                table.row(display(r))
            del prompt
        del model
        gc.collect()
        mx.clear_cache()
    print("\nsummary\n")
    table.header()
    for r in sorted(rows, key=_order):
        table.row(display(r))
    print(f"\nsaved {out} and {os.path.splitext(out)[0]}.png (if matplotlib is installed)")
