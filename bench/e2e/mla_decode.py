"""MLA decode with a quantized latent cache against bf16: the step and the bytes.

A random-weight model of mlx-lm's deepseek_v3 class at DeepSeek-V3's
attention dims (kv_lora_rank 512, RoPE 64, nope 128, v 128; 16 heads and
hidden 2048 as DeepSeek-V2-Lite, dense MLPs: ``mlxq.random_models``
"deepseek_v3" "small") gets every layer's cache filled with N random latent
rows and RoPE keys directly (no prefill), then decodes greedily:

  stock-bf16   mlx-lm's KVCache (bf16 latent and RoPE keys), mlx-lm's attention
  mlxq-kv8     mlxq's latent cache (QuantizedKVCache(latent=True), 8-bit
               latent, exact RoPE keys), mlxq.mlx_lm enabled: decode
               attends the quantized latent with mlxq's fused kernel
  mlxq-kv4     the same at 4 bits

Two loops per run, in alternating rounds: ``bare`` (model call, argmax,
async_eval one step ahead, as generate_step pipelines) and ``generate``
(mlx-lm's generate_step over the filled caches). ms per token are medians;
``KV B/token`` is the cache's bytes per token over all layers, and the
ratios are against stock-bf16 at the same N.

    python bench/e2e/mla_decode.py --contexts 8192 32768
"""

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common  # noqa: E402
import decode_step  # noqa: E402
import gpu_runs  # noqa: E402
import mlx.core as mx  # noqa: E402

import mlxq  # noqa: E402
from mlxq.random_models import random_model  # noqa: E402

RUNS = {"stock-bf16": None, "mlxq-kv8": 8, "mlxq-kv4": 4}


def filled_caches(model, bits, N):
    from mlx_lm.models import cache as lm_cache

    attn = model.model.layers[0].self_attn
    caches = []
    for _ in model.layers:
        c = lm_cache.KVCache() if bits is None else mlxq.QuantizedKVCache(64, bits, latent=True)
        done = 0
        while done < N:
            n = min(8192, N - done)
            latent = mx.random.normal((1, 1, n, attn.kv_lora_rank)).astype(mx.bfloat16)
            rope = mx.random.normal((1, 1, n, attn.qk_rope_head_dim)).astype(mx.bfloat16)
            mx.eval(c.update_and_fetch(latent, rope))
            done += n
        caches.append(c)
    return caches


def kv_bytes(caches, N):
    return sum(c.nbytes for c in caches) / N if all(c.offset == N for c in caches) else None


def trim_to(caches, N):
    for c in caches:
        c.trim(c.offset - N)


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size", choices=("tiny", "small"), default="small")
    p.add_argument("--layers", type=int, help="override the layer count")
    p.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    common.add_output_args(p)
    args = p.parse_args()
    info = common.machine_info()
    common.print_machine(info)
    overrides = {} if args.layers is None else {"num_hidden_layers": args.layers}
    model, _ = random_model("deepseek_v3", args.size, dtype=mx.bfloat16, **overrides)
    cols = [
        ("N", "N", "{}"),
        ("run", "run", "{}"),
        ("KV B/token", "kv_bytes_per_token", "{:.0f}"),
        ("x bf16 bytes", "bytes_ratio", "{:.3f}"),
        ("bare ms", "bare_ms", "{:.2f}"),
        ("x bf16", "bare_ratio", "{:.2f}"),
        ("generate_step ms", "generate_ms", "{:.2f}"),
        ("x bf16 ", "generate_ratio", "{:.2f}"),
    ]
    table, rows = common.Table(cols), []
    table.header()
    for N in args.contexts:
        caches = {run: filled_caches(model, bits, N) for run, bits in RUNS.items()}
        sizes = {run: kv_bytes(c, N) for run, c in caches.items()}
        samples = {run: ([], []) for run in RUNS}
        for _ in range(args.rounds):
            for run in RUNS:
                with decode_step._mlxq_enabled(run):
                    samples[run][0].append(decode_step.bare(model, caches[run], args.steps, []))
                    trim_to(caches[run], N)
                    # The caches are quantized already: generate_step gets no kv_bits.
                    samples[run][1].append(
                        decode_step.generate(model, caches[run], args.steps, False)
                    )
                    trim_to(caches[run], N)
        base = {k: statistics.median(samples["stock-bf16"][i]) for i, k in enumerate("bg")}
        for run in RUNS:
            r = dict(N=N, run=run, size=args.size, layers=len(model.layers))
            r["bare_ms"] = statistics.median(samples[run][0])
            r["generate_ms"] = statistics.median(samples[run][1])
            r["bare_ratio"] = r["bare_ms"] / base["b"]
            r["generate_ratio"] = r["generate_ms"] / base["g"]
            r["kv_bytes_per_token"] = sizes[run]
            r["bytes_ratio"] = sizes[run] / sizes["stock-bf16"]
            table.row(r)
            rows.append(r)
        del caches
    slug, device = gpu_runs.device_name()
    info["device"] = device
    common.save_json(
        common.output_path(args, f"mla_decode_{slug}"), {"machine": info, "rows": rows}
    )


if __name__ == "__main__":
    main()
