"""Continuous batching with quantized KV: mlx-lm's BatchGenerator, stock
against mlxq, on random-weight models of mlx-lm's llama class.

``--prompts`` prompts (default 8) of each context length, ``--max-tokens``
(default 64) greedy tokens each, three runs back to back in one process:

  stock-bf16     stock mlx-lm, BatchGenerator (what batch_generate runs), bf16
                 KV, all prompts prefilled and decoded as one batch
  stock-kv4      stock mlx-lm, kv_bits=4 group 64, one prompt at a time with
                 generate_step: what mlx_lm.server does with --kv-bits (it
                 cannot batch quantized caches), at its fastest schedule
                 (quantized_kv_start = prompt length - 1: prefill on a bf16
                 cache, decode on mlx-lm's quantized attention composition).
                 On MLX's CUDA backend that composition's quantized_matmul
                 has no kernel for these shapes: the error is recorded.
  mlxq-kv4       mlxq.mlx_lm enabled, BatchGenerator(kv_bits=4,
                 kv_group_size=64, quantized_kv_start=0): the batch cache is
                 quantized from the first token (mlxq's batch caches)

Per run: decode tok/s = generated tokens over the time spent in decode
steps (BatchGenerator's own counter; for stock-kv4, the sum over prompts of
the time from each prompt's first token to its last), so it is the batch's
throughput; prefill s = time spent on prompts; peak GB =
mx.get_peak_memory() over the run (reset before; weights included) plus
the peak of mlxq's own CUDA pool where there is one; KV MB = the largest
total ``nbytes`` of the KV caches held at once during decode (the batch
caches, padding and growth headroom included; for stock-kv4 the one
sequence's cache that is held at a time), and KV MB/seq the same per
sequence.

    python bench/e2e/batch.py                        # CPU: a small model, 2k prompts
    python bench/e2e/batch.py --model 1b --contexts 2048 8192   # the GPU run
"""

import argparse
import gc
import importlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common  # noqa: E402
import gpu_runs  # noqa: E402
import mlx.core as mx  # noqa: E402

import mlxq  # noqa: E402
import mlxq.mlx_lm as mlxq_lm  # noqa: E402

CONFIGS = ["stock-bf16", "stock-kv4", "mlxq-kv4"]
KV_BITS, KV_GROUP = 4, 64
PREFILL_STEP = 2048
# A model the 2-core CPU can prefill 8 x 2k prompts of in minutes: MLX's CPU
# matmuls run at a few GFLOP/s there, so the 1B shape would take hours. The
# attention is the 1B/8B's (GQA 4, head dim 128); the matmuls are small.
gpu_runs.MODELS.setdefault(
    "cpu-small",
    (
        "llama",
        dict(
            hidden_size=512,
            num_hidden_layers=4,
            intermediate_size=1024,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=128,
            vocab_size=1024,
        ),
    ),
)

COLUMNS = [
    ("context", "context", "{}"),
    ("run", "config", "{}"),
    ("decode tok/s", "decode_tps", "{:.1f}"),
    ("prefill s", "prefill_s", "{:.2f}"),
    ("peak GB", "peak_gb", "{:.3f}"),
    ("KV MB", "kv_mb", "{:.1f}"),
    ("KV MB/seq", "kv_mb_per_seq", "{:.2f}"),
    ("x stock-bf16", "x_bf16", "{:.2f}"),
    ("x stock-kv4", "x_kv4", "{:.2f}"),
]


def _pool_peak():
    """mlxq's own CUDA pool peak in bytes since the last call (0 elsewhere)."""
    try:
        return mlxq._ext._device_memory()[1]
    except (AttributeError, RuntimeError):
        return 0


def _cache_bytes(cache):
    return sum(c.nbytes for c in cache)


def batched(model, prompts, max_tokens, ours):
    """The batch through BatchGenerator (mlx-lm's, or mlxq's with kv_bits)."""
    lm_generate = importlib.import_module("mlx_lm.generate")
    kwargs = dict(kv_bits=KV_BITS, kv_group_size=KV_GROUP, quantized_kv_start=0) if ours else {}
    gen = lm_generate.BatchGenerator(
        model,
        max_tokens=max_tokens,
        prefill_batch_size=len(prompts),
        completion_batch_size=len(prompts),
        prefill_step_size=PREFILL_STEP,
        **kwargs,
    )
    kv, kinds, tokens = 0, set(), 0
    with gen.stats() as stats:
        gen.insert(prompts, [max_tokens] * len(prompts))
        while responses := gen.next_generated():
            tokens += len(responses)
            cache = gen._generation_batch.prompt_cache
            if cache:
                kv = max(kv, _cache_bytes(cache))
                kinds |= {type(c).__name__ for c in cache}
    gen.close()
    return dict(
        decode_tps=stats.generation_tokens / stats.decode_time,
        decode_s=stats.decode_time,
        prefill_s=stats.prompt_time,
        generated=tokens,
        kv_mb=kv / 1e6,
        kv_mb_per_seq=kv / 1e6 / len(prompts),
        cache_classes=sorted(kinds),
    )


