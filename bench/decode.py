"""Decode-attention benchmark: mlxq against stock MLX, in one process.

Decode (L=1, B=1) over a quantized KV cache of N tokens, for each shape, bits
and N, timing:

  mlxq   mlxq.sdpa(q, k_triple, v_triple)                  the fused kernel
  f32    the same with MLXQ_CPU_INT=0: on the CPU, the kernel's f32 products
         instead of its integer ones (csrc/cpu/int_dot.h); the "kernel"
         column says which products the mlxq row used
  fast   mx.fast.scaled_dot_product_attention on bf16 K/V   (the same cache, unquantized)
  comp   mlx-lm's quantized_scaled_dot_product_attention   (two quantized_matmuls;
         mlxq.reference.quantized_sdpa when mlx-lm is not installed)

and the bytes/s mlxq reaches reading the packed codes + scales + biases of K and
V once. Prints a table and saves it as JSON (default bench/results/decode_cpu.json).

    python bench/decode.py            # full grid
    python bench/decode.py --quick    # small N, few repeats
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import mlx.core as mx  # noqa: E402

import mlxq  # noqa: E402

SHAPES = [(32, 8, 128), (16, 8, 256)]  # (Hq, Hkv, D)
NS = [1024, 4096, 16384, 32768]
BITS = [4, 8]
GROUP_SIZE = 64

COLUMNS = [
    ("Hq/Hkv/D", "shape", "{}"),
    ("bits", "bits", "{}"),
    ("N", "N", "{}"),
    ("kernel", "kernel", "{}"),
    ("mlxq ms", "mlxq_ms", "{:.3f}"),
    ("f32 ms", "f32_products_ms", "{:.3f}"),
    ("fast bf16 ms", "fast_bf16_ms", "{:.3f}"),
    ("comp ms", "comp_ms", "{:.3f}"),
    ("x fast", "speedup_vs_fast", "{:.1f}"),
    ("x comp", "speedup_vs_comp", "{:.1f}"),
    ("mlxq GB/s", "mlxq_gbps", "{:.1f}"),
    ("err mlxq", "mlxq_rel_err_vs_f32", "{:.1e}"),
    ("err comp", "comp_rel_err_vs_f32", "{:.1e}"),
]


def composition():
    """mlx-lm's composition if mlx-lm imports, else mlxq's copy of it."""
    try:
        from mlx_lm.models.base import quantized_scaled_dot_product_attention as f

        def comp(q, k, v, scale, bits):
            # mlx-lm scales its queries in place (`queries *= scale`), which
            # overwrites the caller's array: hand it a fresh one every call.
            return f(mx.array(q), k, v, scale=scale, mask=None, group_size=GROUP_SIZE, bits=bits)

        import mlx_lm

        return (
            comp,
            f"mlx_lm.models.base.quantized_scaled_dot_product_attention "
            f"(mlx-lm {getattr(mlx_lm, '__version__', '?')})",
        )
    except Exception:  # not installed, or broken (missing deps)

        def comp(q, k, v, scale, bits):
            return mlxq.reference.quantized_sdpa(
                q, k, v, scale=scale, group_size=GROUP_SIZE, bits=bits
            )

        return comp, "mlxq.reference.quantized_sdpa"


def nbytes(arrays):
    return sum(a.nbytes for a in arrays)


def bench_row(Hq, Hkv, D, N, bits, comp, args):
    B, L = 1, 1
    scale = D**-0.5
    q = mx.random.normal((B, Hq, L, D)).astype(mx.bfloat16)
    k = mx.random.normal((B, Hkv, N, D)).astype(mx.bfloat16)
    v = mx.random.normal((B, Hkv, N, D)).astype(mx.bfloat16)
    kq = mx.quantize(k, group_size=GROUP_SIZE, bits=bits)
    vq = mx.quantize(v, group_size=GROUP_SIZE, bits=bits)
    mx.eval(q, k, v, kq, vq)

    t_mlxq = common.time_fn(
        lambda: mlxq.sdpa(q, kq, vq, scale=scale), warmup=args.warmup, repeats=args.repeats
    )
    mlxq._ext._take_last_sdpa_kernel()
    mx.eval(mlxq.sdpa(q, kq, vq, scale=scale))
    kernel = mlxq._ext._take_last_sdpa_kernel() or None
    t_f32 = None
    if mx.default_device() == mx.cpu:
        os.environ["MLXQ_CPU_INT"] = "0"
        try:
            t_f32 = common.time_fn(
                lambda: mlxq.sdpa(q, kq, vq, scale=scale), warmup=args.warmup, repeats=args.repeats
            )
        finally:
            del os.environ["MLXQ_CPU_INT"]
    t_fast = common.time_fn(
        lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale),
        warmup=args.warmup,
        repeats=args.repeats,
    )
    t_comp = common.time_fn(
        lambda: comp(q, kq, vq, scale, bits), warmup=args.comp_warmup, repeats=args.comp_repeats
    )

    # Sanity: both quantized paths against f32 attention over the dequantized
    # cache (the composition's bf16 scores make it the less accurate of the two).
    kd, vd = (
        mx.dequantize(*t, group_size=GROUP_SIZE, bits=bits).astype(mx.float32) for t in (kq, vq)
    )
    ref = mx.fast.scaled_dot_product_attention(q.astype(mx.float32), kd, vd, scale=scale)
    mx.eval(ref)
    del kd, vd

    def rel_err(out):
        out = out.astype(mx.float32)
        return (mx.linalg.norm(out - ref) / mx.linalg.norm(ref)).item()

    err_mlxq = rel_err(mlxq.sdpa(q, kq, vq, scale=scale))
    err_comp = rel_err(comp(q, kq, vq, scale, bits))

    q_bytes = nbytes(kq) + nbytes(vq)
    bf16_bytes = k.nbytes + v.nbytes
    ms = t_mlxq["median_ms"]
    return {
        "shape": f"{Hq}/{Hkv}/{D}",
        "B": B,
        "L": L,
        "Hq": Hq,
        "Hkv": Hkv,
        "D": D,
        "N": N,
        "bits": bits,
        "group_size": GROUP_SIZE,
        "kernel": kernel,
        "mlxq_ms": ms,
        "f32_products_ms": t_f32["median_ms"] if t_f32 else None,
        "fast_bf16_ms": t_fast["median_ms"],
        "comp_ms": t_comp["median_ms"],
        "speedup_vs_fast": t_fast["median_ms"] / ms,
        "speedup_vs_comp": t_comp["median_ms"] / ms,
        "quantized_kv_bytes": q_bytes,
        "bf16_kv_bytes": bf16_bytes,
        "mlxq_gbps": q_bytes / (ms * 1e-3) / 1e9,
        "fast_bf16_gbps": bf16_bytes / (t_fast["median_ms"] * 1e-3) / 1e9,
        "mlxq_rel_err_vs_f32": err_mlxq,
        "comp_rel_err_vs_f32": err_comp,
        "mlxq_min_ms": t_mlxq["min_ms"],
        "fast_bf16_min_ms": t_fast["min_ms"],
        "comp_min_ms": t_comp["min_ms"],
        "mlxq_times_ms": t_mlxq["times_ms"],
        "fast_bf16_times_ms": t_fast["times_ms"],
        "comp_times_ms": t_comp["times_ms"],
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick", action="store_true", help="N in {1024, 4096}, 5 repeats (3 for the composition)"
    )
    p.add_argument("--n", type=int, nargs="+", help=f"cache lengths (default {NS})")
    p.add_argument(
        "--bits",
        type=int,
        nargs="+",
        choices=[2, 3, 4, 5, 6, 8],
        help=f"quantization bits (default {BITS})",
    )
    p.add_argument("--repeats", type=int, help="timed calls for mlxq and mx.fast (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls first (default 3)")
    p.add_argument(
        "--comp-repeats",
        type=int,
        default=3,
        help="timed calls for the slow composition (default 3, at least 3)",
    )
    p.add_argument(
        "--comp-warmup",
        type=int,
        default=1,
        help="untimed composition calls first (default 1, at least 1)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out",
        help="JSON output path (default bench/results/decode_cpu.json, "
        "or decode_cpu_quick.json with --quick)",
    )
    args = p.parse_args()

    if args.out is None:
        args.out = common.results_path("decode_cpu", args.quick)
    ns = args.n or ([1024, 4096] if args.quick else NS)
    bits_list = args.bits or BITS
    if args.repeats is None:
        args.repeats = 5 if args.quick else 20
    args.repeats = max(args.repeats, 3)
    args.comp_repeats = max(args.comp_repeats, 3)
    args.comp_warmup = max(args.comp_warmup, 1)
    args.warmup = max(args.warmup, 1)
    mx.random.seed(args.seed)

    comp, comp_name = composition()
    info = common.machine_info()
    common.print_machine(info)
    print(
        f"decode  : B=1 L=1, q/K/V bf16, group size {GROUP_SIZE}; "
        f"medians of {args.repeats} (composition {args.comp_repeats}) after "
        f"{args.warmup} ({args.comp_warmup}) warm-up calls"
    )
    print(f"comp    : {comp_name}")
    print("GB/s    : packed codes + scales + biases of K and V, read once, / mlxq time")
    print("err     : ||out - ref|| / ||ref||, ref = f32 attention over the dequantized K/V")
    print()

    table = common.Table(COLUMNS)
    table.header()
    rows = []
    for Hq, Hkv, D in SHAPES:
        for bits in bits_list:
            for N in ns:
                row = bench_row(Hq, Hkv, D, N, bits, comp, args)
                rows.append(row)
                table.row(row)
                mx.clear_cache()

    common.save_json(
        args.out,
        {
            "benchmark": "decode",
            "machine": info,
            "mlx_version": info["mlx_version"],
            "date": info["date"],
            "composition": comp_name,
            "settings": {
                "B": 1,
                "L": 1,
                "dtype": "bfloat16",
                "group_size": GROUP_SIZE,
                "shapes": [list(s) for s in SHAPES],
                "N": ns,
                "bits": bits_list,
                "repeats": args.repeats,
                "warmup": args.warmup,
                "comp_repeats": args.comp_repeats,
                "comp_warmup": args.comp_warmup,
                "seed": args.seed,
                "quick": args.quick,
            },
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
