"""dequantize_into and the routed prefill's reused dense K/V buffers.

The primitive is checked against a float64 dequantization on every device
(with poisoned outputs, strided cache views, every bit width and group size),
its ordering against earlier readers inside one evaluation, and, on a CUDA
GPU, that routed layers write one buffer so their transient memory does not
grow with the number of layers evaluated together.
"""

import mlx.core as mx
import numpy as np
import pytest
from support.helpers import on_cuda_gpu, random_inputs, to_f64

import mlxq
from mlxq import _ext, routing, workspace

BF16, F16, F32 = mx.bfloat16, mx.float16, mx.float32
ULP = {BF16: 2.0**-7, F16: 2.0**-10, F32: 2.0**-23}


def dequantize64(packed, scales, biases, group_size, bits):
    """scale * code + bias in float64 (codes read from the bit stream)."""
    words = np.array(packed).astype(np.uint64)
    B, H, N, W = words.shape
    D = W * 32 // bits
    bitpos = np.arange(D) * bits
    lo = words[..., bitpos // 32] >> (bitpos % 32).astype(np.uint64)
    nxt = np.minimum(bitpos // 32 + 1, W - 1)
    hi = words[..., nxt] << (32 - bitpos % 32).astype(np.uint64)
    straddle = (bitpos % 32) + bits > 32
    codes = (np.where(straddle, lo | hi, lo) & ((1 << bits) - 1)).astype(np.float64)
    s = np.repeat(to_f64(scales), group_size, axis=-1)
    z = np.repeat(to_f64(biases), group_size, axis=-1)
    return s * codes + z


def assert_rounded(out: mx.array, ref: np.ndarray):
    """Within half an ulp of the output dtype (one rounding of the f32 value),
    plus f32's own rounding."""
    got = to_f64(out)
    assert np.isfinite(got).all(), "unwritten (poisoned) elements"
    mag = np.maximum(np.abs(ref), 2.0**-14)
    bound = mag * (0.5 * ULP[out.dtype] * 2 + 2.0**-22)
    assert (np.abs(got - ref) <= bound).all(), float(np.max(np.abs(got - ref) / mag))


def cache_view(rng, B, H, N, D, cap, group_size, bits, dtype):
    """Rows [0, N) of a quantized cache buffer of `cap` rows: strided views."""
    x = mx.array(rng.standard_normal((B, H, cap, D)).astype(np.float32)).astype(dtype)
    triple = mx.quantize(x, group_size=group_size, bits=bits)
    mx.eval(*triple)
    return tuple(t[:, :, :N] for t in triple)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("out_dtype,scales_dtype", [(BF16, BF16), (F16, F16), (F32, BF16)])
def test_matches_float64(rng, bits, group_size, out_dtype, scales_dtype):
    N = int(rng.integers(1, 70))
    packed, scales, biases = cache_view(rng, 2, 3, N, 128, N + 13, group_size, bits, scales_dtype)
    buf = mx.zeros((2 * 3 * (N + 5) * 128,), dtype=out_dtype)
    mx.eval(buf)
    out = _ext.dequantize_into(buf, packed, scales, biases, group_size=group_size, bits=bits)
    mx.eval(out)
    assert out.shape == (2, 3, N, 128) and out.dtype == out_dtype
    assert _ext._take_workspace_misses() == 0
    assert_rounded(out, dequantize64(packed, scales, biases, group_size, bits))
    # The output is the workspace's memory.
    assert np.array_equal(
        np.array(buf[: out.size].astype(F32)), np.array(out.reshape(-1).astype(F32))
    )


def test_a_workspace_it_cannot_use_gives_a_fresh_buffer(rng):
    packed, scales, biases = cache_view(rng, 1, 2, 10, 64, 10, 64, 4, BF16)
    big = mx.zeros((4 * 2 * 10 * 64,), dtype=BF16)
    strided = big[::2]  # large enough, but not contiguous
    mx.eval(strided)
    out = _ext.dequantize_into(strided, packed, scales, biases, group_size=64, bits=4)
    mx.eval(out)
    assert _ext._take_workspace_misses() == 1
    assert_rounded(out, dequantize64(packed, scales, biases, 64, 4))


def test_a_write_waits_for_the_readers_it_is_given(rng):
    # Both reads and both writes in one evaluation: the second write must not
    # overwrite the buffer before the first reader ran (on CUDA, graph nodes
    # wait only for earlier writers, so `after` is the ordering).
    a = cache_view(rng, 1, 4, 300, 128, 300, 64, 4, BF16)
    b = cache_view(rng, 1, 4, 300, 128, 300, 64, 4, BF16)
    buf = mx.zeros((4 * 300 * 128,), dtype=BF16)
    mx.eval(buf)
    ya = _ext.dequantize_into(buf, *a, group_size=64, bits=4)
    ra = (ya.astype(F32) * 2.0).sum(axis=-1)
    yb = _ext.dequantize_into(buf, *b, group_size=64, bits=4, after=[ra])
    rb = (yb.astype(F32) * 2.0).sum(axis=-1)
    mx.eval(ra, rb)
    for r, t in ((ra, a), (rb, b)):
        rounded = to_f64(mx.array(dequantize64(*t, 64, 4).astype(np.float32)).astype(BF16))
        assert np.allclose(to_f64(r), 2.0 * rounded.sum(axis=-1), rtol=1e-4, atol=1e-3)


def test_bad_input_raises_value_error(rng):
    packed, scales, biases = cache_view(rng, 1, 2, 8, 64, 8, 64, 4, BF16)
    buf = mx.zeros((2 * 8 * 64,), dtype=BF16)

    def call(ws=buf, p=packed, s=scales, b=biases, group_size=64, bits=4):
        return _ext.dequantize_into(ws, p, s, b, group_size=group_size, bits=bits)

    with pytest.raises(ValueError, match="bits must be one of"):
        call(bits=7)
    with pytest.raises(ValueError, match="group_size must be one of"):
        call(group_size=48)
    with pytest.raises(ValueError, match="workspace must be a 1-D float"):
        call(ws=buf.reshape(2, -1))
    with pytest.raises(ValueError, match="workspace must be a 1-D float"):
        call(ws=mx.zeros((2 * 8 * 64,), dtype=mx.int32))
    with pytest.raises(ValueError, match="workspace holds 1023 elements"):
        call(ws=buf[:1023])
    with pytest.raises(ValueError, match="packed must be uint32"):
        call(p=packed.astype(mx.int32))
    with pytest.raises(ValueError, match="must be 4-D"):
        call(p=packed[0])
    with pytest.raises(ValueError, match="share one float dtype"):
        call(b=biases.astype(F32))
    with pytest.raises(ValueError, match="does not match biases shape"):
        call(b=biases[:, :, :4])
    with pytest.raises(ValueError, match="disagree on"):
        call(p=packed[:, :, :4])
    with pytest.raises(ValueError, match="do not describe 8-bit codes"):
        call(bits=8)


def test_buffers_grow_and_are_released_at_decode(rng, device):
    workspace.release_all()
    k = cache_view(rng, 1, 2, 40, 64, 40, 64, 4, BF16)
    v = cache_view(rng, 1, 2, 40, 64, 40, 64, 4, BF16)
    dk, dv = workspace.dequantize_kv(k, v, group_size=64, bits=4, dtype=BF16, stream=None)
    workspace.note_reader(None, dk)
    held = workspace.held_bytes()
    assert held == 2 * (2 * 40 * 64 * 2)
    k2 = cache_view(rng, 1, 2, 50, 64, 50, 64, 4, BF16)
    v2 = cache_view(rng, 1, 2, 50, 64, 50, 64, 4, BF16)
    dk2, dv2 = workspace.dequantize_kv(k2, v2, group_size=64, bits=4, dtype=BF16, stream=None)
    mx.eval(dk2, dv2)
    assert workspace.held_bytes() == 2 * held  # both doubled (at least the new need)
    assert_rounded(dk2, dequantize64(*k2, 64, 4))
    assert_rounded(dv2, dequantize64(*v2, 64, 4))
    other = mx.new_stream(mx.default_device())
    workspace.dequantize_kv(k, v, group_size=64, bits=4, dtype=BF16, stream=other)
    q = mx.random.normal((1, 4, 1, 64)).astype(BF16)
    mx.eval(mlxq.sdpa(q, k2, v2, scale=0.125))  # a decode step on the default stream
    assert workspace.held_bytes() == workspace.held_bytes(other) == held  # only its own went
    workspace.release(other)
    assert workspace.held_bytes() == 0


def test_routed_layers_share_one_buffer(rng):
    """On CUDA, layers evaluated together reuse one dense K/V buffer: the peak
    of 12 routed 16k-key layers stays within a few layers' worth."""
    if not on_cuda_gpu():
        pytest.skip("the route and its workspace run on CUDA only")
    layers, N = 12, 16384
    caches = [
        random_inputs(rng, Hq=32, Hkv=8, L=1, N=N, q_dtype=BF16, kv_dtype=BF16)[1:]
        for _ in range(layers)
    ]
    q = mx.random.normal((1, 32, 64, 128)).astype(BF16)
    mx.eval(q)
    per_layer = 2 * 8 * N * 128 * 2  # dense K and V, bytes

    def run():
        h = q
        for k, v in caches:
            h = mlxq.sdpa(h, k, v, scale=128**-0.5, mask="causal")
        return h

    peaks = {}
    for reuse in (True, False):
        old = routing.set_prefill_workspace(reuse)
        try:
            workspace.release_all()
            mx.eval(run())
            mx.synchronize()
            routing.take_route_counts()
            mx.reset_peak_memory()
            base = mx.get_active_memory()
            out = run()
            mx.eval(out)
            mx.synchronize()
            peaks[reuse] = mx.get_peak_memory() - base
            assert routing.take_route_counts().get("mx_fast") == layers
        finally:
            routing.set_prefill_workspace(old)
    workspace.release_all()
    assert peaks[True] <= 3 * per_layer, peaks
