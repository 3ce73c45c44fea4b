"""The CPU kernel's integer products (csrc/cpu/int_dot.h).

With bf16/f16 queries, 2/3/4/5/6/8-bit codes and head dims the kernels cover, the CPU kernel multiplies int16
queries and weights by the codes in integer lanes. Each case here runs both paths in one process
(``MLXQ_CPU_INT=0``, set through the ``set_env`` fixture, forces the f32 products) on the same inputs, checks each
against the float64 oracle with the usual tolerances (outputs NaN-poisoned
first, conftest.py), checks that the integer path's error is within a small
margin of the f32 path's, and that the call took the path it should. Every case
runs with the best kernels the CPU has and, on AVX-512 CPUs, with the AVX2
ones too (``MLXQ_CPU_INT=avx2``), and on VNNI CPUs with the AVX-512BW ones
(``MLXQ_CPU_INT=avx512-bw``); without AVX2 the integer cases assert the f32
path instead.
"""

import re

import mlx.core as mx
import numpy as np
import pytest
from support.helpers import assert_close, random_inputs, random_sinks, to_f64
from support.reference64 import sdpa64

import mlxq


def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            flags = re.search(r"^flags\s*:(.*)$", f.read(), re.M)
    except OSError:
        return set()
    return set(flags.group(1).split()) if flags else set()


