"""Compiled decode against eager decode, end to end through mlx-lm.

mlx-lm's ``generate_step`` (greedy) decodes from a cache filled to a given
context on models of mlx-lm's llama class with random bf16 weights:

  123m     the random llama of bench/e2e.py (hidden 1024, 8 layers, 8/2
           heads x 128, vocab 32000): the CPU model
  1b, 8b   the 1B / 8B llama shapes of bench/e2e/gpu_runs.py: the GPU models

Runs, back to back in one process for each (model, context):

  stock-bf16        stock mlx-lm (mlxq disabled), unquantized cache, eager
  mlxq-bf16-comp    mlxq.mlx_lm.enable(compiled_decode=True), unquantized cache
                    (compiled in the CPU run saved here; these rows are why
                    compiled decode now leaves unquantized caches to eager
                    decode, as it always did on CUDA)
  mlxq-kv4          mlxq enabled, kv_bits=4 (group 64) caches, eager decode
  mlxq-kv4-comp     the same with enable(compiled_decode=True)
  floor-comp        host time only: stock MLX, the model's one-token step with
                    no cache (attention over the token alone) through one
                    mx.compile graph. Every primitive of the model but the
                    cache's is in it, so its build + dispatch is the least host
                    time any compiled decode of this model can have in MLX
                    (MLX's replay of a compiled graph and its per-primitive
                    dispatch); "host x eager" of this row is that floor over
                    eager decode's host time

The cache is filled with random K/V rows up to the context (a decode step's
time does not depend on their values; prefilling 32k tokens of the 123M
model would take an hour on a 2-core CPU), then ``generate_step`` gets a
one-token prompt and that cache and decodes ``--decode-tokens`` tokens.

Per run: decode ms/token = median gap between consecutive tokens (the first
three skipped: they include the compiled run's trace). Host time is taken
apart from the device's in ``--host-steps`` more steps on the same cache,
each started on an idle device (``mx.synchronize()`` first): build ms = the
model call (for compiled runs the caches' bookkeeping plus replaying the
graph), dispatch ms = the step's ``mx.async_eval`` (on a GPU the kernel
launches are encoded on this thread; on the CPU, MLX's encoder waits for
the CPU stream's queue, so it includes kernel time there), host ms/token =
build + dispatch on a GPU, build alone on the CPU (medians). traces = the
compiled graphs traced in the run, and trace s = the slowest step (a
retrace). "x eager" is the kv4 run's eager decode time over this one's
(> 1: faster), "x stock" stock-bf16's.

    python bench/e2e/compiled_decode.py                                # CPU: 123m at 2k, 32k
    python bench/e2e/compiled_decode.py --models 1b 8b --contexts 2048 8192 32768   # GPU
"""

import argparse
import importlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common  # noqa: E402
import mlx.core as mx  # noqa: E402

import mlxq.mlx_lm as mlxq_lm  # noqa: E402
from mlxq.compiled import CompiledModel, decoder_for  # noqa: E402
from mlxq.random_models import model_args, num_parameters, random_model  # noqa: E402

CONFIGS = ["stock-bf16", "mlxq-bf16-comp", "mlxq-kv4", "mlxq-kv4-comp", "floor-comp"]
KV_BITS, KV_GROUP = 4, 64
FILL_CHUNK = 4096
SKIP = 3
GPU = mx.default_device().type == mx.gpu

COLUMNS = [
    ("model", "model", "{}"),
    ("context", "context", "{}"),
    ("run", "config", "{}"),
    ("decode tok/s", "decode_tps", "{:.1f}"),
    ("ms/token", "decode_ms", "{:.2f}"),
    ("build ms", "build_ms", "{:.3f}"),
    ("dispatch ms", "dispatch_ms", "{:.3f}"),
    ("host ms/token", "host_ms", "{:.3f}"),
    ("host x eager", "host_x_eager", "{:.2f}"),
    ("x eager", "x_eager", "{:.2f}"),
    ("x stock", "x_stock", "{:.2f}"),
    ("traces", "traces", "{}"),
    ("trace s", "trace_s", "{:.2f}"),
]


