"""Where a decode step's time goes: host graph construction against the whole
step, in a bare pipelined loop and inside mlx-lm's generate_step.

A random-weight model of mlx-lm's llama class (the 8B or 1B shape of
bench/e2e/gpu_runs.py) gets caches filled with N random tokens directly (no
prefill); a packaged model's shape (``--shape-of gemma3-270m`` or
``smollm2-135m``, bench/e2e/e2e.py's SHAPES: sliding-window rings included)
gets its caches from a prefill of N random tokens in chunks of 2048. Then it
decodes ``--steps`` tokens three ways:

  bare         y = argmax(model(y, cache)); async_eval(y) before waiting on the
               previous token, as generate_step pipelines (--rounds rounds
               alternating between the two runs, median of their medians)
  generate     mlx-lm's generate_step(prompt=[token], prompt_cache=caches)
  build        in the bare loop, the graph construction alone: model(y,
               cache) and the argmax, before async_eval
  encode       in the bare loop, the async_eval call alone: MLX's C++ side
               (every primitive's eval_gpu, CUDA graph building and launch)

for the ``--runs``: stock mlx-lm (bf16 KVCache), mlxq-kv4 (4-bit caches,
mlxq.mlx_lm enabled with no recent window), mlxq-kv4-w128 (the same with
the last 128 tokens exact) and mlxq-recipe (what kv_bits=4 gets under a bare
enable(): 8-bit keys, 4-bit values and the window; ``--shape-of`` only, as
is mlxq-kv4-w128). ms per token are medians; "build" is the host time of one step's
graph (Python + MLX op construction); build + encode is the host's share of a
step, which the GPU hides only while it is shorter than the step's device
time.

    python bench/e2e/decode_step.py --model 8b --contexts 8192 65536
    python bench/e2e/decode_step.py --shape-of gemma3-270m --contexts 8192 32768 \
        --runs mlxq-kv4 mlxq-kv4-w128
"""

import argparse
import contextlib
import importlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import e2e  # noqa: E402
import mlx.core as mx  # noqa: E402

import mlxq  # noqa: E402
import mlxq.mlx_lm as mlxq_lm  # noqa: E402
from mlxq.random_models import random_model  # noqa: E402

RUNS = ("stock-bf16", "mlxq-kv4", "mlxq-kv4-w128", "mlxq-recipe")
# The runs whose caches come from a prefill: --shape-of only.
PREFILLED_ONLY = ("mlxq-kv4-w128", "mlxq-recipe")

SHAPES = {
    "8b": dict(
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
    ),
    "1b": dict(
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=8192,
        vocab_size=128256,
    ),
}


def llama(shape, layers=None):
    from mlx_lm.models import llama as lm_llama

    kw = dict(SHAPES[shape])
    if layers:
        kw["num_hidden_layers"] = layers
    args = lm_llama.ModelArgs(
        model_type="llama", rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False, **kw
    )
    model = lm_llama.Model(args)
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    return model, args


def filled_caches(model, args, run, N):
    from mlx_lm.models import cache as lm_cache

    Hkv = args.num_key_value_heads
    D = args.hidden_size // args.num_attention_heads
    caches = []
    for _ in model.layers:
        c = (
            mlxq.QuantizedKVCache(group_size=64, bits=4)
            if run == "mlxq-kv4"
            else lm_cache.KVCache()
        )
        done = 0
        while done < N:
            n = min(8192, N - done)
            x = mx.random.normal((1, Hkv, n, D)).astype(mx.bfloat16)
            mx.eval(c.update_and_fetch(x, x))
            done += n
        caches.append(c)
    return caches


def prefilled_caches(model, run, N):
    """Caches as generate_step leaves them after a prompt of N random tokens
    (the run's mlxq settings enabled by the caller)."""
    from mlx_lm.models import cache as lm_cache

    ours = run.startswith("mlxq")
    kw = dict(kv_bits=4, kv_group_size=64) if ours else {}
    caches = lm_cache.make_prompt_cache(model, **kw)
    prompt = mx.random.randint(0, 256, (1, N), key=mx.random.key(N))
    for lo in range(0, N, 2048):
        model(prompt[:, lo : lo + 2048], cache=caches)
        mx.eval([c.state for c in caches])
    return caches


def bare(model, caches, steps, encode_times, build_times):
    y = mx.array([1])
    times = []
    prev = None
    t_last = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        logits = model(y[None], cache=caches)
        y = mx.argmax(logits[:, -1, :], axis=-1)
        t1 = time.perf_counter()
        mx.async_eval(y)
        build_times.append(t1 - t0)
        encode_times.append(time.perf_counter() - t1)
        if prev is not None:
            prev.item()
            t = time.perf_counter()
            times.append(t - t_last)
            t_last = t
        prev = y
    prev.item()
    return statistics.median(times[2:]) * 1e3


