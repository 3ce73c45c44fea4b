"""QuantizedSDPA at prefill sizes: equivalence, bounded memory, hidden keys unread.

The CPU kernel serves every query length L with one loop: a task is (batch, KV
head, row tile of up to 64 (query, head) rows, key split), keys go in chunks of
32 with an online softmax, and only the current chunk is dequantized into
per-thread scratch. These tests cover what prefill (and chunked prefill /
speculative decoding) needs on top of tests/ops/test_quantized_sdpa.py:

* equivalence with the float64 oracle for L in {2, 7, 32, 33, 300, 2048},
  without a mask, with "causal", and with bool masks built here (causal,
  causal + sliding window, causal OR a bidirectional image span, both), at
  offset 0 (N = L) and offset > 0 (N > L: the queries are the last L
  positions of a longer cache, bottom-right aligned), on contiguous K/V and on
  strided views ``buf[..., :N, :]`` of a larger preallocated quantized buffer
  whose rows past N hold NaN-producing garbage;
* peak memory across a large-L call stays within a small bound over the
  output, where the composition would materialise the score matrix;
* a causal call's result does not depend on the keys that the mask hides
  (they are filled with NaN-producing garbage and the queries that cannot see
  them must not change by a single bit), and a causal call skips the hidden
  chunks (it takes about half the time of an unmasked one).
"""

import mlx.core as mx
import numpy as np
import pytest
from support.helpers import DTYPES, assert_close, assert_cuda_kernel, on_cuda_gpu, random_inputs
from support.reference64 import sdpa64

import mlxq
from mlxq import routing

BITS, GROUP_SIZE = 4, 64
MiB = 1 << 20


# --- inputs ----------------------------------------------------------------------------


def poison_rows(triple, start):
    """The triple with the scales and biases of rows >= ``start`` (sequence axis)
    set to NaN: any read of such a row makes a NaN score or value."""
    packed, scales, biases = triple
    hide = (mx.arange(scales.shape[-2]) >= start)[:, None]
    nan = mx.array(float("nan"), dtype=scales.dtype)
    out = (packed, mx.where(hide, nan, scales), mx.where(hide, nan, biases))
    mx.eval(*out)
    return out


def prefix_view(triple, n):
    """``buf[..., :n, :]`` of each array: what a cache hands to attention."""
    return tuple(x[..., :n, :] for x in triple)


