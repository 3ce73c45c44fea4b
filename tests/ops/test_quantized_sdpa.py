"""QuantizedSDPA (mlxq.sdpa / mlxq.quantized_sdpa) on the CPU.

Every kernel output is checked against the float64 oracle in reference64.py
with tests/support/helpers.py's tolerances (TOL); outputs are NaN-poisoned first (conftest.py), so
an element the kernel never writes fails. Shapes are a deliberate sample:
each bits value, group size, head dim pairing, GQA ratio, batch, query length,
mask kind, dtype and the split-K path appear, without a Cartesian product.
"""

import itertools
import tempfile

import mlx.core as mx
import numpy as np
import pytest
from support.helpers import (
    DTYPES,
    assert_close,
    assert_cuda_kernel,
    exact_or_skip,
    random_inputs,
    random_sinks,
    rel_err,
    skip_mx_fast_oracle_on_cuda,
    stock_or_skip,
    to_f64,
)
from support.masks import MASK_KINDS, make_mask
from support.reference64 import sdpa64

import mlxq
from mlxq import routing

BITS = [2, 3, 4, 5, 6, 8]
GROUP_SIZES = [32, 64, 128]


def run_and_check(
    q, k, v, *, bits, group_size, scale=None, mask=None, sinks=None, cuda_kernel=None
):
    """Runs the kernel (bits/group size inferred) and checks it against float64.

    cuda_kernel: on a CUDA GPU, the kernel family the call must reach
    ("cuda_decode", "cuda_tiled", "cuda_generic"), so a routing change cannot
    quietly move a case to a fallback."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    mlxq._ext._take_last_sdpa_kernel()
    out = mlxq.sdpa(q, k, v, scale=scale, mask=mask, sinks=sinks)
    ref = sdpa64(q, k, v, scale=scale, mask=mask, sinks=sinks, group_size=group_size, bits=bits)
    assert_close(out, ref, dtype=q.dtype)
    assert_cuda_kernel(cuda_kernel)
    return out


# --- bits, group sizes, scale dtypes ------------------------------------------

# Ragged key counts cycle over the (bits, group size) grid so each size meets
# several bit widths; 1000 keys with Hkv=1 also splits the keys.
RAGGED_N = [1, 7, 33, 257, 1000]


@pytest.mark.parametrize(
    "bits,group_size,N",
    [
        (b, g, RAGGED_N[i % len(RAGGED_N)])
        for i, (b, g) in enumerate(itertools.product(BITS, GROUP_SIZES))
    ],
)
def test_bits_and_group_sizes(rng, bits, group_size, N):
    q, k, v = random_inputs(rng, Hq=4, Hkv=1, L=2, N=N, Dk=128, bits=bits, group_size=group_size)
    run_and_check(q, k, v, bits=bits, group_size=group_size)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("kv_dtype", ["f32", "f16", "bf16"])
def test_bits_and_scale_dtypes(rng, bits, kv_dtype):
    # The kernel is templated on (bits, scales dtype): reach every instance.
    q, k, v = random_inputs(
        rng, Hq=4, Hkv=2, L=3, N=97, Dk=64, bits=bits, group_size=64, kv_dtype=DTYPES[kv_dtype]
    )
    assert k[1].dtype == DTYPES[kv_dtype]
    run_and_check(q, k, v, bits=bits, group_size=64, mask="causal")


# --- separate K and V quantization ------------------------------------------


@pytest.mark.parametrize("k_bits,v_bits", list(itertools.product(BITS, BITS)))
def test_separate_key_and_value_bits(rng, k_bits, v_bits):
    # Every pair of widths, with groups and head dims that differ between K
    # and V too; keys split (Hkv=1, 1000 keys) on the odd pairs.
    kg, vg = GROUP_SIZES[k_bits % 3], GROUP_SIZES[(v_bits + 1) % 3]
    N = 1000 if (k_bits + v_bits) % 2 else 77
    q, k, v = random_inputs(
        rng,
        Hq=4,
        Hkv=1,
        L=3,
        N=N,
        Dk=128,
        Dv=256 if k_bits > v_bits else 128,
        bits=k_bits,
        group_size=kg,
        v_bits=v_bits,
        v_group_size=vg,
        q_dtype=mx.bfloat16,
        kv_dtype=mx.float16,
    )
    scale = 128**-0.5
    out = mlxq.sdpa(q, k, v, scale=scale, mask="causal", v_bits=v_bits, v_group_size=vg)
    ref = sdpa64(
        q,
        k,
        v,
        scale=scale,
        mask="causal",
        group_size=kg,
        bits=k_bits,
        v_bits=v_bits,
        v_group_size=vg,
    )
    assert_close(out, ref, dtype=mx.bfloat16)


# K8/V4 and K4/V4 on each backend's fast paths: head dims 64-512, decode and
# prefill row counts, sinks, f16/bf16 queries (on CUDA both pairs must reach
# the tensor-core decode kernel; K8/V4 prefill reaches the dense copy's
# kernels where the shape has them, else the generic kernel).
FAST_PAIRS = [
    # k_bits, v_bits, D, Hq, Hkv, L, N, q dtype, mask, cuda kernel
    (8, 4, 128, 32, 8, 1, 4099, mx.bfloat16, None, "cuda_decode"),
    (8, 4, 64, 9, 3, 1, 700, mx.float16, None, "cuda_decode"),
    (8, 4, 256, 8, 1, 4, 1500, mx.bfloat16, "causal", "cuda_generic"),  # 32 rows per KV head
    (8, 4, 256, 8, 1, 256, 600, mx.bfloat16, "causal", "cuda_tiled_dense"),
    (8, 4, 512, 8, 1, 512, 4096, mx.bfloat16, "causal", "cuda_gemm"),
    (4, 4, 128, 32, 8, 1, 4099, mx.bfloat16, None, "cuda_decode"),
    (4, 4, 256, 8, 1, 1, 1500, mx.float16, "causal", "cuda_decode"),
    (4, 4, 256, 8, 1, 4, 1500, mx.float16, "causal", "cuda_tiled"),  # 32 rows per KV head
    (4, 4, 128, 8, 2, 64, 300, mx.bfloat16, "causal", "cuda_tiled"),
]


def check_pair(
    rng, *, k_bits, v_bits, kg, vg, D, B, Hq, Hkv, L, N, q_dtype, kv_dtype, mask, kernel
):
    """A K/V pair against float64, with sinks, on mlxq's own kernels
    (``kernel``: the CUDA family it must reach, or None)."""
    q, k, v = random_inputs(
        rng,
        B=B,
        Hq=Hq,
        Hkv=Hkv,
        L=L,
        N=N,
        Dk=D,
        bits=k_bits,
        group_size=kg,
        v_bits=v_bits,
        v_group_size=vg,
        q_dtype=q_dtype,
        kv_dtype=kv_dtype,
    )
    sinks = random_sinks(rng, Hq)
    scale = D**-0.5
    old = routing.set_dequantized_prefill(False)  # mlxq's own kernels
    try:
        mlxq._ext._take_last_sdpa_kernel()
        out = mlxq.sdpa(
            q, k, v, scale=scale, mask=mask, sinks=sinks, v_bits=v_bits, v_group_size=vg
        )
        mx.eval(out)
        assert_cuda_kernel(kernel)
    finally:
        routing.set_dequantized_prefill(old)
    ref = sdpa64(
        q,
        k,
        v,
        scale=scale,
        mask=mask,
        sinks=sinks,
        group_size=kg,
        bits=k_bits,
        v_bits=v_bits,
        v_group_size=vg,
    )
    assert_close(out, ref, dtype=q_dtype)


@pytest.mark.parametrize("k_bits,v_bits,D,Hq,Hkv,L,N,q_dtype,mask,kernel", FAST_PAIRS)
def test_key_value_pairs_on_fast_paths(
    rng, k_bits, v_bits, D, Hq, Hkv, L, N, q_dtype, mask, kernel
):
    check_pair(
        rng,
        k_bits=k_bits,
        v_bits=v_bits,
        kg=64,
        vg=64,
        D=D,
        B=1,
        Hq=Hq,
        Hkv=Hkv,
        L=L,
        N=N,
        q_dtype=q_dtype,
        kv_dtype=q_dtype,
        mask=mask,
        kernel=kernel,
    )


# 8-bit keys with 4-bit values on CUDA's decode kernel: every group pair it
# has an instance of (values at the keys' group or at 32), head dims
# 64/128/256, the three scale dtypes, f16/bf16 queries, sinks, causal
# drafts, ragged and split key counts, two batches.
K8V4_DECODE = [
    # D, k group, v group, scales dtype, q dtype, B, Hq, Hkv, L, N, mask
    (64, 64, 32, mx.bfloat16, mx.bfloat16, 1, 9, 3, 1, 2051, None),
    (64, 32, 32, mx.float16, mx.float16, 2, 4, 2, 2, 97, "causal"),
    (64, 64, 64, mx.float32, mx.bfloat16, 1, 8, 1, 1, 5000, None),
    (128, 64, 32, mx.bfloat16, mx.float16, 1, 32, 8, 1, 4099, None),
    (128, 128, 32, mx.float16, mx.bfloat16, 2, 8, 4, 4, 333, "causal"),
    (128, 128, 128, mx.bfloat16, mx.bfloat16, 1, 16, 2, 1, 1000, None),
    (128, 32, 32, mx.float32, mx.float16, 1, 8, 8, 1, 17, None),
    (256, 64, 32, mx.bfloat16, mx.bfloat16, 1, 8, 1, 1, 1500, None),
    (256, 128, 128, mx.float16, mx.float16, 1, 4, 1, 2, 700, "causal"),
]


@pytest.mark.parametrize("D,kg,vg,kv_dtype,q_dtype,B,Hq,Hkv,L,N,mask", K8V4_DECODE)
def test_k8v4_decode(rng, D, kg, vg, kv_dtype, q_dtype, B, Hq, Hkv, L, N, mask):
    # Head dim 256 needs ~100 KB of shared memory per block: GPUs that allow
    # 99 KB (sm_86/89/120) take the generic kernel there.
    big_smem = mx.device_info().get("compute_capability_major", 0) in (9, 10)
    check_pair(
        rng,
        k_bits=8,
        v_bits=4,
        kg=kg,
        vg=vg,
        D=D,
        B=B,
        Hq=Hq,
        Hkv=Hkv,
        L=L,
        N=N,
        q_dtype=q_dtype,
        kv_dtype=kv_dtype,
        mask=mask,
        kernel="cuda_decode" if D < 256 or big_smem else None,
    )


def test_value_bits_default_to_the_keys(rng):
    # Without v_bits the values are read at the keys' width and group size: a
    # K8/V4 pair then fails the values' shape checks (never a silent misread
    # at half the head dim), and runs once v_bits is given.
    q, k, v = random_inputs(rng, Hq=2, Hkv=1, L=1, N=9, Dk=64, bits=8, v_bits=4)
    with pytest.raises(ValueError, match="values scales width"):
        mlxq.sdpa(q, k, v, scale=0.1)
    assert mlxq.sdpa(q, k, v, scale=0.1, v_bits=4).shape[-1] == 64
    with pytest.raises(ValueError, match="v_bits must be"):
        mlxq.sdpa(q, k, v, scale=0.1, v_bits=7)
    with pytest.raises(ValueError, match="values scales width"):
        mlxq.sdpa(q, k, v, scale=0.1, v_bits=4, v_group_size=128)
    with pytest.raises(ValueError, match="v_group_size must be"):
        mlxq.sdpa(q, k, v, scale=0.1, v_bits=4, v_group_size=48)


# --- head dims -----------------------------------------------------------------


@pytest.mark.parametrize(
    "Dk,Dv,group_size,bits",
    [
        (32, 32, 32, 4),
        (64, 64, 64, 8),
        (96, 96, 32, 3),
        (128, 128, 128, 5),
        (256, 256, 64, 6),
        (512, 512, 128, 4),
        (512, 512, 32, 2),
        (192, 128, 64, 4),  # Dk != Dv (DeepSeek-style)
        (128, 256, 32, 8),
        (64, 512, 64, 3),
        (512, 64, 64, 6),
    ],
)
def test_head_dims(rng, Dk, Dv, group_size, bits):
    q, k, v = random_inputs(
        rng, Hq=4, Hkv=2, L=3, N=75, Dk=Dk, Dv=Dv, bits=bits, group_size=group_size
    )
    out = run_and_check(q, k, v, bits=bits, group_size=group_size, mask="causal")
    assert out.shape == (1, 4, 3, Dv)


# --- GQA / MQA, batch, query length --------------------------------------------


@pytest.mark.parametrize(
    "Hq,Hkv,L",
    [
        (1, 1, 1),
        (4, 4, 5),
        (8, 4, 1),
        (8, 2, 5),
        (16, 2, 1),
        (32, 4, 3),
        (12, 4, 2),
        (40, 8, 8),
        (8, 1, 1),
        (8, 1, 9),
        (32, 1, 2),
    ],
)
def test_gqa_ratios(rng, Hq, Hkv, L):
    # Rep*L rows share one K/V read; 40x8 rows with ratio 5 need two row tiles.
    q, k, v = random_inputs(rng, B=2, Hq=Hq, Hkv=Hkv, L=L, N=200, bits=4, group_size=64)
    run_and_check(q, k, v, bits=4, group_size=64, mask="causal")


@pytest.mark.parametrize(
    "B,L,N,mask",
    [
        (1, 1, 1000, None),
        (2, 2, 257, "causal"),
        (3, 4, 33, None),
        (1, 8, 7, "causal"),  # L > N: the first query sees no key
        (2, 31, 129, "causal"),
        (3, 64, 100, None),
        (1, 300, 400, "causal"),
        (2, 300, 257, "causal"),  # L > N: 43 rows per head see no key
        (3, 1, 1, "causal"),
    ],
)
def test_batch_and_query_length(rng, B, L, N, mask):
    q, k, v = random_inputs(rng, B=B, Hq=4, Hkv=2, L=L, N=N, Dk=64, bits=8, group_size=32)
    run_and_check(q, k, v, bits=8, group_size=32, mask=mask)


@pytest.mark.parametrize(
    "L,N,q_dtype",
    [
        (8, 5, "f32"),
        (31, 7, "f32"),
        (64, 1, "f32"),
        (300, 257, "f32"),
        (31, 7, "bf16"),
        (300, 257, "f16"),
    ],
)
@pytest.mark.parametrize("with_sinks", [False, True])
def test_causal_queries_longer_than_keys(rng, L, N, q_dtype, with_sinks):
    """Bottom-right causal alignment: rows l < L - N see no key and output 0."""
    q, k, v = random_inputs(
        rng, Hq=4, Hkv=2, L=L, N=N, Dk=64, bits=4, group_size=64, q_dtype=DTYPES[q_dtype]
    )
    sinks = random_sinks(rng, 4) if with_sinks else None
    out = run_and_check(q, k, v, bits=4, group_size=64, mask="causal", sinks=sinks)
    out = np.array(out.astype(mx.float32))
    dead = out[:, :, : L - N]
    assert dead.size and (dead == 0).all()
    assert (np.abs(out[:, :, L - N :]).max(axis=-1) > 0).all()


# --- masks and sinks --------------------------------------------------------------


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("with_sinks", [False, True])
def test_masks(rng, kind, with_sinks):
    B, Hq, Hkv, L, N = 2, 8, 2, 8, 100
    q, k, v = random_inputs(rng, B=B, Hq=Hq, Hkv=Hkv, L=L, N=N, bits=4, group_size=64)
    mask = make_mask(kind, rng, B, Hq, L, N)
    sinks = random_sinks(rng, Hq) if with_sinks else None
    out = run_and_check(q, k, v, bits=4, group_size=64, mask=mask, sinks=sinks)
    if kind.startswith("all_"):
        assert (np.array(out) == 0).all()


@pytest.mark.parametrize("kind", MASK_KINDS)
def test_masks_half_precision_many_rows(rng, kind):
    # 8 query heads x 12 positions over 2 KV heads: 48 rows per KV head (the
    # CUDA tiled kernel's path), per-batch / per-head masks, dead rows, sinks.
    i = MASK_KINDS.index(kind)
    q_dtype = [mx.bfloat16, mx.float16][i % 2]
    B, Hq, Hkv, L, N = 2, 8, 2, 12, 90
    q, k, v = random_inputs(
        rng,
        B=B,
        Hq=Hq,
        Hkv=Hkv,
        L=L,
        N=N,
        bits=[4, 8, 3][i % 3],
        group_size=64,
        q_dtype=q_dtype,
        kv_dtype=mx.bfloat16,
    )
    mask = make_mask(kind, rng, B, Hq, L, N)
    sinks = random_sinks(rng, Hq) if i % 3 != 1 else None
    out = run_and_check(
        q,
        k,
        v,
        bits=[4, 8, 3][i % 3],
        group_size=64,
        mask=mask,
        sinks=sinks,
        cuda_kernel="cuda_tiled",
    )
    if kind.startswith("all_"):
        assert (np.array(out.astype(mx.float32)) == 0).all()


@pytest.mark.parametrize(
    "kind,q_dtype",
    [
        ("causal", "f32"),
        ("bool_window", "f32"),
        ("bool_BHLN", "bf16"),
        ("add_f32", "f16"),
        ("all_hidden", "f32"),
        ("add_row_const", "f32"),
    ],
)
def test_masks_with_split_keys(rng, kind, q_dtype):
    # One KV head and few queries: the keys are split across tasks and merged
    # by log-sum-exp; a window leaves most splits fully hidden.
    B, Hq, L, N = 1, 4, 3, 3000
    q, k, v = random_inputs(
        rng, B=B, Hq=Hq, Hkv=1, L=L, N=N, bits=6, group_size=32, q_dtype=DTYPES[q_dtype]
    )
    mask = make_mask(kind, rng, B, Hq, L, N)
    run_and_check(q, k, v, bits=6, group_size=32, mask=mask, sinks=random_sinks(rng, Hq))


@pytest.mark.parametrize("sink_dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("level", ["mixed", "dominant", "neg_inf"])
def test_sinks(rng, sink_dtype, level):
    Hq = 8
    q, k, v = random_inputs(rng, B=2, Hq=Hq, Hkv=2, L=4, N=50, bits=5, group_size=32)
    values = {
        "mixed": rng.normal(0, 2, Hq),
        "dominant": np.full(Hq, 12.0),
        "neg_inf": np.full(Hq, -np.inf),
    }[level]
    sinks = mx.array(values.astype(np.float32)).astype(DTYPES[sink_dtype])
    out = run_and_check(q, k, v, bits=5, group_size=32, mask="causal", sinks=sinks)
    if level == "neg_inf":  # a sink of weight exp(-inf) = 0 changes nothing
        plain = mlxq.sdpa(q, k, v, scale=128**-0.5, mask="causal")
        np.testing.assert_allclose(np.array(out), np.array(plain), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("view", ["strided", "broadcast", "reversed"])
def test_sinks_views(rng, view):
    """Sinks that are float32 views (no copy from astype) are read per head."""
    Hq = 8
    q, k, v = random_inputs(rng, B=1, Hq=Hq, Hkv=2, L=3, N=70, bits=4, group_size=64)
    base = mx.array(rng.normal(0.5, 1.5, 2 * Hq).astype(np.float32))
    sinks = {
        "strided": base[::2],
        "broadcast": mx.broadcast_to(base[3], (Hq,)),
        "reversed": base[:Hq][::-1],
    }[view]
    dense = mx.array(np.array(sinks))
    out = run_and_check(q, k, v, bits=4, group_size=64, mask="causal", sinks=sinks)
    same = mlxq.sdpa(q, k, v, scale=128**-0.5, mask="causal", sinks=dense)
    np.testing.assert_array_equal(np.array(out), np.array(same))


# --- dtypes ------------------------------------------------------------------------


@pytest.mark.parametrize("q_dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("kv_dtype", ["f32", "f16", "bf16"])
def test_query_and_scale_dtypes(rng, q_dtype, kv_dtype):
    bits = {"f32": 4, "f16": 8, "bf16": 3}[kv_dtype]
    q, k, v = random_inputs(
        rng,
        B=2,
        Hq=8,
        Hkv=2,
        L=4,
        N=300,
        bits=bits,
        group_size=64,
        q_dtype=DTYPES[q_dtype],
        kv_dtype=DTYPES[kv_dtype],
    )
    run_and_check(
        q,
        k,
        v,
        bits=bits,
        group_size=64,
        mask="causal",
        sinks=random_sinks(rng, 8, DTYPES[q_dtype]),
    )


@pytest.mark.parametrize("scale", [0.0, -0.09, 3 / 8])
def test_scale_values(rng, scale):
    # 0 averages the visible values uniformly; a large scale makes the softmax
    # nearly one-hot, which stresses the running-max rescaling.
    q, k, v = random_inputs(rng, Hq=4, Hkv=1, L=2, N=600, Dk=64, bits=8, group_size=64)
    run_and_check(q, k, v, bits=8, group_size=64, scale=scale, mask="causal")


# --- strided views -----------------------------------------------------------------


def prefix_view(triple, n, start=0):
    """``buf[..., start:n, :]`` of each array of a quantized cache buffer."""
    return tuple(x[..., start:n, :] for x in triple)


@pytest.mark.parametrize(
    "capacity,start,n,Hkv,L,mask",
    [
        (512, 0, 1, 2, 1, None),
        (512, 0, 100, 2, 3, "causal"),
        (512, 37, 300, 2, 1, None),
        (8192, 0, 5000, 1, 2, "causal"),
        (64, 0, 64, 2, 2, None),
    ],
)
def test_kv_cache_views(rng, capacity, start, n, Hkv, L, mask):
    """K/V as slices of a larger quantized buffer, as a cache hands them out."""
    q, kbuf, vbuf = random_inputs(
        rng, B=2, Hq=8, Hkv=Hkv, L=L, N=capacity, bits=4, group_size=64, kv_dtype=mx.bfloat16
    )
    k, v = prefix_view(kbuf, n, start), prefix_view(vbuf, n, start)
    out = run_and_check(q, k, v, bits=4, group_size=64, mask=mask)
    copied = mlxq.sdpa(
        q, tuple(map(mx.contiguous, k)), tuple(map(mx.contiguous, v)), scale=128**-0.5, mask=mask
    )
    assert np.array_equal(np.array(out), np.array(copied))


def test_kv_cache_view_is_read_in_place(rng):
    """A view of the cache must not be copied: the run allocates almost nothing."""
    q, kbuf, vbuf = random_inputs(rng, Hq=32, Hkv=8, N=16384, bits=8, group_size=64)
    k, v = prefix_view(kbuf, 16000), prefix_view(vbuf, 16000)
    view_bytes = sum(x.nbytes for x in k + v) * 16000 // 16384
    mx.synchronize()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    out = mlxq.sdpa(q, k, v, scale=128**-0.5, mask="causal")
    mx.eval(out)
    extra = mx.get_peak_memory() - before
    assert extra < view_bytes // 16, f"{extra} bytes allocated for a {view_bytes}-byte view"
    assert np.isfinite(np.array(out)).all()


@pytest.mark.parametrize("layout", ["transposed", "strided_last_axis"])
def test_query_views(rng, layout):
    B, Hq, L, D = 2, 8, 5, 64
    if layout == "transposed":  # [B, L, H, D] projections viewed as [B, H, L, D]
        q = mx.array(rng.standard_normal((B, L, Hq, D), dtype=np.float32)).transpose(0, 2, 1, 3)
    else:  # every other element of a wider array
        q = mx.array(rng.standard_normal((B, Hq, L, 2 * D), dtype=np.float32))[..., ::2]
    q = q.astype(mx.float16)
    _, k, v = random_inputs(rng, B=B, Hkv=2, N=90, Dk=D, bits=2, group_size=32)
    out = run_and_check(q, k, v, bits=2, group_size=32, mask="causal")
    dense = mlxq.sdpa(mx.contiguous(q), k, v, scale=D**-0.5, mask="causal")
    assert np.array_equal(np.array(out), np.array(dense))


# --- half-precision decode (CUDA's tensor-core path) ----------------------------------

# On CUDA, f16/bf16 queries with 4- or 8-bit codes, Dk == Dv and few query
# rows per KV head take the tensor-core kernel (csrc/cuda/sdpa/decode.cuh).
# These cases reach each of its instances (bits x head dim x group size) with
# both query dtypes, its row layouts (1 to 8 rows per KV head), ragged key
# counts (partial warp steps and splits), causal drafts, sinks and batches. On
# other devices they are more cases of the same kernel.
MMA_SHAPES = [
    (4, 64, 32),
    (4, 64, 64),
    (4, 128, 32),
    (4, 128, 64),
    (4, 128, 128),
    (4, 256, 32),
    (4, 256, 64),
    (4, 256, 128),
    (8, 64, 32),
    (8, 64, 64),
    (8, 128, 32),
    (8, 128, 64),
    (8, 128, 128),
    (8, 256, 32),
    (8, 256, 64),
    (8, 256, 128),
    (4, 512, 32),
    (4, 512, 64),
    (4, 512, 128),
]
MMA_ROWS = [
    (1, 32, 8, 1, None),
    (2, 8, 8, 1, None),
    (1, 16, 4, 1, None),
    (1, 8, 2, 2, "causal"),
    (2, 4, 1, 1, None),
    (1, 12, 3, 2, "causal"),
]
MMA_N = [1, 17, 300, 1000, 4099, 70]
MMA_CASES = [
    (
        bits,
        D,
        gs,
        q_dtype,
        *MMA_ROWS[(2 * i + j) % len(MMA_ROWS)],
        MMA_N[(i + j) % len(MMA_N)],
        (i + j) % 2 == 1,
        ["bf16", "f16", "f32"][(i + j) % 3],
    )
    for i, (bits, D, gs) in enumerate(MMA_SHAPES)
    for j, q_dtype in enumerate(["bf16", "f16"])
]


@pytest.mark.parametrize(
    "bits,D,group_size,q_dtype,B,Hq,Hkv,L,mask,N,with_sinks,kv_dtype", MMA_CASES
)
def test_half_precision_decode(
    rng, bits, D, group_size, q_dtype, B, Hq, Hkv, L, mask, N, with_sinks, kv_dtype
):
    q, k, v = random_inputs(
        rng,
        B=B,
        Hq=Hq,
        Hkv=Hkv,
        L=L,
        N=N,
        Dk=D,
        bits=bits,
        group_size=group_size,
        q_dtype=DTYPES[q_dtype],
        kv_dtype=DTYPES[kv_dtype],
    )
    sinks = random_sinks(rng, Hq) if with_sinks else None
    # 8-bit codes at head dim 256 need 105-127 KB of shared memory per block,
    # 4-bit at 512 (Gemma 4's global layers) ~110 KB: GPUs that allow 99 KB
    # (sm_86/89/120) take the generic kernel there; sm_90/100 have 227 KB.
    big_smem = mx.device_info().get("compute_capability_major", 0) in (9, 10)
    kernel = None if (bits, D) == (8, 256) or (D == 512 and not big_smem) else "cuda_decode"
    run_and_check(
        q, k, v, bits=bits, group_size=group_size, mask=mask, sinks=sinks, cuda_kernel=kernel
    )


@pytest.mark.parametrize(
    "bits,group_size,n,q_dtype",
    [(4, 64, 1000, "bf16"), (8, 128, 333, "f16"), (4, 32, 47, "f16"), (8, 64, 2049, "bf16")],
)
def test_half_precision_decode_cache_views(rng, bits, group_size, n, q_dtype):
    """Views of a cache whose rows past the view hold NaN scales and biases:
    nothing beyond the view may be read into the result."""
    q, kbuf, vbuf = random_inputs(
        rng,
        Hq=16,
        Hkv=4,
        N=n + 100,
        bits=bits,
        group_size=group_size,
        q_dtype=DTYPES[q_dtype],
        kv_dtype=mx.bfloat16,
    )
    past = mx.arange(n + 100)[:, None] >= n

    def poison_past(triple):
        w, s, b = triple
        return w, mx.where(past, mx.nan, s), mx.where(past, mx.nan, b)

    k, v = prefix_view(poison_past(kbuf), n), prefix_view(poison_past(vbuf), n)
    run_and_check(q, k, v, bits=bits, group_size=group_size, cuda_kernel="cuda_decode")


# --- long contexts (split-K decode) ------------------------------------------------


@pytest.mark.parametrize(
    "B,Hq,Hkv,L,N,bits,group_size,q_dtype,mask,with_sinks",
    [
        (1, 8, 1, 1, 5000, 4, 64, "f32", None, False),
        (1, 8, 1, 4, 5000, 8, 32, "f32", "causal", True),
        (2, 8, 2, 2, 3000, 6, 128, "bf16", "causal", False),
        (1, 8, 1, 1, 40000, 4, 64, "f32", None, False),
        (1, 8, 1, 1, 40000, 3, 128, "bf16", None, True),
    ],
)
def test_long_context(rng, B, Hq, Hkv, L, N, bits, group_size, q_dtype, mask, with_sinks):
    q, k, v = random_inputs(
        rng,
        B=B,
        Hq=Hq,
        Hkv=Hkv,
        L=L,
        N=N,
        bits=bits,
        group_size=group_size,
        q_dtype=DTYPES[q_dtype],
    )
    sinks = random_sinks(rng, Hq) if with_sinks else None
    run_and_check(q, k, v, bits=bits, group_size=group_size, mask=mask, sinks=sinks)


# --- random combinations ------------------------------------------------------------


def random_config(seed):
    """A random mix of every option, to catch interactions the tables above miss."""
    r = np.random.default_rng(seed)
    gs = int(r.choice(GROUP_SIZES))
    dims = [d for d in (32, 64, 96, 128, 192, 256, 384, 512) if d % gs == 0]
    Hkv = int(r.choice([1, 2, 3, 4]))
    L = int(r.choice([1, 1, 2, 4, 8, 17, 31, 64]))
    return dict(
        bits=int(r.choice(BITS)),
        group_size=gs,
        Dk=int(r.choice(dims)),
        Dv=int(r.choice(dims)),
        B=int(r.integers(1, 4)),
        Hkv=Hkv,
        Hq=Hkv * int(r.choice([1, 2, 3, 4, 8])),
        L=L,
        N=int(r.choice([1, 5, 32, 33, 100, 511, 777, 2100])),
        q_dtype=str(r.choice(list(DTYPES))),
        kv_dtype=str(r.choice(list(DTYPES))),
        mask=str(
            r.choice(["none", "causal", "bool_BHLN", "bool_keypad", "add_bf16", "bool_window"])
        ),
        sinks=bool(r.random() < 0.5),
        view=bool(r.random() < 0.4),
        q_transposed=bool(r.random() < 0.3),
    )


@pytest.mark.parametrize("seed", range(40))
def test_random_configurations(rng, seed):
    c = random_config(seed)
    B, Hq, Hkv, L, N = c["B"], c["Hq"], c["Hkv"], c["L"], c["N"]
    # A cache buffer larger than N when testing views, sliced back to N keys.
    capacity = N + 13 if c["view"] else N
    q, k, v = random_inputs(
        rng,
        B=B,
        Hq=Hq,
        Hkv=Hkv,
        L=L,
        N=capacity,
        Dk=c["Dk"],
        Dv=c["Dv"],
        bits=c["bits"],
        group_size=c["group_size"],
        q_dtype=DTYPES[c["q_dtype"]],
        kv_dtype=DTYPES[c["kv_dtype"]],
    )
    k, v = prefix_view(k, N), prefix_view(v, N)
    if c["q_transposed"]:
        q = mx.contiguous(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    mask = make_mask(c["mask"], rng, B, Hq, L, N)
    sinks = random_sinks(rng, Hq) if c["sinks"] else None
    run_and_check(q, k, v, bits=c["bits"], group_size=c["group_size"], mask=mask, sinks=sinks)


# --- bits / group size inference --------------------------------------------------


@pytest.mark.parametrize(
    "bits,group_size,Dk,Dv",
    [
        (2, 32, 64, 64),
        (3, 128, 256, 128),
        (4, 64, 128, 128),
        (5, 64, 192, 128),
        (6, 32, 96, 96),
        (8, 128, 128, 512),
    ],
)
def test_explicit_bits_and_group_size_match_inferred(rng, bits, group_size, Dk, Dv):
    q, k, v = random_inputs(
        rng, Hq=4, Hkv=2, L=2, N=40, Dk=Dk, Dv=Dv, bits=bits, group_size=group_size
    )
    inferred = run_and_check(q, k, v, bits=bits, group_size=group_size)
    for kwargs in (
        {"bits": bits},
        {"group_size": group_size},
        {"bits": bits, "group_size": group_size},
    ):
        explicit = mlxq.quantized_sdpa(
            q, k, v, scale=Dk**-0.5, mask=None, sinks=None, stream=None, **kwargs
        )
        assert np.array_equal(np.array(explicit), np.array(inferred)), kwargs


# --- routing and the reference compositions ---------------------------------------


def graph_text(out: mx.array) -> str:
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, out)
        return f.read()


@pytest.mark.parametrize("mask", [None, "causal", "bool", "additive"])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_sdpa_plain_arrays_go_to_mlx(rng, mask, with_sinks):
    B, Hq, Hkv, L, N, D = 2, 8, 2, 3, 40, 64
    q = mx.array(rng.standard_normal((B, Hq, L, D), dtype=np.float32))
    k = mx.array(rng.standard_normal((B, Hkv, N, D), dtype=np.float32))
    v = mx.array(rng.standard_normal((B, Hkv, N, D), dtype=np.float32))
    if mask == "bool":
        mask = mx.array(rng.random((L, N)) < 0.7)
    elif mask == "additive":
        mask = mx.array(rng.normal(0, 1, (B, 1, L, N)).astype(np.float32))
    sinks = random_sinks(rng, Hq) if with_sinks else None
    out = mlxq.sdpa(q, k, v, scale=0.125, mask=mask, sinks=sinks)
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask, sinks=sinks)
    assert "QuantizedSDPA" not in graph_text(out)
    assert np.array_equal(np.array(out), np.array(expected))


def test_sdpa_triples_go_to_the_kernel(rng):
    q, k, v = random_inputs(rng, B=2, Hq=8, Hkv=2, L=3, N=70, bits=4, group_size=64)
    sinks = random_sinks(rng, 8)
    out = mlxq.sdpa(q, k, v, scale=0.1, mask="causal", sinks=sinks)
    graph = graph_text(out)
    assert "QuantizedSDPA" in graph and "QuantizedMatmul" not in graph
    direct = mlxq._ext.quantized_sdpa(q, *k, *v, scale=0.1, mask_mode="causal", sinks=sinks)
    assert np.array_equal(np.array(out), np.array(direct))
    # The stream argument reaches the kernel: on the CPU stream it is the CPU
    # kernel (bit-identical when the default device is the CPU too; another
    # device's kernel rounds differently).
    on_cpu = mlxq.quantized_sdpa(q, k, v, scale=0.1, mask="causal", sinks=sinks, stream=mx.cpu)
    if mx.default_device() == mx.cpu:
        assert np.array_equal(np.array(out), np.array(on_cpu))
    else:
        assert rel_err(to_f64(out), to_f64(on_cpu)) <= 1e-5
    # Lists work as triples too (mlx-lm caches hand out tuples or lists).
    as_lists = mlxq.sdpa(q, list(k), list(v), scale=0.1, mask="causal", sinks=sinks)
    assert np.array_equal(np.array(out), np.array(as_lists))


@pytest.mark.parametrize(
    "stream",
    [mx.cpu, mx.Device(mx.cpu), mx.default_stream(mx.cpu)],
    ids=["type", "device", "stream"],
)
def test_stream_forms_many_rows(rng, stream):
    # mx.cpu (a DeviceType), a Device or a Stream, as MLX's ops take them, on
    # the many-row path whose GPU routing looks at the device.
    q, k, v = random_inputs(rng, Hq=4, Hkv=2, L=20, N=40, bits=4, group_size=64)
    out = mlxq.quantized_sdpa(q, k, v, scale=0.1, mask="causal", stream=stream)
    on_cpu = mlxq._ext.quantized_sdpa(q, *k, *v, scale=0.1, mask_mode="causal", stream=mx.cpu)
    assert np.array_equal(np.array(out), np.array(on_cpu))


REFERENCE_CASES = [
    # q dtype, kv dtype, bits, group size, Hq, Hkv, L, N, mask, sinks
    ("f32", "f32", 4, 64, 8, 2, 1, 300, None, False),
    ("f32", "f32", 8, 32, 8, 8, 5, 64, "causal", True),
    ("f32", "f16", 3, 128, 4, 1, 4, 129, "bool", False),
    ("f32", "f32", 2, 64, 8, 4, 3, 80, "additive", True),
    ("f16", "f16", 6, 64, 8, 2, 7, 200, "causal", False),
    ("f16", "f16", 5, 32, 16, 2, 1, 1000, None, True),
    ("bf16", "bf16", 4, 64, 8, 1, 2, 513, "bool", True),
    ("bf16", "bf16", 8, 128, 4, 2, 16, 64, "causal", False),
]


def reference_mask(kind, rng, B, Hq, L, N):
    """Masks that leave every query at least one key (mlx-lm averages dead rows)."""
    if kind == "bool":
        m = rng.random((L, N)) < 0.6
        m[:, 0] = True
        return mx.array(m)
    if kind == "additive":
        return mx.array(rng.normal(0, 2, (B, Hq, L, N)).astype(np.float32))
    return kind


def as_f32(q, k, v):
    """The same values in float32: q, and each triple's scales and biases."""
    f32 = lambda t: (t[0], t[1].astype(mx.float32), t[2].astype(mx.float32))
    return q.astype(mx.float32), f32(k), f32(v)


