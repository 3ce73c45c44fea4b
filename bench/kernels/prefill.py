"""Prefill-attention benchmark: mlxq against stock MLX, in one process.

Prefill (B=1, L=N queries over N keys, causal) with a 4-bit quantized KV cache,
Hq=32, Hkv=8, D=128, group size 64, q/K/V in bf16, on the CPU. For each L:

  mlxq   mlxq.sdpa(q, k_triple, v_triple, mask="causal")   the fused kernel
  f32    the same with MLXQ_CPU_INT=0: the kernel's f32 products instead of
         its integer ones (csrc/cpu/int_dot.h)
  fast   mx.fast.scaled_dot_product_attention on bf16 K/V  (the same cache, unquantized)
  comp   mlx-lm's quantized_scaled_dot_product_attention  (two quantized_matmuls with
         the [B, Hq, L, N] scores in between; mlxq.reference.quantized_sdpa when
         mlx-lm is not installed)

time and peak memory: ``mx.reset_peak_memory()`` before a call, then
``mx.get_peak_memory()`` minus the active memory before it, i.e. everything the
call allocates through MLX, its output included (the inputs are not counted).

The baselines materialise the score matrix and take ~L^2 time (on this 2-core
CPU, mx.fast ~16 s and the composition ~150 s at L=2048), so each runs only
where an estimate stays within budget: time from its last measured size scaled
by (L*N)/(L_prev*N_prev) within --max-seconds, and memory from its last measured
peak bytes per score element (4 before any measurement) within --mem-fraction of
physical memory. A baseline with nothing measured yet is first calibrated at
L=N=512. Skipped cells say why and give the estimate; no number is invented.

    python bench/kernels/prefill.py            # L in {2048, 8192, 16384}  (~15-20 min here)
    python bench/kernels/prefill.py --quick    # L in {512, 1024}
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common  # noqa: E402
import mlx.core as mx  # noqa: E402

import mlxq  # noqa: E402

HQ, HKV, D = 32, 8, 128
BITS, GROUP_SIZE = 4, 64
SIZES = [2048, 8192, 16384]
QUICK_SIZES = [512, 1024]
CALIBRATION_L = 512
MiB, GiB = 1 << 20, 1 << 30


def composition():
    """mlx-lm's composition if mlx-lm imports, else mlxq's copy of it."""
    try:
        import mlx_lm
        from mlx_lm.models.base import quantized_scaled_dot_product_attention as f

        def comp(q, k, v, scale):
            # mlx-lm scales its queries in place (`queries *= scale`), which
            # would overwrite the caller's array: hand it a fresh one every call.
            return f(
                mx.array(q), k, v, scale=scale, mask="causal", group_size=GROUP_SIZE, bits=BITS
            )

        return comp, (
            "mlx_lm.models.base.quantized_scaled_dot_product_attention "
            f"(mlx-lm {getattr(mlx_lm, '__version__', '?')})"
        )
    except Exception:  # not installed, or broken (missing deps)

        def comp(q, k, v, scale):
            return mlxq.reference.quantized_sdpa(
                q, k, v, scale=scale, mask="causal", group_size=GROUP_SIZE, bits=BITS
            )

        return comp, "mlxq.reference.quantized_sdpa"


def physical_memory():
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def make_inputs(L, N):
    q = mx.random.normal((1, HQ, L, D)).astype(mx.bfloat16)
    k = mx.random.normal((1, HKV, N, D)).astype(mx.bfloat16)
    v = mx.random.normal((1, HKV, N, D)).astype(mx.bfloat16)
    kq = tuple(mx.quantize(k, group_size=GROUP_SIZE, bits=BITS))
    vq = tuple(mx.quantize(v, group_size=GROUP_SIZE, bits=BITS))
    mx.eval(q, k, v, kq, vq)
    return q, k, v, kq, vq


def one_call(fn):
    """Runs fn() once; returns (seconds, peak bytes allocated during it, output)."""
    mx.synchronize()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    t0 = time.perf_counter()
    out = fn()
    mx.eval(out)
    dt = time.perf_counter() - t0
    return dt, mx.get_peak_memory() - before, out


def measure(fn, *, warmup, repeats_fast, repeats_slow, slow_s):
    """``warmup`` untimed calls, then ``repeats_fast`` timed ones, or
    ``repeats_slow`` when the warm-up took longer than ``slow_s`` seconds.
    Peak memory is the largest over the timed calls. Returns (result, output)."""
    warm = 0.0
    for _ in range(warmup):
        t0 = time.perf_counter()
        mx.eval(fn())
        warm = time.perf_counter() - t0
    repeats = repeats_slow if warm > slow_s else repeats_fast
    times, peak, out = [], 0, None
    for _ in range(repeats):
        out = None  # release the previous output before the next call
        dt, pk, out = one_call(fn)
        times.append(dt * 1e3)
        peak = max(peak, pk)
    times_sorted = sorted(times)
    return {
        "status": "measured",
        "median_ms": times_sorted[len(times) // 2]
        if len(times) % 2
        else 0.5 * (times_sorted[len(times) // 2 - 1] + times_sorted[len(times) // 2]),
        "min_ms": times_sorted[0],
        "times_ms": times,
        "n_runs": repeats,
        "warmup": warmup,
        "peak_bytes": peak,
    }, out


def rel_diff(a, b):
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.linalg.norm(a - b) / mx.linalg.norm(b)).item()


def sample_error(q, kq, vq, out, scale, rows=64):
    """||out - ref|| / ||ref|| on the first and last ``rows`` queries, ref = f32
    attention over the dequantized K/V (cheap at any L: [rows, N] scores only)."""
    L, N = q.shape[2], kq[0].shape[2]
    assert N == L

    def dequantize_f32(t):  # f32 scales and biases: no rounding to bf16
        w, s, b = t
        return mx.dequantize(
            w, s.astype(mx.float32), b.astype(mx.float32), group_size=GROUP_SIZE, bits=BITS
        )

    kd, vd = dequantize_f32(kq), dequantize_f32(vq)
    qf = q.astype(mx.float32)
    r = min(rows, L)
    # First r queries see keys [0, r) (L = N); the last r see everything.
    head = mx.fast.scaled_dot_product_attention(
        qf[:, :, :r], kd[:, :, :r], vd[:, :, :r], scale=scale, mask="causal"
    )
    tail = mx.fast.scaled_dot_product_attention(
        qf[:, :, L - r :], kd, vd, scale=scale, mask="causal"
    )
    ref = mx.concatenate([head, tail], axis=2)
    got = mx.concatenate([out[:, :, :r], out[:, :, L - r :]], axis=2)
    return rel_diff(got, ref)


class Budget:
    """Decides whether a slow baseline may run at a size, from its last measurement."""

    def __init__(self, max_seconds, mem_limit):
        self.max_seconds = max_seconds
        self.mem_limit = mem_limit
        self.last = {}  # method -> (score elements, seconds, peak bytes)

    def record(self, method, elems, seconds, peak):
        self.last[method] = (elems, seconds, peak)

    def known(self, method):
        return method in self.last

    def estimate(self, method, elems):
        """(seconds or None, bytes) estimated for a call with ``elems`` score elements."""
        if method not in self.last:
            return None, 4 * elems
        e0, t0, p0 = self.last[method]
        return t0 * elems / e0, max(p0 / e0, 1.0) * elems

    def verdict(self, method, elems):
        est_s, est_b = self.estimate(method, elems)
        reasons = []
        if est_s is not None and est_s > self.max_seconds:
            reasons.append(f"estimated {est_s:.0f} s")
        if self.mem_limit is not None and est_b > self.mem_limit:
            reasons.append(f"needs {est_b / GiB:.1f} GiB")
        return reasons, est_s, est_b


def run_baseline(name, fn, elems, budget, args, calibrate):
    """Measures baseline ``name`` or returns why it was skipped."""
    if not budget.known(name) and calibrate is not None:
        calibrate()
    reasons, est_s, est_b = budget.verdict(name, elems)
    if reasons:
        return {
            "status": "skipped",
            "reason": "skipped (" + "; ".join(reasons) + ")",
            "estimated_s": est_s,
            "estimated_peak_bytes": est_b,
        }, None
    res, out = measure(
        fn,
        warmup=args.baseline_warmup,
        repeats_fast=3,
        repeats_slow=args.baseline_repeats,
        slow_s=2.0,
    )
    res["estimated_s_before_run"] = est_s
    budget.record(name, elems, res["median_ms"] / 1e3, res["peak_bytes"])
    return res, out


def calibration(name, make_fn, budget, args, log):
    """Measures baseline ``name`` once at L=N=CALIBRATION_L to seed its estimates."""

    def run():
        L = CALIBRATION_L
        q, k, v, kq, vq = make_inputs(L, L)
        fn = make_fn(q, k, v, kq, vq)
        res, _ = measure(fn, warmup=1, repeats_fast=1, repeats_slow=1, slow_s=0)
        budget.record(name, HQ * L * L, res["median_ms"] / 1e3, res["peak_bytes"])
        res["L"] = res["N"] = L
        log[name] = res
        print(
            f"  calibration {name} at L=N={L}: {res['median_ms'] / 1e3:.2f} s, "
            f"peak {res['peak_bytes'] / MiB:.0f} MiB",
            flush=True,
        )

    return run


def fmt_ms(r):
    if r["status"] != "measured":
        return r["reason"]
    ms = r["median_ms"]
    return f"{ms / 1e3:.2f} s" if ms >= 1e4 else f"{ms:.1f} ms"


def fmt_peak(r):
    if r["status"] != "measured":
        return "-"
    return f"{r['peak_bytes'] / MiB:.1f} MiB"


def fmt_ratio(x):
    return "-" if x is None else f"{x:.1f}x"


def print_table(rows):
    cols = [
        ("L=N", lambda r: str(r["L"])),
        ("in+out MiB", lambda r: f"{(r['input_bytes'] + r['output_bytes']) / MiB:.0f}"),
        ("mlxq", lambda r: fmt_ms(r["mlxq"])),
        ("mlxq peak", lambda r: fmt_peak(r["mlxq"])),
        ("f32 products", lambda r: fmt_ms(r["f32_products"]) if r.get("f32_products") else "-"),
        ("fast bf16", lambda r: fmt_ms(r["fast"])),
        ("fast peak", lambda r: fmt_peak(r["fast"])),
        ("comp", lambda r: fmt_ms(r["comp"])),
        ("comp peak", lambda r: fmt_peak(r["comp"])),
        ("t fast/mlxq", lambda r: fmt_ratio(r["speedup_vs_fast"])),
        ("t comp/mlxq", lambda r: fmt_ratio(r["speedup_vs_comp"])),
        ("mem fast/mlxq", lambda r: fmt_ratio(r["mem_ratio_fast"])),
        ("mem comp/mlxq", lambda r: fmt_ratio(r["mem_ratio_comp"])),
        ("err mlxq", lambda r: f"{r['mlxq_sample_err_vs_f32']:.1e}"),
        (
            "mlxq vs comp",
            lambda r: (
                "-" if r["mlxq_rel_diff_vs_comp"] is None else f"{r['mlxq_rel_diff_vs_comp']:.1e}"
            ),
        ),
    ]
    cells = [[h for h, _ in cols]] + [[f(r) for _, f in cols] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    for n, line in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(line, widths)))
        if n == 0:
            print("-" * (sum(widths) + 2 * (len(widths) - 1)))


def bench_size(L, comp, budget, args, calibrations):
    N = L
    scale = D**-0.5
    elems = HQ * L * N
    q, k, v, kq, vq = make_inputs(L, N)
    row = {
        "L": L,
        "N": N,
        "B": 1,
        "Hq": HQ,
        "Hkv": HKV,
        "D": D,
        "bits": BITS,
        "group_size": GROUP_SIZE,
        "mask": "causal",
        "q_bytes": q.nbytes,
        "kv_quantized_bytes": sum(a.nbytes for a in kq + vq),
        "kv_bf16_bytes": k.nbytes + v.nbytes,
        "output_bytes": HQ * L * D * 2,
        "score_matrix_f32_bytes": elems * 4,
    }
    row["input_bytes"] = row["q_bytes"] + row["kv_quantized_bytes"]

    res, out = measure(
        lambda: mlxq.sdpa(q, kq, vq, scale=scale, mask="causal"),
        warmup=1,
        repeats_fast=5,
        repeats_slow=3,
        slow_s=1.0,
    )
    row["mlxq"] = res
    row["mlxq_sample_err_vs_f32"] = sample_error(q, kq, vq, out, scale)
    print(f"L=N={L}: mlxq {fmt_ms(res)}, peak {fmt_peak(res)}", flush=True)
    row["f32_products"] = None
    if mx.default_device() == mx.cpu:
        # The same kernel with its f32 products instead of the integer ones.
        row["f32_products"], _ = measure(
            lambda: common.cpu_int_path(
                "0", lambda: mlxq.sdpa(q, kq, vq, scale=scale, mask="causal")
            ),
            warmup=1,
            repeats_fast=5,
            repeats_slow=3,
            slow_s=1.0,
        )
        print(f"L=N={L}: mlxq f32 products {fmt_ms(row['f32_products'])}", flush=True)

    def fast_fn(q, k, v, kq, vq):
        return lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")

    def comp_fn(q, k, v, kq, vq):
        return lambda: comp(q, kq, vq, scale)

    for name, make_fn in (("fast", fast_fn), ("comp", comp_fn)):
        cal = (
            calibration(name, make_fn, budget, args, calibrations)
            if L > 2 * CALIBRATION_L
            else None
        )
        res_b, out_b = run_baseline(name, make_fn(q, k, v, kq, vq), elems, budget, args, cal)
        row[name] = res_b
        if name == "comp":
            row["mlxq_rel_diff_vs_comp"] = None if out_b is None else rel_diff(out, out_b)
        del out_b
        print(f"L=N={L}: {name} {fmt_ms(res_b)}, peak {fmt_peak(res_b)}", flush=True)
        mx.clear_cache()

    t = row["mlxq"]["median_ms"]
    p = row["mlxq"]["peak_bytes"]
    for name in ("fast", "comp"):
        r = row[name]
        ok = r["status"] == "measured"
        row[f"speedup_vs_{name}"] = r["median_ms"] / t if ok else None
        row[f"mem_ratio_{name}"] = r["peak_bytes"] / p if ok and p > 0 else None
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"L in {QUICK_SIZES}")
    p.add_argument("--L", type=int, nargs="+", help=f"sizes, L = N (default {SIZES})")
    p.add_argument(
        "--max-seconds",
        type=float,
        default=300.0,
        help="skip a baseline whose estimated time per call exceeds this (default 300)",
    )
    p.add_argument(
        "--mem-fraction",
        type=float,
        default=0.7,
        help="skip a baseline whose estimated peak exceeds this fraction of "
        "physical memory (default 0.7)",
    )
    p.add_argument(
        "--baseline-warmup", type=int, default=1, help="untimed baseline calls first (default 1)"
    )
    p.add_argument(
        "--baseline-repeats",
        type=int,
        default=1,
        help="timed calls of a baseline slower than 2 s (default 1; 3 when faster)",
    )
    p.add_argument("--seed", type=int, default=0)
    common.add_output_args(p)
    args = p.parse_args()

    args.out = common.output_path(args, "prefill_cpu", args.quick)
    sizes = args.L or (QUICK_SIZES if args.quick else SIZES)
    mx.random.seed(args.seed)
    mx.set_default_device(mx.cpu)

    phys = physical_memory()
    mem_limit = None if phys is None else args.mem_fraction * phys
    budget = Budget(args.max_seconds, mem_limit)
    comp, comp_name = composition()
    info = common.machine_info()
    common.print_machine(info)
    print(
        f"prefill : B=1, L=N, Hq={HQ} Hkv={HKV} D={D}, {BITS}-bit group {GROUP_SIZE}, "
        "q/K/V bf16, causal"
    )
    print(f"comp    : {comp_name}")
    print(
        "peak    : mx.get_peak_memory() - active memory before the call (its output "
        "included, inputs not)"
    )
    print(
        f"budget  : baselines run when estimated <= {args.max_seconds:.0f} s per call and "
        f"<= {args.mem_fraction:.0%} of {'?' if phys is None else f'{phys / GiB:.1f} GiB'}"
    )
    print("err     : mlxq vs f32 attention over the dequantized K/V, first and last 64 queries")
    print(flush=True)

    rows, calibrations = [], {}
    for L in sizes:
        rows.append(bench_size(L, comp, budget, args, calibrations))
        mx.clear_cache()

    print()
    print_table(rows)
    print()
    for r in rows:
        print(
            f"L=N={r['L']}: inputs q {r['q_bytes'] / MiB:.0f} MiB + 4-bit K/V "
            f"{r['kv_quantized_bytes'] / MiB:.1f} MiB (bf16 K/V {r['kv_bf16_bytes'] / MiB:.0f}"
            f" MiB), output {r['output_bytes'] / MiB:.0f} MiB; f32 score matrix "
            f"Hq*L*N*4 = {r['score_matrix_f32_bytes'] / GiB:.2f} GiB"
        )

    common.save_json(
        args.out,
        {
            "benchmark": "prefill",
            "machine": info,
            "mlx_version": info["mlx_version"],
            "date": info["date"],
            "composition": comp_name,
            "settings": {
                "B": 1,
                "Hq": HQ,
                "Hkv": HKV,
                "D": D,
                "bits": BITS,
                "group_size": GROUP_SIZE,
                "dtype": "bfloat16",
                "mask": "causal",
                "L": sizes,
                "quick": args.quick,
                "max_seconds": args.max_seconds,
                "mem_fraction": args.mem_fraction,
                "physical_memory_bytes": phys,
                "baseline_warmup": args.baseline_warmup,
                "baseline_repeats_when_slow": args.baseline_repeats,
                "seed": args.seed,
                "peak": "mx.get_peak_memory() after mx.reset_peak_memory(), minus "
                "mx.get_active_memory() before the call; max over the timed calls",
                "note": "mlxq's per-thread scratch (one row tile and one 32-key chunk, "
                "under 100 KiB per thread) is malloc'd outside MLX and not in its peak",
            },
            "calibrations": calibrations,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
