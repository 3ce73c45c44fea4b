"""GPU benchmark (CUDA or Metal): decode, prefill and ring updates, mlxq against
stock MLX in one process.

  decode   L=1, B=1, N in {4096, 32768, 131072}, Hq/Hkv/D 32/8/128 and 16/8/256,
           4- and 8-bit, group 64: mlxq vs mx.fast on bf16 K/V vs mlx-lm's
           two-quantized_matmul composition (mlxq.reference's copy of it when
           mlx-lm is not installed); effective GB/s = packed codes + scales +
           biases of K and V / mlxq time. Two timings of each: one call per
           eval (includes MLX's per-eval launch and sync, ~0.05-0.1 ms), and
           "in graph": 64 calls per eval on distinct inputs that together
           overflow the L2 cache, as the layers of a model's decode step run.
  prefill  causal L = N in {4096, 16384}, 32/8/128, 4-bit: time and peak memory.
  ring     per-token cache write into [1, 8, N, 128] at N in {1k, 128k}: mlxq
           ring_update / quantized_ring_update with an array position (what a
           compiled decode step passes) vs mx.slice_update with an array position
           and a static slice assignment.

    python bench/gpu.py [--quick] [--out bench/results/gpu_<name>.json]
"""

import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mlx.core as mx  # noqa: E402

import common  # noqa: E402
import mlxq  # noqa: E402

GROUP = 64
INT32_MAX = 2**31 - 1


def gpu_name():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, check=True).stdout
        return out.strip().splitlines()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return mx.device_info().get("device_name", "gpu")


def composition():
    try:
        from mlx_lm.models.base import quantized_scaled_dot_product_attention as f

        # mlx-lm scales its queries in place: hand it a fresh array each call.
        return "mlx-lm", lambda q, k, v, scale, mask, bits: f(
            mx.array(q), k, v, scale=scale, mask=mask, group_size=GROUP, bits=bits)
    except ImportError:
        return "mlxq.reference (mlx-lm not installed)", lambda q, k, v, scale, mask, bits: (
            mlxq.reference.quantized_sdpa(q, k, v, scale=scale, mask=mask,
                                          group_size=GROUP, bits=bits))


def inputs(Hq, Hkv, D, L, N, bits):
    q = mx.random.normal((1, Hq, L, D)).astype(mx.bfloat16)
    k = mx.random.normal((1, Hkv, N, D)).astype(mx.bfloat16)
    v = mx.random.normal((1, Hkv, N, D)).astype(mx.bfloat16)
    kq = mx.quantize(k, group_size=GROUP, bits=bits)
    vq = mx.quantize(v, group_size=GROUP, bits=bits)
    mx.eval(q, k, v, kq, vq)
    return q, k, v, kq, vq


def peak_of(fn):
    mx.eval(fn())
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    mx.eval(fn())
    mx.synchronize()
    return (mx.get_peak_memory() - base) / 2**20


GRAPH_CALLS = 64
L2_FLUSH_BYTES = 200 * 2**20  # inputs per graph: several times the H200's 50 MB L2


def time_graph(fn_of_set, sets, repeats):
    """Milliseconds per call with GRAPH_CALLS calls in one eval, cycling over
    `sets` distinct input sets."""
    t = common.time_fn(lambda: [fn_of_set(i % sets) for i in range(GRAPH_CALLS)],
                       warmup=2, repeats=repeats)
    return t["median_ms"] / GRAPH_CALLS