def check_against_composition(out, composition, q, k, v, **kwargs):
    """Checks the kernel against an mlx-lm-style composition on the same inputs.

    In f32 the composition runs on exactly the kernel's inputs. In f16/bf16 it
    computes scores, probabilities and outputs in half precision, which alone
    puts it 3e-3..6e-3 (f16) and 2e-2..4e-2 (bf16) from float64, beyond
    TOL's bounds, while the kernel (f32 accumulation) is ~10x closer. So
    for half dtypes the composition gets the same values upcast to f32 (exact),
    and the half-precision kernel must match it within its dtype's bound; the
    native half run must not beat the kernel against float64.

    The kernel is first checked against the float64 oracle, which runs on every
    device. The composition checks are skipped where the composition itself
    cannot run (``stock_or_skip``: MLX's CUDA quantized_matmul lacks kernels for
    many of these shapes), and the f32 comparison also where the f32
    composition is not an exact baseline on this device (``exact_or_skip``: on
    CUDA, where MLX's f32 matmuls round like TF32).
    """
    ref = sdpa64(q, k, v, **kwargs)
    assert_close(out, ref, dtype=q.dtype)
    if q.dtype != mx.float32:
        native = to_f64(stock_or_skip(composition, q, k, v, **kwargs))
        assert rel_err(to_f64(out), ref) <= rel_err(native, ref)
        q, k, v = as_f32(q, k, v)
    exact = exact_or_skip(to_f64(stock_or_skip(composition, q, k, v, **kwargs)), ref)
    assert_close(out, exact, dtype=out.dtype)


