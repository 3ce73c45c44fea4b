"""End to end through mlx-lm: decode speed and peak memory of a random llama.

mlx-lm's ``generate_step`` on a model of mlx-lm's own llama class with
random bf16 weights (``mlxq.random_models``), at long prompt lengths:

  stock-bf16   stock mlx-lm, unquantized (bf16) KV cache
  stock-kv4    stock mlx-lm, kv_bits=4: prefill with a bf16 cache, quantized
               once the prompt is in (quantized_kv_start = prompt length - 1),
               then decode through mlx-lm's quantized attention composition.
               (Its most favourable schedule: quantizing earlier sends prefill
               through the composition too, ~150 s per layer per 2k chunk at 8k
               on this CPU; mlx-lm's default, 5000, quantizes mid-prefill at 8k
               and never at 2k.)
  mlxq-kv4     mlxq.mlx_lm enabled, kv_bits=4, cache quantized from the first
               token (make_prompt_cache(model, kv_bits=4)): prefill and decode
               on mlxq's fused kernel, updates in place
  mlxq-kv4-rot the same with hadamard=True (rows in a Hadamard basis)
  mlxq-k8v4    mlxq with 8-bit keys and 4-bit values (kv_bits=8,
               enable(v_bits=4))
  mlxq-kv4-w128  mlxq kv4 that also keeps the last 128 tokens exact
               (enable(kv_recent=128), mlxq.cache.recent)
  mlxq-recipe  what kv_bits=4 gets under a bare enable(): 8-bit keys, 4-bit
               values and the window (mlxq.mlx_lm's 4-bit recipe)
  mlxq-kv4-w128-apart  the same with MLXQ_CUDA_FUSED_RECENT=0: on CUDA the
               window attended after the quantized part (RecentAttention)
               instead of in the decode kernel's own blocks

``--gguf smollm2-135m`` (or ``gemma3-270m``) runs a trained model from
mlxq.gguf's packaged files in bf16 instead of the random llama;
``--shape-of gemma3-270m`` (or ``smollm2-135m``) a model of the same class
and configuration with random weights, for speed where the packages are not
at hand (a step's time does not depend on the weights' values).

Decode tokens/s is 1 / median time between tokens of ``generate_step`` (the
first two tokens skipped); peak memory is ``mx.get_peak_memory()`` over the
whole run (prefill + decode), weights included, reset before each run.
With ``--repeats R`` every configuration runs R times per context, the
order rotated each time, and the row reports the medians (the prefill
time, a single measurement per run, then compares fairly).

On a GPU, ``--gpu`` runs the GPU set instead (8B / 1B llama and Gemma 4
shapes, time to first token, 8k-128k contexts; bench/e2e/gpu_runs.py):
``python bench/e2e/e2e.py --gpu --help``.

    python bench/e2e/e2e.py                      # prompts of 2k and 8k tokens
    python bench/e2e/e2e.py --contexts 1024 --decode-tokens 8 --layers 2   # quick look
    python bench/e2e/e2e.py --gpu --models 1b --contexts 8192 32768
"""

import argparse
import importlib
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common  # noqa: E402
import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

import mlxq.mlx_lm as mlxq_lm  # noqa: E402
from mlxq import _ext as mlxq_ext  # noqa: E402
from mlxq.random_models import model_args, num_parameters, random_model  # noqa: E402

CONTEXTS = [2048, 8192]
CONFIGS = [
    "stock-bf16",
    "stock-kv4",
    "mlxq-kv4",
    "mlxq-kv4-rot",
    "mlxq-k8v4",
    "mlxq-kv4-w128",
    "mlxq-kv4-w128-apart",
    "mlxq-recipe",
]
DEFAULT_CONFIGS = CONFIGS[:3]
KV_BITS, KV_GROUP = 4, 64
# The packaged models' configurations (mlxq.gguf.PACKAGED), for --shape-of.
SHAPES = {
    "smollm2-135m": (
        "llama",
        dict(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            head_dim=64,
            rope_theta=100000.0,
            tie_word_embeddings=True,
        ),
    ),
    "gemma3-270m": (
        "gemma3",
        dict(
            vocab_size=262144,
            hidden_size=640,
            intermediate_size=2048,
            num_hidden_layers=18,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            query_pre_attn_scalar=256,
            sliding_window=512,
            sliding_window_pattern=6,
            rope_theta=1000000.0,
            rope_local_base_freq=10000.0,
        ),
    ),
}
PREFILL_STEP = 2048

COLUMNS = [
    ("context", "context", "{}"),
    ("config", "config", "{}"),
    ("decode tok/s", "decode_tps", "{:.2f}"),
    ("ms/token", "decode_ms", "{:.1f}"),
    ("prefill tok/s", "prefill_tps", "{:.1f}"),
    ("peak GB", "peak_gb", "{:.3f}"),
    ("KV MB", "kv_mb", "{:.1f}"),
    ("x stock-kv4", "speedup_vs_stock_kv4", "{:.1f}"),
]


