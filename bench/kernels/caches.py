"""Decode-step cost of each cache: mlxq's caches next to mlx-lm's, in one process.

For each cache filled to N tokens (B=1, H=8, D=128, bf16 keys/values), one
decode step is ``update_and_fetch`` of a single token, evaluated. It is timed
(median per token) and its peak-memory delta measured: in-place writes cost
about one row whatever N is, while a step that copied the buffer would cost
time and memory in proportion to N.

  kv       mlxq.KVCache                  vs mlx_lm KVCache
  quant    mlxq.QuantizedKVCache         vs mlx_lm QuantizedKVCache   (group 64, 4 bits)
  rot      mlxq.RotatingKVCache(N)       vs mlx_lm RotatingKVCache(N) (full ring: wrapped writes)
  rotq     mlxq.RotatingQuantizedKVCache vs -  (mlx-lm has none: its
                                              RotatingKVCache.to_quantized raises)
  recent   mlxq.QuantizedKVCache(recent=128) vs -  (the exact window's ring)

Steps are timed two ways. Evaluated (the columns without "lazy"): each step
is evaluated before the next, as mlx-lm's generate_step runs them; writes go
in place. Lazy (``--lazy K``): K steps are built and then evaluated together,
so each write meets a buffer the previous step's unevaluated fetch still
reads, and the donation rule copies it first; the "lazy" columns are the
time per token of such a chain, and their gap to the evaluated ones is the
price of that copy.

    python bench/kernels/caches.py            # N = 1k, 16k, 128k
    python bench/kernels/caches.py --quick    # N = 1k, 4k, few steps
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common  # noqa: E402
import mlx.core as mx  # noqa: E402
from mlx_lm.models import cache as lm  # noqa: E402

import mlxq  # noqa: E402
from mlxq.guard import parts  # noqa: E402

B, H, D = 1, 8, 128
DTYPE = mx.bfloat16
GROUP_SIZE, BITS = 64, 4
NS = [1024, 16384, 131072]
HEADROOM = 256  # free rows left in growing caches, so timed steps never grow them

CACHES = {
    "kv": (lambda n: mlxq.KVCache(), lambda n: lm.KVCache()),
    "quant": (
        lambda n: mlxq.QuantizedKVCache(GROUP_SIZE, BITS),
        lambda n: lm.QuantizedKVCache(GROUP_SIZE, BITS),
    ),
    "rot": (lambda n: mlxq.RotatingKVCache(n), lambda n: lm.RotatingKVCache(n)),
    "rotq": (lambda n: mlxq.RotatingQuantizedKVCache(n, 0, GROUP_SIZE, BITS), None),
    "recent": (lambda n: mlxq.QuantizedKVCache(GROUP_SIZE, BITS, recent=RECENT), None),
}
RECENT = 128
LAZY_ROUNDS = 6  # one warm-up chain and five timed ones

COLUMNS = [
    ("cache", "cache", "{}"),
    ("N", "N", "{}"),
    ("mlxq us/tok", "mlxq_us", "{:.1f}"),
    ("mlx-lm us/tok", "mlx_lm_us", "{:.1f}"),
    ("mlxq min", "mlxq_min_us", "{:.1f}"),
    ("mlx-lm min", "mlx_lm_min_us", "{:.1f}"),
    ("mlxq lazy", "mlxq_lazy_us", "{:.1f}"),
    ("mlx-lm lazy", "mlx_lm_lazy_us", "{:.1f}"),
    ("mlxq peak KiB", "mlxq_peak_kib", "{:.1f}"),
    ("mlx-lm peak KiB", "mlx_lm_peak_kib", "{:.1f}"),
    ("row KiB", "row_kib", "{:.1f}"),
    ("cache MiB", "cache_mib", "{:.1f}"),
]


def rows(n):
    k = mx.random.normal((B, H, n, D), dtype=DTYPE)
    v = mx.random.normal((B, H, n, D), dtype=DTYPE)
    mx.eval(k, v)
    return k, v


def arrays(fetched):
    """The arrays of a fetch (mlxq's own formats read through mlxq.guard.parts)."""
    if isinstance(fetched, mx.array):
        return [fetched]
    if isinstance(fetched, (tuple, list)):
        return [a for part in parts(fetched) for a in arrays(part)]
    return []


def filled(cache, n, rotating):
    """``cache`` holding ``n`` tokens (a full ring for rotating caches)."""
    fill = n if rotating else n - HEADROOM
    chunk = 8192
    for start in range(0, fill, chunk):
        fetched = cache.update_and_fetch(*rows(min(chunk, fill - start)))
        mx.eval(arrays(fetched))
        del fetched
    return cache


def step_fn(cache):
    k1, v1 = rows(1)

    def step():
        return arrays(cache.update_and_fetch(k1, v1))  # dropped after eval, as a model drops it

    return step


def lazy_us(step, k):
    """Median microseconds per token of ``k`` steps built, then evaluated together."""
    times = []
    for i in range(LAZY_ROUNDS):
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval([step() for _ in range(k)])
        if i:
            times.append((time.perf_counter() - t0) / k * 1e6)
    return statistics.median(times)


def peak_of_one_step(step):
    mx.synchronize()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    mx.eval(step())
    return max(mx.get_peak_memory(), before) - before


def bench_row(name, n, args):
    """Both caches filled to ``n``, then timed in alternating rounds (the machine's
    drift hits both alike)."""
    rotating = name.startswith("rot")
    row = {"cache": name, "N": n, "row_kib": 2 * B * H * D * DTYPE.size / 1024}
    caches = {
        who: filled(make(n), n, rotating)
        for who, make in zip(("mlxq", "mlx_lm"), CACHES[name])
        if make is not None
    }
    steps = {who: step_fn(cache) for who, cache in caches.items()}
    times = {who: [] for who in caches}
    for _ in range(args.rounds):
        for who, step in steps.items():
            times[who] += common.time_fn(step, warmup=args.warmup, repeats=args.repeats)["times_ms"]
    for who, cache in caches.items():
        row[f"{who}_us"] = statistics.median(times[who]) * 1e3
        row[f"{who}_min_us"] = min(times[who]) * 1e3
        row[f"{who}_times_ms"] = times[who]
        row[f"{who}_peak_kib"] = peak_of_one_step(steps[who]) / 1024
        if args.lazy:
            row[f"{who}_lazy_us"] = lazy_us(steps[who], args.lazy)
        row["cache_mib"] = cache.nbytes / 2**20
    del caches, steps
    mx.clear_cache()
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="N in {1024, 4096}, few steps")
    p.add_argument("--n", type=int, nargs="+", help=f"cache lengths (default {NS})")
    p.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="alternating rounds of mlxq then mlx-lm steps (default 5)",
    )
    p.add_argument("--repeats", type=int, default=20, help="timed steps a round (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps a round (default 3)")
    p.add_argument(
        "--lazy", type=int, default=4, help="steps per lazily evaluated chain (0: none; default 4)"
    )
    p.add_argument("--seed", type=int, default=0)
    common.add_output_args(p)
    args = p.parse_args()

    if args.quick:
        args.rounds, args.repeats = min(args.rounds, 2), min(args.repeats, 10)
    if args.rounds * (args.warmup + args.repeats) + 1 + LAZY_ROUNDS * args.lazy > HEADROOM:
        p.error(
            f"rounds * (warmup + repeats) + {LAZY_ROUNDS} * lazy must stay below {HEADROOM} "
            "(the free rows of the growing caches)"
        )
    ns = args.n or ([1024, 4096] if args.quick else NS)
    args.out = common.output_path(args, "caches_cpu", args.quick)
    mx.random.seed(args.seed)

    info = common.machine_info()
    common.print_machine(info)
    print(
        f"step    : update_and_fetch of 1 token, B={B} H={H} D={D} bfloat16, evaluated; "
        f"median (and min) of {args.rounds} rounds x {args.repeats} steps, mlxq and "
        f"mlx-lm alternating, {args.warmup} warm-up steps a round"
    )
    print(
        f"quant   : group size {GROUP_SIZE}, {BITS} bits; rotating caches are full rings "
        "(max_size = N), growing ones have free rows"
    )
    print("peak    : peak-memory delta of one step (a copy of the buffer would be ~cache MiB)")
    if args.lazy:
        print(
            f"lazy    : per token over chains of {args.lazy} steps evaluated together "
            "(each write meets a buffer an unevaluated step still reads)"
        )
    print()

    table = common.Table(COLUMNS)
    table.header()
    out_rows = []
    for name in CACHES:
        for n in ns:
            row = bench_row(name, n, args)
            out_rows.append(row)
            table.row(row)

    common.save_json(
        args.out,
        {
            "benchmark": "caches",
            "machine": info,
            "mlx_version": info["mlx_version"],
            "date": info["date"],
            "settings": {
                "B": B,
                "H": H,
                "D": D,
                "dtype": "bfloat16",
                "group_size": GROUP_SIZE,
                "bits": BITS,
                "N": ns,
                "rounds": args.rounds,
                "repeats": args.repeats,
                "warmup": args.warmup,
                "seed": args.seed,
                "lazy": args.lazy,
                "recent": RECENT,
                "quick": args.quick,
            },
            "rows": out_rows,
        },
    )


if __name__ == "__main__":
    main()