@pytest.mark.parametrize(
    "q_dtype,kv_dtype,bits,group_size,Hq,Hkv,L,N,mask,with_sinks", REFERENCE_CASES
)
def test_agrees_with_reference_composition(
    rng, q_dtype, kv_dtype, bits, group_size, Hq, Hkv, L, N, mask, with_sinks
):
    B = 2
    q, k, v = random_inputs(
        rng,
        B=B,
        Hq=Hq,
        Hkv=Hkv,
        L=L,
        N=N,
        bits=bits,
        group_size=group_size,
        q_dtype=DTYPES[q_dtype],
        kv_dtype=DTYPES[kv_dtype],
    )
    mask = reference_mask(mask, rng, B, Hq, L, N)
    sinks = random_sinks(rng, Hq) if with_sinks else None
    scale = 128**-0.5
    out = mlxq.sdpa(q, k, v, scale=scale, mask=mask, sinks=sinks)
    check_against_composition(
        out,
        mlxq.reference.quantized_sdpa,
        q,
        k,
        v,
        scale=scale,
        mask=mask,
        sinks=sinks,
        group_size=group_size,
        bits=bits,
    )


@pytest.mark.parametrize(
    "q_dtype,bits,group_size,Hq,Hkv,L,N,mask",
    [
        ("f32", 4, 64, 8, 2, 1, 500, None),
        ("f32", 8, 64, 8, 8, 6, 100, "causal"),
        ("f16", 4, 32, 4, 1, 3, 200, "bool"),
        ("bf16", 8, 128, 16, 4, 2, 64, "causal"),
        ("f32", 2, 128, 8, 2, 9, 40, "bool"),
    ],
)
def test_agrees_with_mlx_lm(rng, q_dtype, bits, group_size, Hq, Hkv, L, N, mask):
    # mlx-lm is a test dependency (pyproject's "test" extra): a missing install
    # fails here rather than silently skipping the comparison.
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    def mlx_lm_sdpa(q, k, v, *, sinks=None, **kwargs):
        assert sinks is None  # mlx-lm's quantized path has no sinks
        # mlx-lm scales its queries with `*=`, which would overwrite ours: pass a copy.
        return quantized_scaled_dot_product_attention(mx.array(q), k, v, **kwargs)

    dtype = DTYPES[q_dtype]
    q, k, v = random_inputs(
        rng,
        B=2,
        Hq=Hq,
        Hkv=Hkv,
        L=L,
        N=N,
        bits=bits,
        group_size=group_size,
        q_dtype=dtype,
        kv_dtype=dtype,
    )
    mask = reference_mask(mask, rng, 2, Hq, L, N)
    scale = 128**-0.5
    out = mlxq.sdpa(q, k, v, scale=scale, mask=mask)
    check_against_composition(
        out, mlx_lm_sdpa, q, k, v, scale=scale, mask=mask, group_size=group_size, bits=bits
    )