def run(model, config, n_prompt, decode_tokens, seed):
    lm_generate = importlib.import_module("mlx_lm.generate")
    from mlx_lm.models import cache as lm_cache

    prompt = mx.random.randint(0, 256, (n_prompt,), key=mx.random.key(seed))
    ours = config.startswith("mlxq")
    pair = config == "mlxq-k8v4"  # 8-bit keys, KV_BITS values
    # (mlxq-kv4*: 4-bit keys and the window as named, not the recipe's)
    options = dict(
        kv_hadamard=config.endswith("-rot"),
        v_bits=KV_BITS if pair else None,
        k_bits=None if pair else KV_BITS,
        kv_recent=128 if "-w128" in config else 0,
    )
    handle = mlxq_lm.enable(**({} if config == "mlxq-recipe" else options)) if ours else None
    apart = config.endswith("-apart")
    if apart:
        fused_recent = mlxq_ext._environment()["MLXQ_CUDA_FUSED_RECENT"]
        mlxq_ext._set_environment("MLXQ_CUDA_FUSED_RECENT", "0")
    try:
        if ours:
            bits = 8 if pair else KV_BITS
            cache = lm_cache.make_prompt_cache(model, kv_bits=bits, kv_group_size=KV_GROUP)
            kwargs = dict(kv_bits=bits, kv_group_size=KV_GROUP, quantized_kv_start=0)
        elif config == "stock-kv4":
            cache = lm_cache.make_prompt_cache(model)
            kwargs = dict(kv_bits=KV_BITS, kv_group_size=KV_GROUP, quantized_kv_start=n_prompt - 1)
        else:
            cache = lm_cache.make_prompt_cache(model)
            kwargs = {}
        mx.eval(prompt)
        mx.clear_cache()
        mx.reset_peak_memory()
        stamps = []
        t0 = time.perf_counter()
        for _token, _ in lm_generate.generate_step(
            prompt,
            model,
            max_tokens=decode_tokens,
            prompt_cache=cache,
            prefill_step_size=PREFILL_STEP,
            **kwargs,
        ):
            stamps.append(time.perf_counter())
        peak = mx.get_peak_memory()
        counts = mlxq_lm.counters() if ours else {}
    finally:
        if handle is not None:
            mlxq_lm.disable()
            mlxq_lm.reset_counters()
        if apart:
            mlxq_ext._set_environment("MLXQ_CUDA_FUSED_RECENT", fused_recent)
    steps = [b - a for a, b in zip(stamps, stamps[1:])][2:]
    kinds = sorted({type(c).__module__.split(".")[0] + "." + type(c).__name__ for c in cache})
    return {
        "context": n_prompt,
        "config": config,
        "decode_tps": 1.0 / statistics.median(steps),
        "decode_ms": 1e3 * statistics.median(steps),
        "decode_ms_min": 1e3 * min(steps),
        "decode_ms_all": [1e3 * s for s in steps],
        "decode_tps_mean": len(steps) / sum(steps),
        "prefill_s": stamps[0] - t0,
        "prefill_tps": n_prompt / (stamps[0] - t0),
        "peak_gb": peak / 1e9,
        "kv_mb": sum(c.nbytes for c in cache) / 1e6,
        "cache_classes": kinds,
        "attention_calls": counts,
    }


def median_run(runs):
    """One row for repeated runs of a configuration: the medians of their
    decode step and prefill time, the highest peak, each run's values kept."""
    if len(runs) == 1:
        return runs[0]
    row = dict(runs[0])
    row["decode_ms"] = statistics.median(r["decode_ms"] for r in runs)
    row["decode_tps"] = 1e3 / row["decode_ms"]
    row["decode_ms_min"] = min(r["decode_ms_min"] for r in runs)
    row["prefill_s"] = statistics.median(r["prefill_s"] for r in runs)
    row["prefill_tps"] = row["context"] / row["prefill_s"]
    row["peak_gb"] = max(r["peak_gb"] for r in runs)
    row["repeats"] = [
        {k: r[k] for k in ("decode_ms", "decode_ms_min", "prefill_s", "peak_gb")} for r in runs
    ]
    del row["decode_ms_all"]
    return row


def plot(rows, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_mem, ax_tps) = plt.subplots(1, 2, figsize=(10, 4))
    for config, style in zip(CONFIGS, ("o-", "s--", "^-", "v:", "d-.", "x-", "+--")):
        pts = sorted((r["context"], r) for r in rows if r["config"] == config)
        if not pts:
            continue
        xs = [n for n, _ in pts]
        ax_mem.plot(xs, [r["peak_gb"] for _, r in pts], style, label=config)
        ax_tps.plot(xs, [r["decode_tps"] for _, r in pts], style, label=config)
    contexts = sorted({r["context"] for r in rows})
    for ax, ylabel in ((ax_mem, "peak memory (GB, weights included)"), (ax_tps, "decode tokens/s")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts, [f"{n // 1024}k" if n % 1024 == 0 else str(n) for n in contexts])
        ax.minorticks_off()
        ax.set_xlabel("context (prompt tokens)")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"saved {path}")