def build(name, layers, seed):
    if name == "123m":
        overrides = dict(num_hidden_layers=layers or 8)
        model, _ = random_model("llama", "small", seed=seed, dtype=mx.bfloat16, **overrides)
        _, args = model_args("llama", "small", **overrides)
        return model, args
    import gpu_runs

    model, args, _ = gpu_runs.build_model(name, layers, seed)
    return model, args


def fill(cache, args, context, seed):
    """``context`` random K/V rows in every layer's cache (as prefill would
    leave them, without running the model)."""
    key = mx.random.key(seed)
    heads = args.num_key_value_heads
    dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    for c in cache:
        done = 0
        while done < context:
            n = min(FILL_CHUNK, context - done)
            key, k1, k2 = mx.random.split(key, 3)
            k = mx.random.normal((1, heads, n, dim), key=k1).astype(mx.bfloat16)
            v = mx.random.normal((1, heads, n, dim), key=k2).astype(mx.bfloat16)
            c.update_and_fetch(k, v)
            mx.eval(c.keys, c.values)
            done += n


def host_steps(call, cache, steps):
    """(build, dispatch) seconds of ``steps`` one-token steps, each started
    on an idle device."""
    y = mx.array([[1]], dtype=mx.uint32)
    times = []
    for _ in range(steps):
        mx.synchronize()
        t0 = time.perf_counter()
        logits = call(y, cache=cache)
        t1 = time.perf_counter()
        mx.async_eval(logits)
        t2 = time.perf_counter()
        mx.eval(logits)
        times.append((t1 - t0, t2 - t1))
        y = mx.argmax(logits[:, -1], axis=-1)[:, None].astype(mx.uint32)
    return times


def host_stats(hosts) -> dict:
    """A row's host columns from host_steps' (build, dispatch) seconds (the
    first SKIP steps left out of the medians)."""
    return {
        "build_ms": 1e3 * statistics.median(b for b, _ in hosts[SKIP:]),
        "dispatch_ms": 1e3 * statistics.median(d for _, d in hosts[SKIP:]),
        "host_ms": 1e3 * statistics.median([b + d * GPU for b, d in hosts[SKIP:]]),
        "host_ms_all": [[1e3 * b, 1e3 * d] for b, d in hosts],
    }


def floor_run(model, context, host_steps_n):
    """The floor-comp row: host time of the model's compiled cacheless step."""
    step = mx.compile(lambda y: model(y))
    hosts = host_steps(lambda y, cache: step(y), None, host_steps_n + SKIP)
    return {
        "context": context,
        "config": "floor-comp",
        **host_stats(hosts),
    }


def run(model, args, config, context, decode_tokens, seed, host_steps_n=16):
    if config == "floor-comp":
        return floor_run(model, context, host_steps_n)
    lm_generate = importlib.import_module("mlx_lm.generate")
    from mlx_lm.models import cache as lm_cache

    ours = config.startswith("mlxq")
    compiled = config.endswith("-comp")
    bits = KV_BITS if "kv4" in config else None
    if ours:
        # (kv_recent=0: a recent window's steps decode eagerly; k_bits: plain 4-bit)
        mlxq_lm.enable(compiled_decode=compiled, kv_recent=0, k_bits=KV_BITS)
    try:
        if ours:
            cache = mlxq_lm.make_prompt_cache(model, kv_bits=bits, kv_group_size=KV_GROUP)
            if compiled:  # mlxq's plain caches (generate_step would swap them in too)
                mlxq_lm.generation.compiled_model(model, cache)
        else:
            cache = lm_cache.make_prompt_cache(model)
        fill(cache, args, context, seed)
        dec = decoder_for(model)
        traces = dec.traces
        kwargs = dict(kv_bits=bits, kv_group_size=KV_GROUP, quantized_kv_start=0) if bits else {}
        prompt = mx.array([1], dtype=mx.uint32)
        stamps = []
        for _ in lm_generate.generate_step(
            prompt, model, max_tokens=decode_tokens, prompt_cache=cache, **kwargs
        ):
            stamps.append(time.perf_counter())
        hosts = host_steps(CompiledModel(model) if compiled else model, cache, host_steps_n)
        traces = dec.traces - traces
        declined = dec.declined
    finally:
        mlxq_lm.disable()
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    steps = gaps[SKIP:]
    return {
        "context": context,
        "config": config,
        "decode_ms": 1e3 * statistics.median(steps),
        "decode_tps": 1.0 / statistics.median(steps),
        "decode_ms_all": [1e3 * s for s in gaps],
        **host_stats(hosts),
        "traces": traces if compiled else None,
        "trace_s": max(gaps[:SKIP]) if compiled else None,
        "declined": declined if compiled else None,
        "kv_mb": sum(c.nbytes for c in cache) / 1e6,
    }