def capacity_for(N):
    # A cache grows its buffer in steps of 256; leave at least one step spare.
    return (N // 256 + 2) * 256


def make_inputs(rng, *, B, Hq, Hkv, L, N, D, strided, q_dtype=mx.float32, kv_dtype=mx.float32):
    """Queries and K/V triples; with ``strided`` the K/V are views of the first N
    rows of a larger buffer whose remaining rows are NaN garbage."""
    cap = capacity_for(N) if strided else N
    q, kbuf, vbuf = random_inputs(
        rng,
        B=B,
        Hq=Hq,
        Hkv=Hkv,
        L=L,
        N=cap,
        Dk=D,
        bits=BITS,
        group_size=GROUP_SIZE,
        q_dtype=q_dtype,
        kv_dtype=kv_dtype,
    )
    if not strided:
        return q, kbuf, vbuf
    k = prefix_view(poison_rows(kbuf, N), N)
    v = prefix_view(poison_rows(vbuf, N), N)
    assert k[0].shape[-2] == N and kbuf[0].shape[-2] == cap > N
    return q, k, v


# --- masks, [L, N] bool, True = attend ------------------------------------------------


def window_size(L):
    return 37 + L // 3


def image_span(L, N):
    """A contiguous run of key positions that attend to each other, covering
    some queries and (when N > L) some cached positions just before them."""
    off = N - L
    start = max(0, off + L // 4 - 5)
    end = min(N, off + (3 * L) // 4 + 1)
    return start, end


def bool_mask(kind, L, N):
    """``kind`` as a bool [L, N] numpy array; queries sit at positions N-L .. N-1."""
    qpos = np.arange(N - L, N)[:, None]
    kpos = np.arange(N)[None, :]
    causal = kpos <= qpos
    window = causal & (qpos - kpos < window_size(L))
    start, end = image_span(L, N)
    span = ((qpos >= start) & (qpos < end)) & ((kpos >= start) & (kpos < end))
    return {
        "causal_bool": causal,
        "window": window,
        "bidir": causal | span,
        "bidir_window": window | span,
    }[kind]


def make_mask(kind, L, N):
    if kind == "none":
        return None
    if kind == "causal":
        return "causal"
    return mx.array(bool_mask(kind, L, N))


PREFILL_MASKS = ["none", "causal", "causal_bool", "window", "bidir", "bidir_window"]


def run_and_check(q, k, v, mask):
    scale = q.shape[-1] ** -0.5
    out = mlxq.sdpa(q, k, v, scale=scale, mask=mask)
    ref = sdpa64(q, k, v, scale=scale, mask=mask, group_size=GROUP_SIZE, bits=BITS)
    assert_close(out, ref, dtype=q.dtype)
    return out


# --- equivalence with the float64 oracle ------------------------------------------------


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("offset", [0, 941])
@pytest.mark.parametrize("kind", PREFILL_MASKS)
@pytest.mark.parametrize("L", [2, 7, 32, 33, 300])
def test_prefill_matches_float64(rng, L, kind, offset, strided):
    # GQA 4 with 2 KV heads: rows = 4 L, so L=2 and 7 fit one row tile and split
    # the keys (decode / speculative decoding), L=32 fills 2 tiles exactly, L=33
    # gives ragged tiles and L=300 many tiles over all keys. offset 941 puts the
    # queries at the end of a cache of 941 earlier tokens.
    N = L + offset
    q, k, v = make_inputs(rng, B=1, Hq=8, Hkv=2, L=L, N=N, D=64, strided=strided)
    run_and_check(q, k, v, make_mask(kind, L, N))


# L = 2048: a few cases with small heads, so the oracle's full [L, N] float64
# score matrix per head stays cheap.
@pytest.mark.parametrize(
    "kind,offset,strided,dtype",
    [
        ("causal", 0, False, "f32"),
        ("causal", 300, True, "bf16"),
        ("none", 0, True, "f32"),
        ("window", 300, True, "f32"),
        ("bidir", 0, False, "f32"),
        ("bidir_window", 300, True, "bf16"),
    ],
)
def test_prefill_2048_matches_float64(rng, kind, offset, strided, dtype):
    L = 2048
    N = L + offset
    dt = {"f32": mx.float32, "bf16": mx.bfloat16}[dtype]
    q, k, v = make_inputs(
        rng, B=1, Hq=4, Hkv=2, L=L, N=N, D=64, strided=strided, q_dtype=dt, kv_dtype=dt
    )
    run_and_check(q, k, v, make_mask(kind, L, N))


@pytest.mark.parametrize("L,offset", [(33, 941), (300, 0), (2048, 300)])
def test_causal_string_matches_causal_bool(rng, L, offset):
    # The built-in causal mode stops each row tile at its causal limit; the bool
    # array reads every chunk and masks per key. Same attention either way.
    N = L + offset
    q, k, v = make_inputs(rng, B=1, Hq=4, Hkv=2, L=L, N=N, D=64, strided=True)
    scale = 64**-0.5
    a = mlxq.sdpa(q, k, v, scale=scale, mask="causal")
    b = mlxq.sdpa(q, k, v, scale=scale, mask=mx.array(bool_mask("causal_bool", L, N)))
    np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-6)


def test_prefill_batch_and_per_head_window(rng):
    # Batch 2 with a [B, Hq, L, N] mask: a different window per query head.
    B, Hq, Hkv, L, N = 2, 8, 2, 70, 400
    q, k, v = make_inputs(rng, B=B, Hq=Hq, Hkv=Hkv, L=L, N=N, D=128, strided=True)
    qpos = np.arange(N - L, N)[:, None]
    kpos = np.arange(N)[None, :]
    windows = np.array([8, 16, 32, 64, 100, 200, 300, 400])
    m = (kpos <= qpos)[None, None] & ((qpos - kpos)[None, None] < windows[None, :, None, None])
    mask = mx.array(np.broadcast_to(m, (B, Hq, L, N)).copy())
    run_and_check(q, k, v, mask)


# --- half precision, many rows (CUDA: the tensor-core tiled kernel) ----------------------

# Every (head dim, group size) the tiled kernel has an instance for, each with
# both query dtypes; bits cycle so that every width meets several shapes.
TILED_SHAPES = [
    (64, 32),
    (64, 64),
    (128, 32),
    (128, 64),
    (128, 128),
    (256, 32),
    (256, 64),
    (256, 128),
    (512, 32),
    (512, 64),
    (512, 128),
]
# (B, Hq, Hkv, L, offset, mask): ragged row tiles (rows = Hq / Hkv * L), GQA 1
# to 8, key splits (few rows over many keys, with and without causal),
# offsets, bool and additive masks.
TILED_ROWS = [
    (1, 8, 2, 40, 0, "causal"),
    (2, 4, 4, 20, 77, None),
    (1, 8, 1, 5, 3000, None),
    (1, 6, 2, 33, 100, "window"),
    (1, 8, 2, 70, 5, "additive"),
    (1, 16, 2, 9, 1200, "causal"),
]
TILED_CASES = [
    (
        D,
        gs,
        [2, 3, 4, 5, 6, 8][(2 * i + j) % 6],
        q_dtype,
        *TILED_ROWS[(i + 3 * j) % len(TILED_ROWS)],
        (i + j) % 2 == 1,
        (i + j) % 3 == 0,
        ["bf16", "f16", "f32"][(i + 2 * j) % 3],
    )
    for i, (D, gs) in enumerate(TILED_SHAPES)
    for j, q_dtype in enumerate(["bf16", "f16"])
] + [
    # An array mask over split keys, and batches of strided views.
    (128, 64, 4, "bf16", 2, 8, 1, 5, 2500, "window", True, True, "bf16"),
    # Head dims 256 / 512 with at least 256 rows per KV head: on CUDA the tiled
    # kernel over a dense copy of K/V (causal, window, none; sinks; views;
    # f32 scales with bf16 queries; a batch).
    (256, 64, 4, "bf16", 1, 8, 1, 40, 100, "causal", True, True, "bf16"),
    (256, 32, 3, "f16", 2, 8, 2, 70, 0, "window", False, False, "f16"),
    (512, 32, 8, "f16", 1, 8, 1, 33, 500, "window", False, True, "f16"),
    (512, 128, 5, "bf16", 2, 8, 2, 70, 30, None, True, False, "f32"),
    (512, 64, 4, "bf16", 1, 8, 1, 300, 2000, "causal", False, True, "bf16"),
    (64, 32, 8, "f16", 2, 4, 2, 30, 50, "additive", False, True, "f32"),
]


def many_row_inputs(rng, strided, *, N, **shape):
    """random_inputs over N keys; with ``strided``, K/V are prefix views of a
    larger buffer whose rows past N are NaN garbage."""
    if not strided:
        return random_inputs(rng, N=N, **shape)
    q, k, v = random_inputs(rng, N=capacity_for(N), **shape)
    return q, prefix_view(poison_rows(k, N), N), prefix_view(poison_rows(v, N), N)


def additive_mask(rng, L, N, dtype):
    """Causal window as an additive mask: random finite biases where visible."""
    vis = bool_mask("window", L, N)
    bias = rng.normal(0.0, 0.5, vis.shape).astype(np.float32)
    return mx.array(np.where(vis, bias, -np.inf)).astype(dtype)


@pytest.fixture(autouse=True)
def kernels_only():
    """These tests check mlxq's own kernels: on a GPU, many-row attention would
    otherwise go to MLX's fused attention (tests/ops/test_routing.py checks that)."""
    old = routing.set_dequantized_prefill(False)
    yield
    routing.set_dequantized_prefill(old)


@pytest.mark.parametrize(
    "D,group_size,bits,q_dtype,B,Hq,Hkv,L,offset,mask,with_sinks,strided,kv_dtype", TILED_CASES
)
def test_half_precision_many_rows(
    rng, D, group_size, bits, q_dtype, B, Hq, Hkv, L, offset, mask, with_sinks, strided, kv_dtype
):
    N = L + offset
    qd, kd = DTYPES[q_dtype], DTYPES[kv_dtype]
    shape = dict(B=B, Hq=Hq, Hkv=Hkv, L=L, N=N, Dk=D, bits=bits, group_size=group_size)
    q, k, v = many_row_inputs(rng, strided, q_dtype=qd, kv_dtype=kd, **shape)
    if mask == "window":
        mask = mx.array(bool_mask("window", L, N))
    elif mask == "additive":
        mask = additive_mask(rng, L, N, qd)
    sinks = mx.array(rng.normal(0.5, 1.5, Hq).astype(np.float32)) if with_sinks else None
    scale = D**-0.5
    mlxq._ext._take_last_sdpa_kernel()
    out = mlxq.sdpa(q, k, v, scale=scale, mask=mask, sinks=sinks)
    ref = sdpa64(q, k, v, scale=scale, mask=mask, sinks=sinks, group_size=group_size, bits=bits)
    assert_close(out, ref, dtype=qd)
    # Every case here is more than 16 rows per KV head in half precision:
    # on CUDA, the tensor-core tiled kernel. Up to head dim 256 an instance
    # fits 99 KB of shared memory per block (at 256 the 2-row-warp block,
    # ~77 KB); 512 needs ~153 KB, which sm_90 and sm_100 GPUs (H100/H200,
    # B200) have.
    big_smem = mx.device_info().get("compute_capability_major", 0) in (9, 10)
    dense = D >= 256 and Hq // Hkv * L >= 256 and big_smem  # kDenseMinRows
    assert_cuda_kernel(
        "cuda_tiled_dense" if dense else "cuda_tiled" if D <= 256 or big_smem else None
    )


# Head dims 256 / 512, at least 256 rows per KV head over at least 4096 keys
# (kGemmMinKeys): on CUDA, cuBLAS GEMMs over blocks of keys of a dense K/V
# copy, folded by an online softmax (Family::Gemm). Blocks are 2^26 score
# elements over the rows, at most 4096 keys (4096 here), so these cover one
# block, several, and a ragged last block (of 1 key in the last case); causal and none; sinks; batches of
# several KV heads (batched GEMMs); strided queries (gathered first) and
# prefix views of a larger cache buffer.
GEMM_CASES = [
    # D, group, bits, q dtype, B, Hq, Hkv, L, N, mask, sinks, strided K/V, strided q
    (512, 64, 4, "bf16", 1, 8, 1, 256, 4096, "causal", False, False, False),
    (512, 64, 4, "bf16", 1, 8, 1, 64, 9000, "causal", True, True, True),
    (512, 32, 8, "f16", 1, 8, 1, 2048, 4500, "causal", False, False, True),
    (256, 64, 4, "f16", 2, 8, 2, 128, 5000, None, True, True, False),
    (256, 128, 3, "bf16", 1, 16, 2, 32, 8300, "causal", False, False, True),
    (512, 64, 6, "bf16", 2, 4, 1, 100, 4097, None, False, True, True),
    # A prefill's last chunk: 8 x 301 rows, so the scratch's parts after the
    # scores start at odd multiples of 32 bytes unless aligned.
    (512, 64, 4, "bf16", 1, 8, 1, 301, 6000, "causal", False, False, True),
    (256, 64, 4, "f16", 1, 8, 1, 37, 4100, "causal", True, False, True),
]


def transposed_view(q):
    """The same values as a [B, H, L, D] view of a [B, L, H, D] buffer, as
    mlx-lm's attention layers pass queries."""
    return mx.contiguous(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)


@pytest.mark.parametrize(
    "D,group_size,bits,q_dtype,B,Hq,Hkv,L,N,mask,with_sinks,strided,strided_q", GEMM_CASES
)
def test_wide_heads_over_many_keys(
    rng, D, group_size, bits, q_dtype, B, Hq, Hkv, L, N, mask, with_sinks, strided, strided_q
):
    if not on_cuda_gpu():
        pytest.skip("the GEMM family is CUDA's; other backends' kernels are tested above")
    qd = DTYPES[q_dtype]
    shape = dict(B=B, Hq=Hq, Hkv=Hkv, L=L, N=N, Dk=D, bits=bits, group_size=group_size)
    q, k, v = many_row_inputs(rng, strided, q_dtype=qd, kv_dtype=qd, **shape)
    if strided_q:
        q = transposed_view(q)
    sinks = mx.array(rng.normal(0.5, 1.5, Hq).astype(np.float32)) if with_sinks else None
    scale = D**-0.5
    mlxq._ext._take_last_sdpa_kernel()
    out = mlxq.sdpa(q, k, v, scale=scale, mask=mask, sinks=sinks)
    ref = sdpa64(q, k, v, scale=scale, mask=mask, sinks=sinks, group_size=group_size, bits=bits)
    assert_close(out, ref, dtype=qd)
    assert_cuda_kernel("cuda_gemm")


# --- hidden keys are not read -----------------------------------------------------------


@pytest.mark.parametrize("mask_kind", ["causal", "causal_bool"])
@pytest.mark.parametrize(
    "L,offset,q_dtype",
    [(300, 0, "f32"), (300, 700, "f32"), (2048, 0, "f32"), (300, 0, "bf16"), (300, 700, "f16")],
)
def test_causal_result_ignores_hidden_keys(rng, L, offset, q_dtype, mask_kind):
    """A causal call's result does not depend on the K/V rows the mask hides.

    K/V are views of a buffer whose rows past N are NaN garbage (never part of
    the view), and whose rows in [P, N) are also made NaN garbage after a clean
    run. Query l sees keys <= offset + l, so queries l < P - offset never see
    them; those whose whole row tile (at most 128 rows: 32 queries at GQA 4)
    stays below P must come out finite and bit-identical to the clean run.

    With "causal" a row tile stops at its last row's limit, so those rows are
    not even read. The bool mask reads them but masks every score it hides to
    -inf (an assignment, so a NaN score does not survive) and never unpacks a
    value row that no row of the tile weights: the result is unaffected too.
    That "causal" skips the reads is checked by timing, below.
    """
    N = L + offset
    Hq, Hkv, D = 8, 2, 64
    q, kbuf, vbuf = random_inputs(
        rng,
        Hq=Hq,
        Hkv=Hkv,
        L=L,
        N=capacity_for(N),
        Dk=D,
        bits=BITS,
        group_size=GROUP_SIZE,
        q_dtype=DTYPES[q_dtype],
        kv_dtype=mx.bfloat16,
    )
    kbuf, vbuf = poison_rows(kbuf, N), poison_rows(vbuf, N)
    mask = make_mask(mask_kind, L, N)
    scale = D**-0.5
    clean = mlxq.sdpa(q, prefix_view(kbuf, N), prefix_view(vbuf, N), scale=scale, mask=mask)
    ref = sdpa64(
        q,
        prefix_view(kbuf, N),
        prefix_view(vbuf, N),
        scale=scale,
        mask=mask,
        group_size=GROUP_SIZE,
        bits=BITS,
    )
    clean = np.array(clean.astype(mx.float32))
    assert_close(mx.array(clean).astype(q.dtype), ref)

    P = offset + L // 2  # first poisoned key
    k = prefix_view(poison_rows(kbuf, P), N)
    v = prefix_view(poison_rows(vbuf, P), N)
    got = np.array(mlxq.sdpa(q, k, v, scale=scale, mask=mask).astype(mx.float32))
    safe = P - offset - 32  # queries whose row tile (<= 32 queries) lies wholly before key P
    assert safe > 0
    assert np.isfinite(got[:, :, :safe]).all(), "a hidden key reached the output"
    assert np.array_equal(got[:, :, :safe], clean[:, :, :safe])
    # Sanity: the queries that do see the poisoned keys turn NaN, so the
    # garbage is garbage and the check above has teeth.
    assert np.isnan(got[:, :, P - offset :]).all()


def test_causal_skips_hidden_chunks(rng, device):
    """Causal attention over L = N costs about half of unmasked attention.

    Each row tile stops at its causal limit, so about half of the K/V chunks
    are never read (measured: 0.52x of the unmasked time; a bool causal mask,
    which reads every key chunk and skips only the value rows, 0.89x). Bound
    0.75x, the fastest of 5 alternating runs each, so a loaded machine (the
    test runner's other workers) does not flake it.
    """
    import time

    if device == mx.gpu:
        # ~0.1 ms of kernel on an H200, under the per-call overhead (4-5 ms
        # with 12 test processes sharing it): the times say nothing there.
        # The poisoned-key test above checks every device.
        pytest.skip("the kernel time is below the per-call overhead on a GPU")

    L, D = 2048, 128
    q, k, v = random_inputs(
        rng, Hq=8, Hkv=2, L=L, N=L, Dk=D, bits=BITS, group_size=GROUP_SIZE, kv_dtype=mx.bfloat16
    )

    def once(mask):
        t0 = time.perf_counter()
        mx.eval(mlxq.sdpa(q, k, v, scale=D**-0.5, mask=mask))
        return time.perf_counter() - t0

    once(None)  # warm-up
    times = {None: [], "causal": []}
    for _ in range(5):  # alternating: a load that comes and goes hits both
        for mask, runs in times.items():
            runs.append(once(mask))
    full, causal = min(times[None]), min(times["causal"])
    assert causal <= 0.75 * full, f"causal {causal * 1e3:.0f} ms vs unmasked {full * 1e3:.0f} ms"


# --- peak memory --------------------------------------------------------------------------


def _rss_tracking():
    """(reset, current, peak) for this process's resident memory, or None where
    /proc/self/clear_refs cannot reset the high-water mark (not Linux, no access)."""

    def field(name):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(name + ":"):
                    return int(line.split()[1]) * 1024
        raise KeyError(name)

    def reset():
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS

    try:
        reset()
        field("VmHWM")
    except (OSError, KeyError):
        return None
    return reset, lambda: field("VmRSS"), lambda: field("VmHWM")


def test_prefill_peak_memory_is_bounded(rng):
    """L = N = 4096, Hq=8, Hkv=2, D=128, 4-bit, causal: nothing like [L, N] is stored.

    The composition (mlx-lm's two quantized_matmuls) materialises the scores,
    L * N * 4 bytes per query head in f32 = 64 MiB per head, 512 MiB for the 8
    heads here (and softmax / mask temporaries of the same size on top). mlxq
    allocates the output (16 MiB in f32) and, outside MLX's allocator,
    per-thread scratch of one row tile and one 32-key chunk (~100 KiB).
    """
    B, Hq, Hkv, L, D = 1, 8, 2, 4096, 128
    q, k, v = random_inputs(
        rng,
        B=B,
        Hq=Hq,
        Hkv=Hkv,
        L=L,
        N=L,
        Dk=D,
        bits=BITS,
        group_size=GROUP_SIZE,
        kv_dtype=mx.bfloat16,
    )
    scale = D**-0.5
    # Warm up on a small problem: the worker pool and its stacks exist before
    # the measurement (the big call's own output is still counted).
    mx.eval(mlxq.sdpa(q[:, :, :64], k, v, scale=scale, mask="causal"))
    out_bytes = B * Hq * L * D * 4
    score_bytes = Hq * L * L * 4
    bound = out_bytes + 8 * MiB

    rss = _rss_tracking()
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    if rss:
        rss[0]()
        rss_before = rss[1]()
    out = mlxq.sdpa(q, k, v, scale=scale, mask="causal")
    mx.eval(out)
    extra = mx.get_peak_memory() - before
    rss_extra = rss[2]() - rss_before if rss else None
    print(
        f"peak memory: MLX +{extra / MiB:.2f} MiB, RSS +{(rss_extra or 0) / MiB:.2f} MiB, "
        f"output {out_bytes / MiB:.0f} MiB, score matrix {score_bytes / MiB:.0f} MiB"
    )

    assert extra <= bound, (
        f"MLX peak grew by {extra / MiB:.1f} MiB; bound {bound / MiB:.1f} MiB "
        f"(output {out_bytes / MiB:.0f} MiB; the score matrix alone is "
        f"{score_bytes / MiB:.0f} MiB)"
    )
    # MLX's counter does not see memory the kernel mallocs itself (its scratch).
    # New resident pages do: a freed-and-reused heap can hide a small buffer,
    # but not one anywhere near the size of the score matrix.
    if rss_extra is not None:
        assert rss_extra <= bound, (
            f"resident memory grew by {rss_extra / MiB:.1f} MiB; bound {bound / MiB:.1f} MiB"
        )
    assert score_bytes >= 16 * bound  # the bound is far below what the composition needs
    got = np.array(out[:, :, :: L // 16])
    assert np.isfinite(got).all()