def _title(model, machine):
    name = model.get("name", "random llama")
    return (
        f"mlx-lm generate_step, {name}: {model['num_hidden_layers']} layers, hidden "
        f"{model['hidden_size']}, {model['num_attention_heads']}/"
        f"{model['num_key_value_heads']} heads x {model['head_dim']}, bf16, kv_bits 4 "
        f"- {machine['cpu']} ({machine['cpu_count']} cores), MLX {machine['mlx_version']}"
    )


def main():
    if "--gpu" in sys.argv[1:]:
        import gpu_runs

        return gpu_runs.main([a for a in sys.argv[1:] if a != "--gpu"])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpu", action="store_true", help="the GPU set (see --gpu --help)")
    p.add_argument(
        "--contexts",
        type=int,
        nargs="+",
        default=CONTEXTS,
        help=f"prompt lengths (default {CONTEXTS})",
    )
    p.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, choices=CONFIGS)
    p.add_argument("--gguf", default=None, help="a packaged trained model (mlxq.gguf.PACKAGED)")
    p.add_argument(
        "--shape-of",
        default=None,
        choices=sorted(SHAPES),
        help="random weights in a packaged model's class and configuration",
    )
    p.add_argument(
        "--decode-tokens",
        type=int,
        default=24,
        help="tokens generated per run (default 24; the first two are not timed)",
    )
    p.add_argument("--layers", type=int, default=8, help="decoder layers (default 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per configuration and context, in rotated order; rows give medians",
    )
    common.add_output_args(p)
    p.add_argument(
        "--plot-only", action="store_true", help="redraw the plot from the JSON of an earlier run"
    )
    args = p.parse_args()
    out = common.output_path(args, "e2e_cpu")
    if args.plot_only:
        with open(out) as f:
            saved = json.load(f)
        plot(
            saved["results"],
            os.path.splitext(out)[0] + ".png",
            _title(saved["model"], saved["machine"]),
        )
        return

    if args.gguf:
        from mlxq import gguf

        model, _ = gguf.load_packaged(args.gguf, dtype=mx.bfloat16)
        margs = model.args
    elif args.shape_of:
        arch, overrides = SHAPES[args.shape_of]
        model, _ = random_model(arch, seed=args.seed, dtype=mx.bfloat16, **overrides)
        _, margs = model_args(arch, **overrides)
    else:
        overrides = dict(num_hidden_layers=args.layers)
        model, _ = random_model("llama", "small", seed=args.seed, **overrides)
        _, margs = model_args("llama", "small", **overrides)
    config = {
        k: getattr(margs, k, None)
        for k in (
            "hidden_size",
            "num_hidden_layers",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
        )
    }
    config["name"] = args.gguf or (
        f"{args.shape_of} shape, random weights" if args.shape_of else "random llama"
    )
    weights_gb = sum(v.nbytes for _, v in tree_flatten(model.parameters())) / 1e9
    info = common.machine_info()
    common.print_machine(info)
    print(
        f"model   : {config}, {num_parameters(model) / 1e6:.1f}M params, "
        f"bf16 weights {weights_gb:.3f} GB"
    )
    print(
        f"runs    : prefill step {PREFILL_STEP}, {args.decode_tokens} decode tokens, "
        f"kv_bits {KV_BITS} group {KV_GROUP}\n"
    )
    table = common.Table(COLUMNS)
    table.header()
    rows = []
    for n in args.contexts:
        runs = {c: [] for c in args.configs}
        for i in range(args.repeats):
            k = i % len(args.configs)
            for c in args.configs[k:] + args.configs[:k]:
                runs[c].append(run(model, c, n, args.decode_tokens, args.seed))
        group = [median_run(runs[c]) for c in args.configs]
        stock4 = next((r for r in group if r["config"] == "stock-kv4"), None)
        for r in group:
            if stock4 is not None:
                r["speedup_vs_stock_kv4"] = r["decode_tps"] / stock4["decode_tps"]
            table.row(r)
            rows.append(r)
    common.save_json(
        out,
        {
            "benchmark": "e2e",
            "description": __doc__,
            "machine": info,
            "model": dict(
                config,
                params=num_parameters(model),
                weights_gb=weights_gb,
                dtype="bfloat16",
                arch=type(model).__module__,
            ),
            "prefill_step_size": PREFILL_STEP,
            "kv_bits": KV_BITS,
            "kv_group_size": KV_GROUP,
            "decode_tokens": args.decode_tokens,
            "repeats": args.repeats,
            "results": rows,
        },
    )
    try:
        plot(rows, os.path.splitext(out)[0] + ".png", _title(config, info))
    except ImportError:
        print("matplotlib is not installed (pip install mlxq[bench]): no plot")


if __name__ == "__main__":
    main()