def generate(model, caches, steps, ours):
    gen = importlib.import_module("mlx_lm.generate")
    kw = dict(kv_bits=4, kv_group_size=64, quantized_kv_start=0) if ours else {}
    times, t_last = [], None
    for _ in gen.generate_step(mx.array([1]), model, prompt_cache=caches, max_tokens=steps, **kw):
        t = time.perf_counter()
        if t_last is not None:
            times.append(t - t_last)
        t_last = t
    return statistics.median(times[2:]) * 1e3


@contextlib.contextmanager
def _mlxq_enabled(run):
    if run == "mlxq-recipe":
        handle = mlxq_lm.enable()  # nothing set: the recipe
    elif run.startswith("mlxq"):
        handle = mlxq_lm.enable(kv_recent=128 if run.endswith("-w128") else 0, k_bits=4)
    else:
        handle = None
    try:
        yield
    finally:
        if handle is not None:
            mlxq_lm.disable()


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", choices=sorted(SHAPES), default="8b")
    p.add_argument(
        "--shape-of",
        choices=sorted(e2e.SHAPES),
        help="a packaged model's class and configuration instead of --model",
    )
    p.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS[:2]))
    p.add_argument("--layers", type=int, help="override the layer count (quick looks)")
    p.add_argument("--contexts", type=int, nargs="+", default=[8192, 65536])
    p.add_argument("--steps", type=int, default=24)
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="alternating rounds of the bare loop per run (median reported)",
    )
    common.add_output_args(p)
    args = p.parse_args()
    info = common.machine_info()
    common.print_machine(info)
    if args.shape_of:
        arch, kw = e2e.SHAPES[args.shape_of]
        if args.layers:
            kw = dict(kw, num_hidden_layers=args.layers)
        model, _ = random_model(arch, "tiny", dtype=mx.bfloat16, **kw)
        name = args.shape_of
    else:
        bad = [r for r in args.runs if r in PREFILLED_ONLY]
        if bad:
            p.error(f"--runs {' '.join(bad)} need --shape-of (their caches come from a prefill)")
        model, margs = llama(args.model, args.layers)
        name = args.model
    cols = [
        ("N", "N", "{}"),
        ("run", "run", "{}"),
        ("bare ms", "bare_ms", "{:.2f}"),
        ("generate_step ms", "generate_ms", "{:.2f}"),
        ("build ms", "build_ms", "{:.2f}"),
        ("encode ms", "encode_ms", "{:.2f}"),
        ("bare x first run", "bare_ratio", "{:.2f}"),
        ("build x first run", "build_ratio", "{:.2f}"),
    ]
    table, rows = common.Table(cols), []
    table.header()
    runs = args.runs
    for N in args.contexts:
        # Both runs' caches at once, and the bare loop in alternating rounds:
        # a shared machine's drift then hits both runs alike.
        caches = {}
        for run in runs:
            with _mlxq_enabled(run):
                if args.shape_of:
                    caches[run] = prefilled_caches(model, run, N)
                else:
                    caches[run] = filled_caches(model, margs, run, N)
        samples = {run: ([], [], []) for run in runs}  # per round: step, encode, build ms
        for _ in range(args.rounds):
            for run in runs:
                with _mlxq_enabled(run):
                    encode, build = [], []
                    samples[run][0].append(bare(model, caches[run], args.steps, encode, build))
                    samples[run][1].append(statistics.median(encode[2:]) * 1e3)
                    samples[run][2].append(statistics.median(build[2:]) * 1e3)
        for run in runs:
            r = dict(N=N, run=run, model=name)
            r["bare_ms"] = statistics.median(samples[run][0])
            r["bare_rounds_ms"] = samples[run][0]
            r["encode_ms"] = statistics.median(samples[run][1])
            r["build_ms"] = statistics.median(samples[run][2])
            first = r
            if run != runs[0]:
                first = next(x for x in rows if x["N"] == N and x["run"] == runs[0])
            r["bare_ratio"] = r["bare_ms"] / first["bare_ms"]
            r["build_ratio"] = r["build_ms"] / first["build_ms"]
            with _mlxq_enabled(run):
                r["generate_ms"] = generate(model, caches[run], args.steps, run.startswith("mlxq"))
            table.row(r)
            rows.append(r)
        del caches
        mx.clear_cache()
    out = common.output_path(args, f"decode_step_{name}")
    common.save_json(out, {"machine": info, "rows": rows})


if __name__ == "__main__":
    main()
