"""Decode attention against PyPI peers that keep the KV cache quantized, in one process.

Decode (L=1, B=1) over a 4-bit KV cache of N keys, shape 32 query heads / 8 KV
heads / head dim 128, bf16 q/K/V drawn once per N and shared by every path:

  mlxq    mlxq.sdpa(q, k_triple, v_triple), triples from mx.quantize(group 64, 4 bits)
  fast    mx.fast.scaled_dot_product_attention on the bf16 K/V (the baseline)

and one row per peer that is installed, each through its own public decode
attention over its own cache, built by its own quantizer from the same K/V:

  mlx-optiq            optiq.runtime.fused_quant_sdpa.fused_quantized_scaled_dot_product_attention
                       (FlashAttention-2 over 512-key tiles of mx.quantized_matmul) on the
                       cache optiq.runtime.kv.rotating.quantize_cache_layer makes of an
                       mlx-lm KVCache (mx.quantize, group 64, 4 bits)
  mlx-turboquant       mlx_turboquant.kv_cache.TurboQuantKVCache(group_size=64, bits=4):
                       keys rotated (randomized Hadamard) then mx.quantize'd, values
                       mx.quantize'd; attention through mlx-lm's scaled_dot_product_attention
                       as mlx_turboquant.attention.patch_attention wraps it (rotates q, then
                       mlx-lm's quantized SDPA). The optional QJL residual (qjl=True) is a
                       Metal kernel and is not used.
  veloxquant-mlx       VeloxQuant's turboquant_rvq cache (KVCacheFactory, bit_width_inlier=2:
                       two 2-bit residual-VQ stages = 4 bits a key coordinate, plus a bf16
                       norm a key). Values are NOT quantized (kept as given, bf16). Its
                       update_and_fetch dequantizes every key, then mx.fast SDPA (what
                       mlx-lm's attention seam calls for a cache without ``bits``).
  turboquant-mlx-full  turboquant_mlx.layers.polar_kv_cache.TurboQuantKVCache(tq_bits=4,
                       group_size=64): Hadamard rotation + 4-bit Lloyd-Max codebook with an
                       fp16 RMS scale per 64, K and V. update_and_fetch dequantizes K and V to
                       fp16, then mx.fast SDPA. Its fused decode kernel is Metal-only (and
                       opt-in); this script times the default path.

Timed call, per peer: mlx-optiq and mlx-turboquant fetch nothing (their caches
hold the quantized triples), so only the attention call is timed. VeloxQuant and
turboquant-mlx-full dequantize inside ``update_and_fetch``, so their decode step
is ``update_and_fetch`` of the step's own token (the N-th key; the cache holds
the other N-1) and the attention, followed by an untimed ``trim(1)``: appending
one row is a small part of dequantizing N.

Each path is timed with common.time_interleaved, call by call against mx.fast:
mlxq and fast together (--repeats calls), each peer together with fast, with
its repeats cut so that its timing takes about --peer-budget seconds (at least
3). "x mx.fast bf16" is the mx.fast median of the same interleaved run / the
path's median.

"err" is the max abs difference of the output from a float64 attention over
the K/V the path itself attends to: mlxq / optiq, the triples dequantized in
float32; mlx-turboquant, the same with q rotated like its keys (values are not
rotated); VeloxQuant / turboquant-mlx-full, the K/V update_and_fetch returned. It shows each path computes attention over its own cache. "err bf16"
is against float64 attention over the original bf16 K/V (quantization included).

Peers, installed without their (large) dependency lists:

    pip install --no-deps mlx-optiq==0.7.7
    pip install --no-deps mlx-turboquant==0.0.2
    pip install --no-deps veloxquant-mlx==0.94.15
    pip install --no-deps turboquant-mlx-full==0.30.0

mlx-optiq, mlx-turboquant and veloxquant-mlx also need mlx-lm (this project's
``bench``/``test`` extras), and veloxquant-mlx scipy. A peer that is not
installed, or that fails to import or to run, is skipped with the reason.

    python bench/kernels/peers.py                 # N = 32768
    python bench/kernels/peers.py --keys 4096 32768
    python bench/kernels/peers.py --quick         # N = 4096, few repeats
"""

