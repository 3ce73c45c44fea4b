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
V once. mlxq, f32 and fast are timed in turn, call by call, so that a shared
machine's slow phases fall on all three alike.

On the CPU, with ggml available (bench/kernels/ggml.py: an installed
llama-cpp-python, or MLXQ_GGML_LIB naming a directory of ggml libraries), it
also times llama.cpp's flash attention (FLASH_ATTN_EXT) on the same shapes:
K/V in q4_0 (for 4-bit rows) or q8_0 (8-bit rows), and in f16, on
--ggml-threads threads. Without ggml it prints quoted numbers for the 2-core
CI machine classes and how they were measured.

Prints a table and saves it as JSON (default bench/results/decode_cpu.json).

    python bench/kernels/decode.py            # full grid
    python bench/kernels/decode.py --quick    # small N, few repeats
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common  # noqa: E402
import ggml_attention  # noqa: E402
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
    ("x f32", "speedup_vs_f32_products", "{:.2f}"),
    ("fast bf16 ms", "fast_bf16_ms", "{:.3f}"),
    ("comp ms", "comp_ms", "{:.3f}"),
    ("x fast", "speedup_vs_fast", "{:.1f}"),
    ("x comp", "speedup_vs_comp", "{:.1f}"),
    ("mlxq GB/s", "mlxq_gbps", "{:.1f}"),
    ("ggml q ms", "ggml_q_ms", "{:.2f}"),
    ("ggml f16 ms", "ggml_f16_ms", "{:.2f}"),
    ("x ggml q", "speedup_vs_ggml_q", "{:.1f}"),
    ("x ggml f16", "speedup_vs_ggml_f16", "{:.1f}"),
    ("err mlxq", "mlxq_rel_err_vs_f32", "{:.1e}"),
    ("err comp", "comp_rel_err_vs_f32", "{:.1e}"),
]


# What llama.cpp measured on this machine class, printed where ggml is not
# available (32/8/128, N = 32768, 2 threads).
QUOTED_GGML = (
    "Measured on the 2-core CI machine classes (32/8/128, N = 32768, 2 threads, "
    "ggml 0.25.3 from the llama-cpp-python 0.3.36 sdist built with GGML_NATIVE, through "
    "this script): Intel Ice Lake, in runs whose mx.fast bf16 took 250-720 ms, q4_0 "
    "63-97 ms, q8_0 35-49 ms, f16 33-47 ms; AMD EPYC (Zen 4), mx.fast 270 ms, q4_0 "
    "51.4 ms, q8_0 32.6 ms, f16 17.3 ms."
)


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

    fns = {
        "mlxq": lambda: mlxq.sdpa(q, kq, vq, scale=scale),
        "fast": lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale),
    }
    on_cpu = mx.default_device() == mx.cpu
    if on_cpu:
        fns["f32"] = lambda: common.cpu_int_path("0", lambda: mlxq.sdpa(q, kq, vq, scale=scale))
    t = common.time_interleaved(fns, warmup=args.warmup, repeats=args.repeats)
    t_mlxq, t_fast, t_f32 = t["mlxq"], t["fast"], t.get("f32")
    mlxq._ext._take_last_sdpa_kernel()
    mx.eval(mlxq.sdpa(q, kq, vq, scale=scale))
    kernel = mlxq._ext._take_last_sdpa_kernel() or None
    ggml = {}
    if on_cpu and args.ggml:
        for name, kv_type in (("q", {4: "q4_0", 8: "q8_0"}.get(bits)), ("f16", "f16")):
            if kv_type:
                ggml[name] = ggml_attention.time_decode(
                    Hq, Hkv, D, N, kv_type, threads=args.ggml_threads, repeats=args.ggml_repeats
                )
                ggml[name]["type"] = kv_type
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
        "speedup_vs_f32_products": t_f32["median_ms"] / ms if t_f32 else None,
        "ggml_q_type": ggml["q"]["type"] if "q" in ggml else None,
        "ggml_q_ms": ggml["q"]["median_ms"] if "q" in ggml else None,
        "ggml_f16_ms": ggml["f16"]["median_ms"] if "f16" in ggml else None,
        "speedup_vs_ggml_q": ggml["q"]["median_ms"] / ms if "q" in ggml else None,
        "speedup_vs_ggml_f16": ggml["f16"]["median_ms"] / ms if "f16" in ggml else None,
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
    p.add_argument(
        "--ggml-threads", type=int, default=2, help="threads for llama.cpp's kernel (default 2)"
    )
    p.add_argument("--ggml-repeats", type=int, default=5, help="timed llama.cpp calls (default 5)")
    p.add_argument("--no-ggml", dest="ggml", action="store_false", help="skip llama.cpp")
    p.add_argument("--seed", type=int, default=0)
    common.add_output_args(p)
    args = p.parse_args()

    args.out = common.output_path(args, "decode_cpu", args.quick)
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
    if mx.default_device() == mx.cpu and args.ggml:
        have, where = ggml_attention.available()
        args.ggml = have
        if have:
            print(
                f"ggml    : llama.cpp flash attention from {where}, q = q4_0 (4-bit rows) or "
                f"q8_0 (8-bit rows), {args.ggml_threads} threads, medians of {args.ggml_repeats}"
            )
        else:
            print(f"ggml    : {where}.")
            print(f"          {QUOTED_GGML}")
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