def add_ratios(rows):
    by = {(r["model"], r["context"], r["config"]): r for r in rows}
    for r in rows:
        eager = by.get((r["model"], r["context"], "mlxq-kv4"))
        stock = by.get((r["model"], r["context"], "stock-bf16"))
        if eager:
            r["host_x_eager"] = r["host_ms"] / eager["host_ms"]
        if "decode_ms" not in r:  # the floor row: host time only
            continue
        if eager:
            r["x_eager"] = eager["decode_ms"] / r["decode_ms"]
        if stock:
            r["x_stock"] = stock["decode_ms"] / r["decode_ms"]


def plot(rows, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["model"], r["context"]) for r in rows}, key=lambda g: (g[0], g[1]))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(CONFIGS)
    for i, config in enumerate(CONFIGS):
        for ax, key in zip(axes, ("decode_tps", "host_ms")):
            vals = [
                next(
                    (
                        r.get(key, 0)
                        for r in rows
                        if (r["model"], r["context"]) == g and r["config"] == config
                    ),
                    0,
                )
                for g in groups
            ]
            ax.bar([j + i * width for j in range(len(groups))], vals, width, label=config)
    labels = [f"{m}\n{c // 1024}k" for m, c in groups]
    for ax, ylabel in zip(
        axes, ("decode tokens/s (higher is better)", "host ms/token (lower is better)")
    ):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))], labels)
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"saved {path}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    gpu = mx.default_device().type == mx.gpu
    p.add_argument("--models", nargs="+", default=["1b", "8b"] if gpu else ["123m"])
    p.add_argument(
        "--contexts", type=int, nargs="+", default=[2048, 8192, 32768] if gpu else [2048, 32768]
    )
    p.add_argument("--configs", nargs="+", default=CONFIGS, choices=CONFIGS)
    p.add_argument("--decode-tokens", type=int, default=64 if gpu else 24)
    p.add_argument("--host-steps", type=int, default=16, help="steps timed on an idle device")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's)")
    p.add_argument("--seed", type=int, default=0)
    common.add_output_args(p)
    args = p.parse_args()
    info = common.machine_info()
    device = info["cpu"]
    if gpu:
        import gpu_runs

        device = gpu_runs.device_name()[1]
    common.print_machine(info)
    print(f"device  : {device}\n")
    name = "compiled_decode_" + (common.slug(device) if gpu else "cpu")
    out = common.output_path(args, name)
    table = common.Table(COLUMNS)
    table.header()
    rows, models = [], {}
    for m in args.models:
        model, margs = build(m, args.layers, args.seed)
        models[m] = dict(params=num_parameters(model), layers=margs.num_hidden_layers)
        # Untimed warm-up: kernels and the CPU's fused-kernel compiles.
        for config in args.configs:
            run(model, margs, config, 300, 6, args.seed, 4)
        for context in args.contexts:
            for config in args.configs:
                r = run(
                    model, margs, config, context, args.decode_tokens, args.seed, args.host_steps
                )
                r["model"] = m
                rows.append(r)
                add_ratios(rows)
                table.row(r)
                common.save_json(
                    out, dict(machine=info, device=device, models=models, results=rows), quiet=True
                )
        del model
        mx.clear_cache()
    print()
    common.save_json(out, dict(machine=info, device=device, models=models, results=rows))
    plot(rows, os.path.splitext(out)[0] + ".png", f"compiled vs eager decode, {device}")


if __name__ == "__main__":
    main()
