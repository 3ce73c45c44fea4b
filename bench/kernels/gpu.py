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
  pairs    decode in graph over K/V quantization pairs (K4/V4, K8/V4 with
           group-64 or group-32 values, K8/V8) at 32/8/128, 16/8/256 and
           9/3/64 (SmolLM2's shape), with the kernel family each reached
           (only with --only pairs).
  prefill  causal, 32/8/128, 4-bit, L x N from 4096 x 4096 to 512 x 131072 and few
           rows over 32k keys: mlxq as routed (MLX's fused attention over the
           layer's dequantized K/V where it has a fused kernel), mlxq's tiled
           kernel, mx.fast on bf16 K/V; time and peak memory.
  wide     Gemma 4's prefill shapes (8 query / 1 KV head, 4-bit, L = 2048): head
           dim 256 under its sliding-window mask (an array over window + L - 1
           keys) and 512 causal over 2k-32k keys, which MLX has no fused kernel
           for on CUDA: mlxq (the kernel family it reached: cuda_gemm, GEMMs
           over key blocks from 4096 keys, or the tiled kernel;
           MLXQ_CUDA_GEMM=0 for the tiled kernel throughout) and mx.fast on
           bf16 K/V (MLX's unfused fallback there, which materialises the
           scores).
  ring     per-token cache write into [1, 8, N, 128] at N in {1k, 128k}: mlxq
           ring_update / quantized_ring_update with an array position (what a
           compiled decode step passes) vs mx.slice_update with an array position
           and a static slice assignment.
  cache    a decode step's cache write + attention, pipelined with async_eval as
           generate_step runs: mlxq's 4-bit QuantizedKVCache vs mlx-lm's bf16
           KVCache at N in {4k, 32k, 128k}; flat in N = no copies.

    python bench/kernels/gpu.py [--quick] [--out bench/results/gpu_<name>.json]
"""

import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common  # noqa: E402
import mlx.core as mx  # noqa: E402

import mlxq  # noqa: E402

GROUP = 64
INT32_MAX = 2**31 - 1


def gpu_name():
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return out.strip().splitlines()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return mx.device_info().get("device_name", "gpu")


def composition():
    try:
        from mlx_lm.models.base import quantized_scaled_dot_product_attention as f

        # mlx-lm scales its queries in place: hand it a fresh array each call.
        return "mlx-lm", lambda q, k, v, scale, mask, bits: f(
            mx.array(q), k, v, scale=scale, mask=mask, group_size=GROUP, bits=bits
        )
    except ImportError:
        return (
            "mlxq.reference (mlx-lm not installed)",
            lambda q, k, v, scale, mask, bits: mlxq.reference.quantized_sdpa(
                q, k, v, scale=scale, mask=mask, group_size=GROUP, bits=bits
            ),
        )


def inputs(Hq, Hkv, D, L, N, bits):
    q = mx.random.normal((1, Hq, L, D)).astype(mx.bfloat16)
    k = mx.random.normal((1, Hkv, N, D)).astype(mx.bfloat16)
    v = mx.random.normal((1, Hkv, N, D)).astype(mx.bfloat16)
    kq = mx.quantize(k, group_size=GROUP, bits=bits)
    vq = mx.quantize(v, group_size=GROUP, bits=bits)
    mx.eval(q, k, v, kq, vq)
    return q, k, v, kq, vq


def peak_of(fn, before=None):
    """MiB above the active memory that one evaluation of fn() allocates at
    its peak (``before`` runs first: e.g. dropping buffers a warm-up left)."""
    mx.eval(fn())
    mx.synchronize()
    if before is not None:
        before()
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
    t = common.time_fn(
        lambda: [fn_of_set(i % sets) for i in range(GRAPH_CALLS)], warmup=2, repeats=repeats
    )
    return t["median_ms"] / GRAPH_CALLS


def decode(args, comp):
    cols = [
        ("Hq/Hkv/D", "shape", "{}"),
        ("bits", "bits", "{}"),
        ("N", "N", "{}"),
        ("mlxq ms", "mlxq_ms", "{:.4f}"),
        ("fast bf16 ms", "fast_ms", "{:.4f}"),
        ("comp ms", "comp_ms", "{:.4f}"),
        ("x fast", "x_fast", "{:.2f}"),
        ("x comp", "x_comp", "{:.1f}"),
        ("mlxq GB/s", "gbps", "{:.0f}"),
        ("graph: mlxq ms", "mlxq_g_ms", "{:.4f}"),
        ("fast ms", "fast_g_ms", "{:.4f}"),
        ("comp ms", "comp_g_ms", "{:.4f}"),
        ("x fast", "x_fast_g", "{:.2f}"),
        ("x comp", "x_comp_g", "{:.1f}"),
        ("GB/s", "gbps_g", "{:.0f}"),
    ]
    table, rows = common.Table(cols), []
    table.header()
    ns = [4096, 32768] if args.quick else [4096, 32768, 131072]
    for Hq, Hkv, D in [(32, 8, 128), (16, 8, 256)]:
        for bits in (4, 8):
            for N in ns:
                q, k, v, kq, vq = inputs(Hq, Hkv, D, 1, N, bits)
                scale = D**-0.5
                t_mlxq = common.time_fn(
                    lambda: mlxq.sdpa(q, kq, vq, scale=scale), warmup=5, repeats=args.repeats
                )
                t_fast = common.time_fn(
                    lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale),
                    warmup=5,
                    repeats=args.repeats,
                )
                t_comp = common.time_fn(
                    lambda: comp(q, kq, vq, scale, None, bits),
                    warmup=3,
                    repeats=max(5, args.repeats // 4),
                )
                nbytes = sum(a.nbytes for a in (*kq, *vq))
                sets = max(1, min(GRAPH_CALLS, -(-L2_FLUSH_BYTES // nbytes)))
                pool = [(q, k, v, kq, vq)] + [
                    inputs(Hq, Hkv, D, 1, N, bits) for _ in range(sets - 1)
                ]
                g_mlxq = time_graph(
                    lambda i: mlxq.sdpa(pool[i][0], pool[i][3], pool[i][4], scale=scale),
                    sets,
                    args.repeats // 5,
                )
                g_fast = time_graph(
                    lambda i: mx.fast.scaled_dot_product_attention(
                        pool[i][0], pool[i][1], pool[i][2], scale=scale
                    ),
                    sets,
                    args.repeats // 5,
                )
                g_comp = time_graph(
                    lambda i: comp(pool[i][0], pool[i][3], pool[i][4], scale, None, bits), sets, 3
                )
                del pool
                r = dict(
                    shape=f"{Hq}/{Hkv}/{D}",
                    bits=bits,
                    N=N,
                    mlxq_ms=t_mlxq["median_ms"],
                    fast_ms=t_fast["median_ms"],
                    comp_ms=t_comp["median_ms"],
                    quantized_kv_bytes=nbytes,
                    graph_calls=GRAPH_CALLS,
                    graph_input_sets=sets,
                    mlxq_g_ms=g_mlxq,
                    fast_g_ms=g_fast,
                    comp_g_ms=g_comp,
                )
                r["x_fast"] = r["fast_ms"] / r["mlxq_ms"]
                r["x_comp"] = r["comp_ms"] / r["mlxq_ms"]
                r["gbps"] = nbytes / (r["mlxq_ms"] * 1e-3) / 1e9
                r["x_fast_g"] = g_fast / g_mlxq
                r["x_comp_g"] = g_comp / g_mlxq
                r["gbps_g"] = nbytes / (g_mlxq * 1e-3) / 1e9
                table.row(r)
                rows.append(r)
    return rows


# Key/value quantization pairs of the pairs part: (label, k bits, k group,
# v bits, v group).
PAIRS = [
    ("K4/V4 g64", 4, 64, 4, 64),
    ("K8/V4 g64", 8, 64, 4, 64),
    ("K8/V4 g64/32", 8, 64, 4, 32),
    ("K8/V8 g64", 8, 64, 8, 64),
]


def pairs(args):
    """Decode in graph (B=1, L=1) over each K/V pair against mx.fast on bf16
    K/V: K8/V4 should sit between K4/V4 and K8/V8 in time, as in bytes."""
    cols = [
        ("Hq/Hkv/D", "shape", "{}"),
        ("pair", "pair", "{}"),
        ("N", "N", "{}"),
        ("kernel", "kernel", "{}"),
        ("mlxq ms", "mlxq_g_ms", "{:.4f}"),
        ("fast bf16 ms", "fast_g_ms", "{:.4f}"),
        ("x fast", "x_fast_g", "{:.2f}"),
        ("GB/s", "gbps_g", "{:.0f}"),
    ]
    table, rows = common.Table(cols), []
    table.header()
    ns = [4096, 32768] if args.quick else [4096, 32768, 131072]
    for Hq, Hkv, D in [(32, 8, 128), (16, 8, 256), (9, 3, 64)]:
        for N in ns:
            scale = D**-0.5

            def make(kb, kg, vb, vg):
                q = mx.random.normal((1, Hq, 1, D)).astype(mx.bfloat16)
                k = mx.random.normal((1, Hkv, N, D)).astype(mx.bfloat16)
                v = mx.random.normal((1, Hkv, N, D)).astype(mx.bfloat16)
                kq = mx.quantize(k, group_size=kg, bits=kb)
                vq = mx.quantize(v, group_size=vg, bits=vb)
                mx.eval(q, k, v, kq, vq)
                return q, k, v, kq, vq

            fast_g = None
            for label, kb, kg, vb, vg in PAIRS:
                first = make(kb, kg, vb, vg)
                nbytes = sum(a.nbytes for a in (*first[3], *first[4]))
                sets = max(1, min(GRAPH_CALLS, -(-L2_FLUSH_BYTES // nbytes)))
                pool = [first] + [make(kb, kg, vb, vg) for _ in range(sets - 1)]

                def call(i, pool=pool, vb=vb, vg=vg):
                    q, _, _, kq, vq = pool[i]
                    return mlxq.sdpa(q, kq, vq, scale=scale, v_bits=vb, v_group_size=vg)

                mlxq._ext._take_last_sdpa_kernel()
                mx.eval(call(0))
                kernel = mlxq._ext._take_last_sdpa_kernel()
                g_mlxq = time_graph(call, sets, args.repeats // 5)
                if fast_g is None:
                    fast_g = time_graph(
                        lambda i: mx.fast.scaled_dot_product_attention(
                            pool[i][0], pool[i][1], pool[i][2], scale=scale
                        ),
                        sets,
                        args.repeats // 5,
                    )
                del pool
                r = dict(
                    shape=f"{Hq}/{Hkv}/{D}",
                    pair=label,
                    N=N,
                    kernel=kernel,
                    quantized_kv_bytes=nbytes,
                    mlxq_g_ms=g_mlxq,
                    fast_g_ms=fast_g,
                    x_fast_g=fast_g / g_mlxq,
                    gbps_g=nbytes / (g_mlxq * 1e-3) / 1e9,
                )
                table.row(r)
                rows.append(r)
    return rows


PREFILL_SHAPES = [
    (4096, 4096),
    (16384, 16384),
    (2048, 131072),
    (512, 131072),
    (16, 32768),
    (64, 32768),
    (256, 32768),
]
QUICK_PREFILL_SHAPES = [(2048, 2048), (64, 8192)]


def prefill(args, comp):
    """Causal many-row attention over a 4-bit cache: mlxq as it routes (on a
    GPU, MLX's fused attention over the layer's dequantized K/V where that
    has a fused kernel: see mlxq.routing), mlxq's own tiled kernel (route
    off), and mx.fast on bf16 K/V."""
    from mlxq import routing, workspace

    cols = [
        ("L", "L", "{}"),
        ("N", "N", "{}"),
        ("mlxq ms", "mlxq_ms", "{:.3f}"),
        ("mlxq MiB", "mlxq_mib", "{:.0f}"),
        ("tiled ms", "tiled_ms", "{:.3f}"),
        ("fast bf16 ms", "fast_ms", "{:.3f}"),
        ("fast MiB", "fast_mib", "{:.0f}"),
        ("comp ms", "comp_ms", "{:.3f}"),
        ("x fast", "x_fast", "{:.2f}"),
        ("x tiled", "x_tiled", "{:.1f}"),
        ("routed", "routed", "{}"),
    ]
    table, rows = common.Table(cols), []
    table.header()
    Hq, Hkv, D, bits = 32, 8, 128, 4
    for L, N in QUICK_PREFILL_SHAPES if args.quick else PREFILL_SHAPES:
        q, k, v, kq, vq = inputs(Hq, Hkv, D, L, N, bits)
        scale = D**-0.5
        f_mlxq = lambda: mlxq.sdpa(q, kq, vq, scale=scale, mask="causal")  # noqa: E731
        f_fast = lambda: mx.fast.scaled_dot_product_attention(  # noqa: E731
            q, k, v, scale=scale, mask="causal"
        )
        r = dict(L=L, N=N)
        # The composition first: on MLX 0.32.4 CUDA its quantized matmul
        # kernel failed to load when it ran after the others in one process.
        if Hq * L * N > INT32_MAX or L * N > 4096 * 4096:
            r["comp_skipped"] = f"score tensor of {Hq * L * N} elements"
        else:
            f_comp = lambda: comp(q, kq, vq, scale, "causal", bits)  # noqa: E731
            try:
                r["comp_ms"] = common.time_fn(f_comp, warmup=1, repeats=3)["median_ms"]
            except RuntimeError as e:
                r["comp_skipped"] = f"composition failed: {str(e).splitlines()[0]}"
        routing.take_route_counts()
        r["mlxq_ms"] = common.time_fn(f_mlxq, warmup=2, repeats=5)["median_ms"]
        r["routed"] = "mx.fast" if routing.take_route_counts() else "mlxq"
        # Its dense K/V buffers included (mlxq.workspace keeps them between calls).
        r["mlxq_mib"] = peak_of(f_mlxq, before=workspace.release_all)
        old = routing.set_dequantized_prefill(False)
        r["tiled_ms"] = common.time_fn(f_mlxq, warmup=2, repeats=5)["median_ms"]
        routing.set_dequantized_prefill(old)
        r["fast_ms"] = common.time_fn(f_fast, warmup=2, repeats=5)["median_ms"]
        r["fast_mib"] = peak_of(f_fast)
        r["x_fast"] = r["fast_ms"] / r["mlxq_ms"]
        r["x_tiled"] = r["tiled_ms"] / r["mlxq_ms"]
        table.row(r)
        if "comp_skipped" in r:
            print(f"  composition skipped: {r['comp_skipped']}")
        rows.append(r)
        del q, k, v, kq, vq
    return rows


WIDE_SHAPES = [  # (D, N, mask) at L = 2048
    (256, 2559, "window"),
    (256, 2048, "causal"),
    (256, 8192, "causal"),
    (256, 32768, "causal"),
    (512, 2048, "causal"),
    (512, 4096, "causal"),
    (512, 8192, "causal"),
    (512, 32768, "causal"),
]
QUICK_WIDE_SHAPES = [(256, 2559, "window"), (512, 2048, "causal")]


def wide(args):
    """Gemma 4's prefill attention shapes (see the module docstring)."""
    from mlxq import routing

    cols = [
        ("D", "D", "{}"),
        ("N", "N", "{}"),
        ("mask", "mask", "{}"),
        ("route", "route", "{}"),
        ("kernel", "kernel", "{}"),
        ("mlxq ms", "mlxq_ms", "{:.3f}"),
        ("fast bf16 ms", "fast_ms", "{:.3f}"),
        ("x fast", "x_fast", "{:.2f}"),
        ("mlxq TFLOP/s", "mlxq_tflops", "{:.1f}"),
    ]
    table, rows = common.Table(cols), []
    table.header()
    Hq, Hkv, L, bits = 8, 1, 2048, 4
    for D, N, kind in QUICK_WIDE_SHAPES if args.quick else WIDE_SHAPES:
        q, k, v, kq, vq = inputs(Hq, Hkv, D, L, N, bits)
        pos = mx.arange(L)[:, None] + (N - L)
        keys = mx.arange(N)[None]
        mask = (keys <= pos) & (keys > pos - 512) if kind == "window" else "causal"
        visible = (mx.sum(keys <= pos) if kind == "causal" else mx.sum(mask)).item()
        scale = D**-0.5
        f_mlxq = lambda: mlxq.sdpa(q, kq, vq, scale=scale, mask=mask)  # noqa: E731
        f_fast = lambda: mx.fast.scaled_dot_product_attention(  # noqa: E731
            q, k, v, scale=scale, mask=mask
        )
        routing.take_route_counts()
        r = dict(D=D, N=N, L=L, mask=kind, Hq=Hq, Hkv=Hkv)
        r["mlxq_ms"] = common.time_fn(f_mlxq, warmup=2, repeats=5)["median_ms"]
        r["route"] = ",".join(sorted(routing.take_route_counts())) or "mlxq"
        r["kernel"] = mlxq._ext._take_last_sdpa_kernel() or "-"
        r["fast_ms"] = common.time_fn(f_fast, warmup=2, repeats=5)["median_ms"]
        r["x_fast"] = r["fast_ms"] / r["mlxq_ms"]
        # Both products over the visible (query, key) pairs of every head.
        r["mlxq_tflops"] = 4 * Hq * visible * D / (r["mlxq_ms"] * 1e-3) / 1e12
        table.row(r)
        rows.append(r)
        del q, k, v, kq, vq
    return rows


def cache_writes(args):
    """One decode step's cache write, pipelined as generate_step runs it (step
    t+1 async_eval'ed before step t is waited on, the step reading the cache):
    mlxq's QuantizedKVCache (4-bit, one QuantizedKVUpdate) against mlx-lm's
    bf16 KVCache (two slice assignments), us per token, and the peak memory
    the steps add. Flat in N means no step copies the buffer."""
    import time

    try:
        from mlx_lm.models.cache import KVCache as LmKVCache
    except Exception:
        LmKVCache = None
    cols = [
        ("N", "N", "{}"),
        ("mlxq kv4 us", "mlxq_us", "{:.1f}"),
        ("mlxq peak MiB", "mlxq_peak_mib", "{:.1f}"),
        ("mlx-lm bf16 us", "lm_us", "{:.1f}"),
        ("mlx-lm peak MiB", "lm_peak_mib", "{:.1f}"),
    ]
    table, rows = common.Table(cols), []
    table.header()
    H, D, steps = 8, 128, 64

    def pipelined(cache, N):
        x = mx.random.normal((1, H, N - 2 * steps, D)).astype(mx.bfloat16)
        mx.eval(cache.update_and_fetch(x, x))
        del x
        q = mx.random.normal((1, 32, 1, D)).astype(mx.bfloat16)

        def step(h):
            k = mx.broadcast_to(h[:, :H], (1, H, 1, D)).astype(mx.bfloat16)
            keys, values = cache.update_and_fetch(k, k)
            return mlxq.sdpa(q + 1e-3 * h, keys, values, scale=D**-0.5)

        h = step(q)
        mx.eval(h)
        mx.synchronize()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        t0 = time.perf_counter()
        for _ in range(steps - 1):
            nxt = step(h)
            mx.async_eval(nxt)
            mx.eval(h)
            h = nxt
        mx.eval(h)
        dt = (time.perf_counter() - t0) / (steps - 1) * 1e6
        return dt, (mx.get_peak_memory() - base) / 2**20

    for N in (4096, 16384) if args.quick else (4096, 32768, 131072):
        r = dict(N=N)
        r["mlxq_us"], r["mlxq_peak_mib"] = pipelined(mlxq.QuantizedKVCache(64, 4), N)
        if LmKVCache is not None:
            r["lm_us"], r["lm_peak_mib"] = pipelined(LmKVCache(), N)
        table.row(r)
        rows.append(r)
        mx.clear_cache()
    return rows


def ring(args):
    cols = [
        ("N", "N", "{}"),
        ("ring us", "ring_us", "{:.1f}"),
        ("qring us", "qring_us", "{:.1f}"),
        ("slice_update us", "slice_update_us", "{:.1f}"),
        ("static slice us", "static_us", "{:.1f}"),
    ]
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
        r["ring_us"] = per_token(
            lambda s, i: mlxq.ring_update(s, row, mx.array(i, dtype=mx.int32)), buf
        )
        del buf
        qbuf = mx.quantize(mx.zeros((B, H, N, D), dtype=mx.bfloat16), group_size=GROUP, bits=4)
        r["qring_us"] = per_token(
            lambda s, i: mlxq.quantized_ring_update(
                s, row, mx.array(i, dtype=mx.int32), group_size=GROUP, bits=4
            ),
            qbuf,
        )
        del qbuf
        buf = mx.zeros((B, H, N, D), dtype=mx.bfloat16)
        r["slice_update_us"] = per_token(
            lambda s, i: mx.slice_update(s, row, mx.array([i]), axes=(2,)), buf
        )
        del buf
        buf = mx.zeros((B, H, N, D), dtype=mx.bfloat16)

        def static(s, i):
            s[..., i : i + 1, :] = row
            return s

        r["static_us"] = per_token(static, buf)
        del buf
        table.row(r)
        rows.append(r)
    return rows


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, default=50)
    common.add_output_args(p)
    p.add_argument(
        "--only",
        choices=["decode", "pairs", "prefill", "wide", "ring", "cache"],
        action="append",
        help="run only these parts (repeatable)",
    )
    args = p.parse_args()
    if not mx.is_available(mx.gpu):
        sys.exit("bench/kernels/gpu.py needs an MLX GPU backend (CUDA or Metal).")
    mx.set_default_device(mx.gpu)
    mx.random.seed(0)
    info = common.machine_info()
    info["gpu"] = gpu_name()
    common.print_machine(info)
    print(f"gpu     : {info['gpu']}")
    comp_name, comp = composition()
    print(f"comp    : {comp_name}\n")
    results = {"machine": info, "composition": comp_name}
    parts = args.only or ["decode", "prefill", "wide", "ring", "cache"]
    if "decode" in parts:
        print("decode (B=1, L=1, bf16 q, group 64)")
        results["decode"] = decode(args, comp)
    if "pairs" in parts:
        print("\ndecode in graph per K/V quantization pair (B=1, L=1, bf16 q)")
        results["pairs"] = pairs(args)
    if "prefill" in parts:
        print("\nprefill (causal, L = N, 32/8/128, 4-bit)")
        results["prefill"] = prefill(args, comp)
    if "wide" in parts:
        print("\nGemma 4 prefill (8/1 heads, L = 2048, 4-bit; x fast > 1: mlxq faster)")
        results["wide"] = wide(args)
    if "ring" in parts:
        print("\nring updates (per token, [1, 8, N, 128] bf16; quantized: 4-bit)")
        results["ring"] = ring(args)
    if "cache" in parts:
        print("\ncache write + attention per decode step, pipelined (8 KV heads, D=128)")
        results["cache"] = cache_writes(args)
    slug = "".join(c if c.isalnum() else "_" for c in info["gpu"].lower()).strip("_")
    out = common.output_path(args, f"gpu_{slug}", args.quick)
    common.save_json(out, results)


if __name__ == "__main__":
    main()