def decode(args, comp):
    cols = [("Hq/Hkv/D", "shape", "{}"), ("bits", "bits", "{}"), ("N", "N", "{}"),
            ("mlxq ms", "mlxq_ms", "{:.4f}"), ("fast bf16 ms", "fast_ms", "{:.4f}"),
            ("comp ms", "comp_ms", "{:.4f}"), ("x fast", "x_fast", "{:.2f}"),
            ("x comp", "x_comp", "{:.1f}"), ("mlxq GB/s", "gbps", "{:.0f}"),
            ("graph: mlxq ms", "mlxq_g_ms", "{:.4f}"), ("fast ms", "fast_g_ms", "{:.4f}"),
            ("comp ms", "comp_g_ms", "{:.4f}"), ("x fast", "x_fast_g", "{:.2f}"),
            ("x comp", "x_comp_g", "{:.1f}"), ("GB/s", "gbps_g", "{:.0f}")]
    table, rows = common.Table(cols), []
    table.header()
    ns = [4096, 32768] if args.quick else [4096, 32768, 131072]
    for Hq, Hkv, D in [(32, 8, 128), (16, 8, 256)]:
        for bits in (4, 8):
            for N in ns:
                q, k, v, kq, vq = inputs(Hq, Hkv, D, 1, N, bits)
                scale = D**-0.5
                t_mlxq = common.time_fn(lambda: mlxq.sdpa(q, kq, vq, scale=scale),
                                        warmup=5, repeats=args.repeats)
                t_fast = common.time_fn(
                    lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale),
                    warmup=5, repeats=args.repeats)
                t_comp = common.time_fn(lambda: comp(q, kq, vq, scale, None, bits),
                                        warmup=3, repeats=max(5, args.repeats // 4))
                nbytes = sum(a.nbytes for a in (*kq, *vq))
                sets = max(1, min(GRAPH_CALLS, -(-L2_FLUSH_BYTES // nbytes)))
                pool = [(q, k, v, kq, vq)] + [inputs(Hq, Hkv, D, 1, N, bits)
                                              for _ in range(sets - 1)]
                g_mlxq = time_graph(lambda i: mlxq.sdpa(pool[i][0], pool[i][3], pool[i][4],
                                                        scale=scale), sets, args.repeats // 5)
                g_fast = time_graph(lambda i: mx.fast.scaled_dot_product_attention(
                    pool[i][0], pool[i][1], pool[i][2], scale=scale), sets, args.repeats // 5)
                g_comp = time_graph(lambda i: comp(pool[i][0], pool[i][3], pool[i][4], scale,
                                                   None, bits), sets, 3)
                del pool
                r = dict(shape=f"{Hq}/{Hkv}/{D}", bits=bits, N=N,
                         mlxq_ms=t_mlxq["median_ms"], fast_ms=t_fast["median_ms"],
                         comp_ms=t_comp["median_ms"], quantized_kv_bytes=nbytes,
                         graph_calls=GRAPH_CALLS, graph_input_sets=sets,
                         mlxq_g_ms=g_mlxq, fast_g_ms=g_fast, comp_g_ms=g_comp)
                r["x_fast"] = r["fast_ms"] / r["mlxq_ms"]
                r["x_comp"] = r["comp_ms"] / r["mlxq_ms"]
                r["gbps"] = nbytes / (r["mlxq_ms"] * 1e-3) / 1e9
                r["x_fast_g"] = g_fast / g_mlxq
                r["x_comp_g"] = g_comp / g_mlxq
                r["gbps_g"] = nbytes / (g_mlxq * 1e-3) / 1e9
                table.row(r)
                rows.append(r)
    return rows


def prefill(args, comp):
    cols = [("L=N", "L", "{}"), ("mlxq ms", "mlxq_ms", "{:.3f}"),
            ("mlxq MiB", "mlxq_mib", "{:.0f}"), ("fast bf16 ms", "fast_ms", "{:.3f}"),
            ("fast MiB", "fast_mib", "{:.0f}"), ("comp ms", "comp_ms", "{:.3f}"),
            ("comp MiB", "comp_mib", "{:.0f}"), ("x fast", "x_fast", "{:.2f}"),
            ("x comp", "x_comp", "{:.1f}"), ("mlxq TFLOP/s", "tflops", "{:.0f}")]
    table, rows = common.Table(cols), []
    table.header()
    Hq, Hkv, D, bits = 32, 8, 128, 4
    for L in ([2048, 4096] if args.quick else [4096, 16384]):
        q, k, v, kq, vq = inputs(Hq, Hkv, D, L, L, bits)
        scale = D**-0.5
        f_mlxq = lambda: mlxq.sdpa(q, kq, vq, scale=scale, mask="causal")  # noqa: E731
        f_fast = lambda: mx.fast.scaled_dot_product_attention(  # noqa: E731
            q, k, v, scale=scale, mask="causal")
        r = dict(L=L)
        # The composition first: on MLX 0.32.4 CUDA its quantized matmul
        # kernel failed to load when it ran after the others in one process.
        if Hq * L * L > INT32_MAX:
            r["comp_skipped"] = f"score tensor has {Hq * L * L} elements (> 2^31)"
        else:
            f_comp = lambda: comp(q, kq, vq, scale, "causal", bits)  # noqa: E731
            try:
                r["comp_ms"] = common.time_fn(f_comp, warmup=1, repeats=3)["median_ms"]
                r["comp_mib"] = peak_of(f_comp)
            except RuntimeError as e:
                r["comp_skipped"] = f"composition failed: {e}"
        r["mlxq_ms"] = common.time_fn(f_mlxq, warmup=2, repeats=5)["median_ms"]
        r["mlxq_mib"] = peak_of(f_mlxq)
        r["fast_ms"] = common.time_fn(f_fast, warmup=2, repeats=5)["median_ms"]
        r["fast_mib"] = peak_of(f_fast)
        if "comp_ms" in r:
            r["x_comp"] = r["comp_ms"] / r["mlxq_ms"]
        r["x_fast"] = r["fast_ms"] / r["mlxq_ms"]
        # Causal L = N: about half of the 4 * Hq * D * L * N flops of the two products.
        r["tflops"] = 2 * Hq * D * L * (L + 1) / (r["mlxq_ms"] * 1e-3) / 1e12
        table.row(r)
        if "comp_skipped" in r:
            print(f"  composition skipped: {r['comp_skipped']}")
        rows.append(r)
    return rows


def ring(args):
    cols = [("N", "N", "{}"), ("ring us", "ring_us", "{:.1f}"),
            ("qring us", "qring_us", "{:.1f}"), ("slice_update us", "slice_update_us", "{:.1f}"),
            ("static slice us", "static_us", "{:.1f}")]
    table, rows = common.Table(cols), []
    table.header()
    B, H, D, steps = 1, 8, 128, 50
    for N in (1024, 131072):
        row = mx.random.normal((B, H, 1, D)).astype(mx.bfloat16)
        mx.eval(row)
        r = dict(N=N)

        def per_token(update, state):
            # Writes `steps` tokens one eval at a time (as decode does), each
            # finished before the next: MLX's CUDA backend releases a step's
            # buffers on a worker thread after mx.eval returns, and a write
            # issued before that must copy (in a decode step the forward pass
            # runs in between).
            for i in range(3):
                state = update(state, i)
                mx.eval(state)
                mx.synchronize()
            import time
            t0 = time.perf_counter()
            for i in range(steps):
                state = update(state, i % N)
                mx.eval(state)
                mx.synchronize()
            return (time.perf_counter() - t0) / steps * 1e6

        buf = mx.zeros((B, H, N, D), dtype=mx.bfloat16)
        r["ring_us"] = per_token(lambda s, i: mlxq.ring_update(s, row, mx.array(i, dtype=mx.int32)), buf)
        del buf
        qbuf = mx.quantize(mx.zeros((B, H, N, D), dtype=mx.bfloat16), group_size=GROUP, bits=4)
        r["qring_us"] = per_token(lambda s, i: mlxq.quantized_ring_update(
            s, row, mx.array(i, dtype=mx.int32), group_size=GROUP, bits=4), qbuf)
        del qbuf
        buf = mx.zeros((B, H, N, D), dtype=mx.bfloat16)
        r["slice_update_us"] = per_token(
            lambda s, i: mx.slice_update(s, row, mx.array([i]), axes=(2,)), buf)
        del buf
        buf = mx.zeros((B, H, N, D), dtype=mx.bfloat16)

        def static(s, i):
            s[..., i:i + 1, :] = row
            return s
        r["static_us"] = per_token(static, buf)
        del buf
        table.row(r)
        rows.append(r)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--out")
    p.add_argument("--only", choices=["decode", "prefill", "ring"], action="append",
                   help="run only these parts (repeatable)")
    args = p.parse_args()
    if not mx.is_available(mx.gpu):
        sys.exit("bench/gpu.py needs an MLX GPU backend (CUDA or Metal).")
    mx.set_default_device(mx.gpu)
    mx.random.seed(0)
    info = common.machine_info()
    info["gpu"] = gpu_name()
    common.print_machine(info)
    print(f"gpu     : {info['gpu']}")
    comp_name, comp = composition()
    print(f"comp    : {comp_name}\n")
    results = {"machine": info, "composition": comp_name}
    parts = args.only or ["decode", "prefill", "ring"]
    if "decode" in parts:
        print("decode (B=1, L=1, bf16 q, group 64)")
        results["decode"] = decode(args, comp)
    if "prefill" in parts:
        print("\nprefill (causal, L = N, 32/8/128, 4-bit)")
        results["prefill"] = prefill(args, comp)
    if "ring" in parts:
        print("\nring updates (per token, [1, 8, N, 128] bf16; quantized: 4-bit)")
        results["ring"] = ring(args)
    slug = "".join(c if c.isalnum() else "_" for c in info["gpu"].lower()).strip("_")
    out = args.out or common.results_path(f"gpu_{slug}", args.quick)
    common.save_json(out, results)


if __name__ == "__main__":
    main()