FLAGS = _cpu_flags()
AVX512 = {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= FLAGS
AVX2 = {"avx2", "fma", "f16c"} <= FLAGS
# The integer kernels each case runs: the best this CPU has ("1"), and the
# AVX2 (and AVX-512BW) ones too where the best are AVX-512 (VNNI).
PATHS = ["1"] + (["avx2"] if AVX512 and AVX2 else [])
if AVX512 and "avx512_vnni" in FLAGS:
    PATHS.append("avx512-bw")  # vpmaddwd + vpaddd instead of vpdpwssd


# The integer path's relative error may exceed the f32 path's by this much
# (int16 queries and weights: measured below 1e-4 over this file's cases).
MARGIN = 5e-4


@pytest.fixture(autouse=True)
def _cpu_only(device):
    # Per test, not at import: on a CUDA host the default device at import is
    # the GPU, and a module-level skip dropped the CPU cases too.
    if device != mx.cpu:
        pytest.skip("the CPU kernel's products (the GPU kernels are tested apart)")


def half_inputs(rng, dtype, **shape):
    """random_inputs with queries and K/V scales both in ``dtype``."""
    return random_inputs(rng, q_dtype=dtype, kv_dtype=dtype, **shape)


@pytest.fixture(params=PATHS)
def int_path(request):
    return request.param


def expected_kernels(flag):
    if flag in ("avx2", "avx512-bw"):
        return flag
    return (
        "avx512-vnni"
        if AVX512 and "avx512_vnni" in FLAGS
        else "avx512-bw"
        if AVX512
        else "avx2"
        if AVX2
        else None
    )


def both_paths(set_env, flag, q, k, v, **kw):
    """(integer-path output, kernel name), (f32-path output, kernel name)."""
    outs = []
    for flag in (flag, "0"):
        set_env("MLXQ_CPU_INT", flag)
        mlxq._ext._take_last_sdpa_kernel()
        out = mlxq.sdpa(q, k, v, **kw)
        mx.eval(out)
        outs.append((out, mlxq._ext._take_last_sdpa_kernel()))
    return outs


def check(
    set_env, flag, q, k, v, *, bits, group_size, v_bits=None, v_group_size=None, int_path=True, **kw
):
    kw.setdefault("scale", q.shape[-1] ** -0.5)
    fmt = dict(
        group_size=group_size,
        bits=bits,
        v_group_size=v_group_size or group_size,
        v_bits=v_bits or bits,
    )
    set_env("MLXQ_CPU_INT", flag)
    kernels = mlxq._ext._cpu_int_kernels()
    assert kernels == expected_kernels(flag)
    (fast, used), (exact, used_f32) = both_paths(set_env, flag, q, k, v, **fmt, **kw)
    ref = sdpa64(q, k, v, **fmt, **kw)
    err_f32 = assert_close(exact, ref, dtype=q.dtype)
    err_int = assert_close(fast, ref, dtype=q.dtype)
    assert used_f32 == "cpu_f32"
    assert used == ("cpu_int16" if int_path and kernels else "cpu_f32")
    assert err_int <= err_f32 + MARGIN, f"integer path {err_int:.3g} vs f32 {err_f32:.3g}"
    return fast


CASES = [
    # bits, v_bits, D, group size, Hq, Hkv, L, N
    (4, 4, 128, 64, 32, 8, 1, 1000),
    (4, 4, 128, 32, 8, 2, 1, 257),
    (4, 4, 128, 128, 4, 4, 1, 33),
    (4, 4, 256, 64, 16, 8, 1, 300),
    (4, 4, 256, 32, 10, 2, 1, 17),  # 5 rows per KV head: a block of 4, then 1
    (4, 4, 512, 32, 8, 1, 1, 64),  # 16 groups
    (8, 8, 64, 64, 4, 1, 1, 100),
    (8, 8, 64, 32, 6, 2, 2, 31),
    (8, 8, 128, 64, 32, 8, 1, 1000),
    (8, 8, 256, 128, 6, 2, 3, 16),
    (8, 4, 128, 64, 8, 2, 1, 500),  # llama.cpp's q8_0-K / q4_0-V pair
    (4, 8, 256, 64, 4, 2, 1, 15),
    # Decode tiles of at most 4 rows take the fused key kernel, one
    # instantiation per words-per-group: 8-bit groups of 128 (32 words,
    # a group spans two transposed blocks) and of 32 (8 words), 3 rows.
    (8, 8, 256, 128, 8, 2, 1, 77),
    (8, 8, 128, 32, 4, 2, 1, 45),
    (4, 4, 128, 64, 6, 2, 1, 50),
    (4, 4, 256, 128, 4, 1, 1, 60),  # 16-word groups over two blocks of words
    (8, 8, 512, 128, 2, 1, 1, 40),  # 32-word groups, 128 words a row
]


@pytest.mark.parametrize("q_dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("bits,v_bits,D,gs,Hq,Hkv,L,N", CASES)
def test_integer_products_match_the_oracle(
    set_env, int_path, rng, q_dtype, bits, v_bits, D, gs, Hq, Hkv, L, N
):
    q, k, v = half_inputs(
        rng, q_dtype, Hq=Hq, Hkv=Hkv, L=L, N=N, Dk=D, bits=bits, group_size=gs, v_bits=v_bits
    )
    check(set_env, int_path, q, k, v, bits=bits, group_size=gs, v_bits=v_bits)


@pytest.mark.parametrize("kv_dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_scale_dtypes(set_env, int_path, rng, kv_dtype):
    q, k, v = random_inputs(
        rng,
        Hq=8,
        Hkv=2,
        N=77,
        Dk=128,
        bits=4,
        group_size=64,
        q_dtype=mx.bfloat16,
        kv_dtype=kv_dtype,
    )
    check(set_env, int_path, q, k, v, bits=4, group_size=64)


@pytest.mark.parametrize("mask", ["bool", "bool_late", "causal"])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_masks_and_sinks(set_env, int_path, rng, mask, with_sinks):
    L, N, Hq = 4, 130, 8
    q, k, v = half_inputs(rng, mx.float16, Hq=Hq, Hkv=2, L=L, N=N, Dk=128, bits=4, group_size=64)
    if mask.startswith("bool"):
        visible = rng.random((L, N)) < 0.5
        visible[:, 0] = True
        if mask == "bool_late":
            # Position 1 sees nothing in the first two chunks of keys: its
            # rows' softmax starts from a max of -inf mid-tile (the AVX-512
            # 4-row softmax hands such blocks to its one-row code).
            visible[1, :70] = False
            visible[1, 100] = True
        m = mx.array(visible)
    else:
        m = "causal"
    sinks = random_sinks(rng, Hq) if with_sinks else None
    check(set_env, int_path, q, k, v, bits=4, group_size=64, mask=m, sinks=sinks)


def test_cache_views_and_transposed_layouts(set_env, int_path, rng):
    """A prefix of a bigger buffer (rows apart by the buffer's stride) and
    triples laid out [B, N, H, ...] then transposed (keys H rows apart)."""
    q, k, v = half_inputs(rng, mx.bfloat16, Hq=8, Hkv=2, N=300, Dk=128, bits=8, group_size=32)
    prefix = lambda t: tuple(a[:, :, :201, :] for a in t)  # noqa: E731
    check(set_env, int_path, q, prefix(k), prefix(v), bits=8, group_size=32)
    swapped = lambda t: tuple(mx.contiguous(a.swapaxes(1, 2)).swapaxes(1, 2) for a in t)  # noqa: E731
    k2, v2 = swapped(k), swapped(v)
    check(set_env, int_path, q, k2, v2, bits=8, group_size=32)


ODD_CASES = [
    # bits, v_bits, D, group size, Hq, Hkv, L, N: 2/3/5/6-bit codes, spread
    # to bytes per chunk and taken by the 8-bit kernels.
    (3, 3, 128, 64, 32, 8, 1, 300),
    (2, 2, 128, 32, 8, 2, 1, 77),
    (5, 5, 64, 64, 4, 1, 1, 100),
    (6, 6, 256, 128, 6, 2, 2, 45),
    (3, 4, 128, 64, 8, 2, 1, 130),  # K3/V4
    (8, 3, 128, 32, 4, 4, 1, 33),
    (6, 5, 512, 64, 8, 1, 1, 70),
    (2, 6, 64, 32, 10, 2, 1, 16),  # 5 rows per KV head, one chunk
]


@pytest.mark.parametrize("q_dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("bits,v_bits,D,gs,Hq,Hkv,L,N", ODD_CASES)
def test_odd_widths(set_env, int_path, rng, q_dtype, bits, v_bits, D, gs, Hq, Hkv, L, N):
    q, k, v = half_inputs(
        rng, q_dtype, Hq=Hq, Hkv=Hkv, L=L, N=N, Dk=D, bits=bits, group_size=gs, v_bits=v_bits
    )
    check(set_env, int_path, q, k, v, bits=bits, group_size=gs, v_bits=v_bits)


@pytest.mark.parametrize("bits,D,covered", [(4, 64, False), (3, 96, False), (2, 128, True)])
def test_uncovered_formats_keep_the_f32_products(set_env, int_path, rng, bits, D, covered):
    """4-bit rows need 128-element blocks, the spread widths 64-element ones."""
    q, k, v = half_inputs(rng, mx.bfloat16, Hq=4, Hkv=2, N=40, Dk=D, bits=bits, group_size=32)
    check(set_env, int_path, q, k, v, bits=bits, group_size=32, int_path=covered)


def test_f32_queries_keep_the_f32_products(set_env, int_path, rng):
    q, k, v = random_inputs(rng, Hq=4, Hkv=2, N=40, Dk=128, bits=4, group_size=64)
    check(set_env, int_path, q, k, v, bits=4, group_size=64, int_path=False)


@pytest.mark.parametrize("bits", [4, 3])
def test_tiny_value_scales(set_env, int_path, rng, bits):
    """A V group whose scales are all ~1e-36 (bf16 reaches that low): the
    weights' normalisation by the scales' peak must not overflow to inf."""
    q, k, v = half_inputs(rng, mx.bfloat16, Hq=8, Hkv=2, N=100, Dk=128, bits=bits, group_size=64)
    codes, scales, biases = v
    tiny = mx.concatenate([scales[..., :1], scales[..., 1:] * 1e-36], axis=-1)
    v = (codes, tiny.astype(scales.dtype), biases)
    out = check(set_env, int_path, q, k, v, bits=bits, group_size=64)
    assert np.isfinite(to_f64(out)).all()


def test_large_scores(set_env, int_path, rng):
    """Peaky softmax (queries x8): int16 queries keep the error of f32's."""
    q, k, v = half_inputs(rng, mx.float16, Hq=8, Hkv=2, N=2000, Dk=128, bits=4, group_size=64)
    q = (q.astype(mx.float32) * 8).astype(mx.float16)
    out = check(set_env, int_path, q, k, v, bits=4, group_size=64)
    assert np.isfinite(to_f64(out)).all()