# --- the oracle itself ------------------------------------------------------------


@pytest.mark.parametrize("mask", ["none", "causal", "bool_B1LN", "add_f32", "bool_window"])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_oracle_matches_mx_fast_semantics(rng, mask, with_sinks):
    """reference64 follows mx.fast's conventions (causal alignment, masks, sinks).

    Run on float32 K/V equal to the dequantized triples, with L < N and no
    fully hidden row, where mx.fast's result is well defined.
    """
    skip_mx_fast_oracle_on_cuda()
    B, Hq, Hkv, L, N = 2, 8, 2, 8, 100
    q, k, v = random_inputs(rng, B=B, Hq=Hq, Hkv=Hkv, L=L, N=N, bits=4, group_size=64)
    mask = make_mask(mask, rng, B, Hq, L, N)
    if isinstance(mask, mx.array) and mask.dtype != mx.bool_:
        # Unhide query 0's row (large finite offsets would cost f32 precision
        # in mx.fast); one hidden key column keeps -inf in play.
        mask = mx.maximum(mask, -30.0) + mx.where(mx.arange(N) == 3, -np.inf, 0.0)
    sinks = random_sinks(rng, Hq) if with_sinks else None
    deq = [mx.dequantize(*t, group_size=64, bits=4) for t in (k, v)]
    fast = mx.fast.scaled_dot_product_attention(q, *deq, scale=0.1, mask=mask, sinks=sinks)
    ref = sdpa64(q, k, v, scale=0.1, mask=mask, sinks=sinks, group_size=64, bits=4)
    assert_close(fast, ref, dtype=mx.float32)