def one_at_a_time(model, prompts, max_tokens):
    """Stock mlx-lm's kv_bits path, prompt after prompt (mlx_lm.server --kv-bits)."""
    lm_generate = importlib.import_module("mlx_lm.generate")
    from mlx_lm.models import cache as lm_cache

    decode_s = prefill_s = 0.0
    kv = generated = 0
    for p in prompts:
        cache = lm_cache.make_prompt_cache(model)
        prompt = mx.array(p)
        t0 = time.perf_counter()
        stamps = []
        for _ in lm_generate.generate_step(
            prompt,
            model,
            max_tokens=max_tokens,
            prompt_cache=cache,
            prefill_step_size=PREFILL_STEP,
            kv_bits=KV_BITS,
            kv_group_size=KV_GROUP,
            quantized_kv_start=len(p) - 1,
        ):
            stamps.append(time.perf_counter())
        prefill_s += stamps[0] - t0
        decode_s += stamps[-1] - stamps[0]
        generated += len(stamps) - 1
        kv = max(kv, _cache_bytes(cache))
        del cache
    return dict(
        decode_tps=generated / decode_s,
        decode_s=decode_s,
        prefill_s=prefill_s,
        generated=generated,
        kv_mb=kv / 1e6,
        kv_mb_per_seq=kv / 1e6,
        cache_classes=["QuantizedKVCache (mlx-lm)"],
    )


def run(model, config, prompts, max_tokens):
    gc.collect()
    mx.clear_cache()
    mx.synchronize()
    row = {"config": config, "prompts": len(prompts), "max_tokens": max_tokens}
    if config == "mlxq-kv4":
        mlxq_lm.enable(kv_recent=0, k_bits=KV_BITS)  # plain 4-bit: no window, 4-bit keys
    try:
        mx.reset_peak_memory()
        _pool_peak()  # restarts it
        if config == "stock-kv4":
            row.update(one_at_a_time(model, prompts, max_tokens))
        else:
            row.update(batched(model, prompts, max_tokens, ours=config == "mlxq-kv4"))
        mx.synchronize()
    except Exception as e:  # noqa: BLE001 - stock-kv4 raises on CUDA; the run goes on
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    finally:
        row["peak_gb"] = (mx.get_peak_memory() + _pool_peak()) / 1e9
        if config == "mlxq-kv4":
            mlxq_lm.disable()
    gc.collect()
    mx.clear_cache()
    return row


def plot(rows, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    contexts = sorted({r["context"] for r in rows})
    width = 0.8 / len(CONFIGS)
    for i, config in enumerate(CONFIGS):
        for ax, key in zip(axes, ("decode_tps", "peak_gb", "kv_mb")):
            ys = [
                next(
                    (r.get(key, 0) for r in rows if r["context"] == n and r["config"] == config), 0
                )
                for n in contexts
            ]
            ax.bar([j + i * width for j in range(len(contexts))], ys, width, label=config)
    for ax, label in zip(
        axes, ("decode tokens/s (whole batch)", "peak memory GB (weights included)", "KV MB")
    ):
        ax.set_xticks(
            [j + width for j in range(len(contexts))], [f"{n // 1024}k" for n in contexts]
        )
        ax.set_xlabel("prompt tokens per sequence")
        ax.set_ylabel(label)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"saved {path}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, choices=sorted(gpu_runs.MODELS))
    p.add_argument("--contexts", type=int, nargs="+", default=None)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--configs", nargs="+", default=CONFIGS, choices=CONFIGS)
    p.add_argument("--seed", type=int, default=0)
    common.add_output_args(p)
    args = p.parse_args()
    gpu = mx.default_device().type == mx.gpu
    name = args.model or ("1b" if gpu else "cpu-small")
    contexts = args.contexts or ([2048, 8192] if gpu else [2048])
    info = common.machine_info()
    slug, device = gpu_runs.device_name()
    out = common.output_path(args, f"batch_{slug}")
    model, margs, desc = gpu_runs.build_model(name, args.layers, args.seed)
    common.print_machine(info)
    print(f"model   : {name} {desc['arch']}, {desc['params'] / 1e6:.0f}M params, bf16")
    print(f"runs    : {args.prompts} prompts x {contexts} tokens, {args.max_tokens} new each\n")
    table = common.Table(COLUMNS)
    table.header()
    rows = []
    for n in contexts:
        keys = [mx.random.key(args.seed * 1000 + i) for i in range(args.prompts)]
        prompts = [mx.random.randint(0, margs.vocab_size, (n,), key=k).tolist() for k in keys]
        # An untimed batch first: kernel compilation and allocator warm-up.
        run(model, CONFIGS[-1] if CONFIGS[-1] in args.configs else args.configs[0], prompts[:2], 4)
        group = [dict(run(model, c, prompts, args.max_tokens), context=n) for c in args.configs]
        base = {r["config"]: r for r in group if "error" not in r}
        for r in group:
            for ref, key in (("stock-bf16", "x_bf16"), ("stock-kv4", "x_kv4")):
                if ref in base and "error" not in r:
                    r[key] = r["decode_tps"] / base[ref]["decode_tps"]
            table.row(r)
            if "error" in r:
                print(f"    {r['config']}: {r['error']}")
            rows.append(r)
        common.save_json(
            out,
            {
                "benchmark": "batch",
                "description": __doc__,
                "machine": info,
                "device": device,
                "model": dict(desc, name=name),
                "kv_bits": KV_BITS,
                "kv_group_size": KV_GROUP,
                "prefill_step_size": PREFILL_STEP,
                "results": rows,
            },
        )
    plot(
        rows,
        os.path.splitext(out)[0] + ".png",
        f"BatchGenerator, {args.prompts} prompts x {args.max_tokens} tokens, {name} llama shape "
        f"(random bf16 weights), kv_bits 4 - {device}",
    )


if __name__ == "__main__":
    main()