import argparse
import importlib.metadata
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common  # noqa: E402
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

import mlxq  # noqa: E402

HQ, HKV, D = 32, 8, 128
GROUP_SIZE, BITS = 64, 4
NS = [32768]

COLUMNS = [
    ("N", "N", "{}"),
    ("path", "path", "{}"),
    ("version", "version", "{}"),
    ("KV cache", "kv", "{}"),
    ("ms", "ms", "{:.2f}"),
    ("fast ms", "fast_ms", "{:.2f}"),
    ("x mx.fast bf16", "speedup_vs_fast", "{:.2f}"),
    ("err", "max_abs_err", "{:.1e}"),
    ("err vs", "err_ref", "{}"),
    ("err bf16", "max_abs_err_vs_bf16", "{:.1e}"),
    ("calls", "repeats", "{}"),
]


def version(dist):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def attention_f64(q, k, v, scale):
    """Float64 attention (numpy) of q (1, Hq, 1, D) over k, v (1, Hkv, N, D)."""
    q, k, v = (np.asarray(x.astype(mx.float32), dtype=np.float64) for x in (q, k, v))
    b, hq, length, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, hkv, (hq // hkv) * length, d)
    s = (qg @ k.transpose(0, 1, 3, 2)) * scale
    s -= s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return (p @ v).reshape(b, hq, length, v.shape[-1])


def max_abs_err(out, ref):
    return float(np.max(np.abs(np.asarray(out.astype(mx.float32), dtype=np.float64) - ref)))


def dequantize(triple):
    """w * scale + bias in float32 (mx.dequantize of bf16 scales would round it to bf16)."""
    w, scales, biases = triple
    return mx.dequantize(
        w, scales.astype(mx.float32), biases.astype(mx.float32), group_size=GROUP_SIZE, bits=BITS
    )


def stored_triples(cache):
    """The (keys, values) triples an mlx-lm QuantizedKVCache (or subclass) holds,
    cut to its offset: what its update_and_fetch hands to attention."""
    if hasattr(cache, "keys_and_values"):  # mlx-lm >= 0.32
        keys, values = cache.keys_and_values()
    else:
        keys, values = (tuple(a[..., : cache.offset, :] for a in t) for t in cache.state[:2])
    mx.eval(keys, values)
    return keys, values


# Each peer's setup builds its cache from the bf16 K/V and returns the timed
# call ("fn"), what the output should be compared with ("ref": q, K, V for
# attention_f64), a description of the cache ("kv") and of the call ("timed").
# An exception it raises skips the peer at that N, with the message as the reason.


def setup_optiq(q, k, v, scale):
    from mlx_lm.models.cache import KVCache
    from optiq.runtime.fused_quant_sdpa import fused_quantized_scaled_dot_product_attention
    from optiq.runtime.kv.rotating import quantize_cache_layer

    c = KVCache()
    c.update_and_fetch(k, v)
    keys, values = stored_triples(quantize_cache_layer(c, bits=BITS, group_size=GROUP_SIZE))

    def fn():
        return fused_quantized_scaled_dot_product_attention(
            q, keys, values, scale=scale, mask=None, group_size=GROUP_SIZE, bits=BITS
        )

    return {
        "fn": fn,
        "ref": (q, dequantize(keys), dequantize(values)),
        "err_ref": "own deq",
        "kv": f"K,V affine {BITS}-bit g{GROUP_SIZE}",
        "timed": "fused_quantized_scaled_dot_product_attention(q, keys, values) on the "
        "quantize_cache_layer cache's triples",
    }


def setup_mlx_turboquant(q, k, v, scale):
    import mlx_lm.models.base as base
    from mlx_turboquant.attention import patch_attention
    from mlx_turboquant.kv_cache import TurboQuantKVCache

    cache = TurboQuantKVCache(group_size=GROUP_SIZE, bits=BITS)
    cache.update_and_fetch(k, v)
    keys, values = stored_triples(cache)
    patch_attention()  # wraps mlx-lm's scaled_dot_product_attention: rotates q
    sdpa = base.scaled_dot_product_attention

    def fn():
        return sdpa(q, keys, values, cache=cache, scale=scale, mask=None)

    q_rot = cache.rotate_query(q.astype(mx.float32))
    return {
        "fn": fn,
        "ref": (q_rot, dequantize(keys), dequantize(values)),
        "err_ref": "own deq",
        "kv": f"K rotated + V, affine {BITS}-bit g{GROUP_SIZE}",
        "timed": "mlx_lm.models.base.scaled_dot_product_attention, patched by "
        "mlx_turboquant.attention.patch_attention, on the cache's triples",
    }


def fetch_step(cache, q, k_last, v_last, scale):
    """One decode step of a dequantize-on-fetch cache: append the step's token,
    fetch the dequantized K/V, attend; then drop the token again (untimed)."""

    def fn():
        keys, values = cache.update_and_fetch(k_last, v_last)
        out = mx.fast.scaled_dot_product_attention(
            q.astype(keys.dtype), keys, values.astype(keys.dtype), scale=scale
        )
        return out, keys, values

    def timed():
        out = fn()[0]
        mx.eval(out)
        cache.trim(1)
        return out

    return fn, timed


def fetching_cache_row(cache, q, k, v, scale, kv, timed):
    """The row of a peer whose cache hands out K/V only from update_and_fetch:
    filled with all but the last token, timed on a step that adds the last one
    (then trimmed back), its reference over the K/V that step fetched."""
    mx.eval(cache.update_and_fetch(k[..., :-1, :], v[..., :-1, :]))
    fn, timed_fn = fetch_step(cache, q, k[..., -1:, :], v[..., -1:, :], scale)
    _, keys, values = fn()
    mx.eval(keys, values)
    cache.trim(1)
    return {
        "fn": timed_fn,
        "ref": (q, keys, values),
        "err_ref": "own deq",
        "kv": kv,
        "timed": timed,
    }


def setup_veloxquant(q, k, v, scale):
    from veloxquant_mlx.cache.base import KVCacheConfig, KVCacheFactory

    cache = KVCacheFactory.create(
        KVCacheConfig(method="turboquant_rvq", head_dim=D, bit_width_inlier=2)
    )
    return fetching_cache_row(
        cache,
        q,
        k,
        v,
        scale,
        kv="K RVQ 2+2-bit + bf16 norm, V bf16",
        timed="cache.update_and_fetch(1 token) (dequantizes all keys) + mx.fast SDPA",
    )


def setup_turboquant_full(q, k, v, scale):
    from turboquant_mlx.layers.polar_kv_cache import TurboQuantKVCache

    cache = TurboQuantKVCache(tq_bits=BITS, group_size=GROUP_SIZE)
    return fetching_cache_row(
        cache,
        q,
        k,
        v,
        scale,
        kv=f"K,V Hadamard + {BITS}-bit Lloyd-Max, fp16 scale/{GROUP_SIZE}",
        timed="cache.update_and_fetch(1 token) (dequantizes K and V to fp16) + "
        "mx.fast SDPA (q cast to fp16)",
    )


# (name, distribution, modules that must import, setup)
PEERS = [
    (
        "mlx-optiq",
        "mlx-optiq",
        ("mlx_lm.models.cache", "optiq.runtime.fused_quant_sdpa", "optiq.runtime.kv.rotating"),
        setup_optiq,
    ),
    (
        "mlx-turboquant",
        "mlx-turboquant",
        ("mlx_turboquant.kv_cache", "mlx_turboquant.attention"),
        setup_mlx_turboquant,
    ),
    ("veloxquant-mlx", "veloxquant-mlx", ("veloxquant_mlx.cache.base",), setup_veloxquant),
    (
        "turboquant-mlx-full",
        "turboquant-mlx-full",
        ("turboquant_mlx.layers.polar_kv_cache",),
        setup_turboquant_full,
    ),
]


def available_peers(skipped):
    """(name, dist, version, setup) of each peer that imports; prints the others
    and adds them to ``skipped``."""
    found = []
    for name, dist, modules, setup in PEERS:
        ver = version(dist)
        if ver is None:
            why = f"not installed (pip install --no-deps {dist})"
        else:
            try:
                for module in modules:
                    __import__(module)
                found.append((name, dist, ver, setup))
                continue
            except Exception as e:  # a missing dependency, or broken on this platform
                why = f"import {module} failed: {type(e).__name__}: {e}"
        print(f"skip    : {name}{' ' + ver if ver else ''}: {why}")
        skipped.append({"N": None, "path": name, "version": ver, "error": why})
    return found


def row(N, path, ver, kv, t, t_fast, out, ref, ref_name, ref_bf16, timed, repeats):
    return {
        "N": N,
        "path": path,
        "version": ver,
        "kv": kv,
        "ms": t["median_ms"],
        "fast_ms": t_fast["median_ms"],
        "speedup_vs_fast": t_fast["median_ms"] / t["median_ms"],
        "max_abs_err": max_abs_err(out, ref) if ref is not None else None,
        "err_ref": ref_name,
        "max_abs_err_vs_bf16": max_abs_err(out, ref_bf16),
        "repeats": repeats,
        "timed": timed,
        "min_ms": t["min_ms"],
        "times_ms": t["times_ms"],
        "fast_times_ms": t_fast["times_ms"],
    }


def bench_n(N, peers, table, args, rows, failures):
    scale = D**-0.5
    q = mx.random.normal((1, HQ, 1, D)).astype(mx.bfloat16)
    k = mx.random.normal((1, HKV, N, D)).astype(mx.bfloat16)
    v = mx.random.normal((1, HKV, N, D)).astype(mx.bfloat16)
    kq = mx.quantize(k, group_size=GROUP_SIZE, bits=BITS)
    vq = mx.quantize(v, group_size=GROUP_SIZE, bits=BITS)
    mx.eval(q, k, v, kq, vq)
    ref_bf16 = attention_f64(q, k, v, scale)

    def fast():
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)

    def run_mlxq():
        return mlxq.sdpa(q, kq, vq, scale=scale)

    t = common.time_interleaved(
        {"mlxq": run_mlxq, "fast": fast}, warmup=args.warmup, repeats=args.repeats
    )
    kernel = None
    take = getattr(getattr(mlxq, "_ext", None), "_take_last_sdpa_kernel", None)
    if take is not None:
        take()
        mx.eval(run_mlxq())
        kernel = take() or None
    ref = attention_f64(q, dequantize(kq), dequantize(vq), scale)
    r = row(
        N,
        "mlxq",
        version("mlxq"),
        f"K,V affine {BITS}-bit g{GROUP_SIZE}",
        t["mlxq"],
        t["fast"],
        run_mlxq(),
        ref,
        "own deq",
        ref_bf16,
        "mlxq.sdpa(q, k_triple, v_triple)",
        args.repeats,
    )
    r["kernel"] = kernel
    rows.append(r)
    table.row(r)
    r = row(
        N,
        "fast",
        mx.__version__,
        "bf16",
        t["fast"],
        t["fast"],
        fast(),
        None,
        "-",
        ref_bf16,
        "mx.fast.scaled_dot_product_attention(q, k, v)",
        args.repeats,
    )
    rows.append(r)
    table.row(r)
    fast_ms = t["fast"]["median_ms"]
    del ref

    for name, dist, ver, setup in peers:
        try:
            p = setup(q, k, v, scale)
            t0 = time.perf_counter()
            out = p["fn"]()
            mx.eval(out)
            first_ms = (time.perf_counter() - t0) * 1e3
            repeats = int(args.peer_budget * 1e3 / (first_ms + fast_ms))
            repeats = max(3, min(args.repeats, repeats))
            t = common.time_interleaved({"fast": fast, name: p["fn"]}, warmup=1, repeats=repeats)
            ref = attention_f64(*p["ref"], scale)
        except Exception as e:
            failures.append(
                {"N": N, "path": name, "version": ver, "error": f"{type(e).__name__}: {e}"}
            )
            continue
        r = row(
            N,
            name,
            ver,
            p["kv"],
            t[name],
            t["fast"],
            out,
            ref,
            p["err_ref"],
            ref_bf16,
            p["timed"],
            repeats,
        )
        rows.append(r)
        table.row(r)
        del p, ref
        mx.clear_cache()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="N = 4096, 3 repeats")
    p.add_argument("--keys", type=int, nargs="+", help=f"cache lengths N (default {NS})")
    p.add_argument(
        "--repeats",
        type=int,
        help="timed calls for mlxq and mx.fast, and at most for a peer (default 20, quick 3)",
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed calls first (default 2)")
    p.add_argument(
        "--peer-budget",
        type=float,
        default=25.0,
        help="seconds a peer's interleaved timing may take; sets its repeats, at least 3 "
        "(default 25)",
    )
    p.add_argument("--seed", type=int, default=0)
    common.add_output_args(p)
    args = p.parse_args()

    ns = args.keys or ([4096] if args.quick else NS)
    if args.repeats is None:
        args.repeats = 3 if args.quick else 20
    args.repeats = max(args.repeats, 3)
    args.warmup = max(args.warmup, 1)
    mx.random.seed(args.seed)

    info = common.machine_info()
    common.print_machine(info)
    print(
        f"decode  : B=1 L=1, Hq/Hkv/D = {HQ}/{HKV}/{D}, q/K/V bf16, scale D**-0.5; "
        f"mlxq and mx.fast medians of {args.repeats} after {args.warmup} warm-up calls, "
        f"each peer interleaved with mx.fast for about {args.peer_budget:g} s"
    )
    skipped = []
    peers = available_peers(skipped)
    for name, dist, ver, setup in peers:
        print(f"peer    : {name} {ver}")
    print("x fast  : 'x mx.fast bf16': mx.fast median of the same interleaved run / path median")
    print(
        "err     : max |out - ref|, ref = float64 attention over the K/V the path attends to "
        "('own deq'); err bf16: over the original bf16 K/V"
    )
    print()

    table = common.MarkdownTable(COLUMNS)
    table.header()
    rows, failures = [], []
    for N in ns:
        bench_n(N, peers, table, args, rows, failures)
        mx.clear_cache()
    for f in failures:
        print(f"skip    : {f['path']} {f['version']} at N={f['N']}: {f['error']}")
    skipped += failures
    print()
    for r in rows:
        if r["N"] == ns[0]:
            print(f"{r['path']:<20}: {r['timed']}")

    common.save_json(
        common.output_path(args, "peers_cpu", args.quick),
        {
            "benchmark": "peers",
            "machine": info,
            "mlx_version": info["mlx_version"],
            "date": info["date"],
            "settings": {
                "B": 1,
                "L": 1,
                "Hq": HQ,
                "Hkv": HKV,
                "D": D,
                "dtype": "bfloat16",
                "group_size": GROUP_SIZE,
                "bits": BITS,
                "N": ns,
                "repeats": args.repeats,
                "warmup": args.warmup,
                "peer_budget_s": args.peer_budget,
                "seed": args.seed,
                "quick": args.quick,
            },
            "peers": {name: ver for name, _, ver, _ in peers},
            "skipped": skipped,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
