"""The emulator itself: shim (<metal_stdlib>), runtime and mslpp.

A shim bug looks exactly like a kernel bug, so the emulator has its own
tests: the prototype's sample kernels (reductions, softmax, scans, quad
groups, function constants, vector types) checked against NumPy, its
deliberately buggy kernels (each must be flagged), and checks of the pieces
mlxq's kernels rely on (rounding modes, sub-word threadgroup reads, 64-bit
shifts, SIMD votes with infinities). Every test runs under the default,
reverse and random schedules (the ``samples`` fixture).
"""

import numpy as np
import pytest
from emu import Emulator, build


def to_bf16_bits(x):
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return r.astype(np.uint16)


def from_bf16_bits(b):
    return (b.astype(np.uint32) << 16).view(np.float32)


DTYPES = {"float32": (np.float32, 1e-5), "float16": (np.float16, 2e-3), "bfloat16": ("bf16", 2e-2)}


def make(x, dt):
    return to_bf16_bits(x) if dt == "bf16" else x.astype(dt)


def back(a, dt):
    return from_bf16_bits(a) if dt == "bf16" else a.astype(np.float32)


@pytest.mark.parametrize("tname", list(DTYPES))
def test_row_sum(samples, tname):
    dt, tol = DTYPES[tname]
    rows, n = 37, 1000
    x = np.random.default_rng(0).standard_normal((rows, n)).astype(np.float32)
    xin = make(x, dt)
    out = np.zeros(rows, np.float32)
    ok, diag = samples.dispatch(f"row_sum_{tname}", [xin, out, np.uint32(n)], (rows,), (256,))
    assert ok, diag
    ref = back(xin, dt).astype(np.float64).sum(axis=1)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("tname", list(DTYPES))
def test_rms_norm(samples, tname):
    dt, tol = DTYPES[tname]
    rows, n, eps = 16, 1000, 1e-5
    rng = np.random.default_rng(1)
    x, w = (
        rng.standard_normal((rows, n)).astype(np.float32),
        rng.standard_normal(n).astype(np.float32),
    )
    xin, win = make(x, dt), make(w, dt)
    out = np.zeros_like(xin)
    ok, diag = samples.dispatch(
        f"rms_norm_{tname}", [xin, win, out, np.float32(eps), np.uint32(n)], (rows,), (128,)
    )
    assert ok, diag
    xf, wf = back(xin, dt), back(win, dt)
    ref = xf / np.sqrt((xf.astype(np.float64) ** 2).mean(axis=1, keepdims=True) + eps) * wf
    np.testing.assert_allclose(back(out, dt), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("tname", list(DTYPES))
def test_softmax(samples, tname):
    dt, tol = DTYPES[tname]
    rows, n = 8, 999
    x = (np.random.default_rng(2).standard_normal((rows, n)) * 4).astype(np.float32)
    xin = make(x, dt)
    out = np.zeros_like(xin)
    ok, diag = samples.dispatch(f"softmax_looped_{tname}", [xin, out, np.int32(n)], (rows,), (256,))
    assert ok, diag
    xf = back(xin, dt).astype(np.float64)
    e = np.exp(xf - xf.max(axis=1, keepdims=True))
    np.testing.assert_allclose(
        back(out, dt), e / e.sum(axis=1, keepdims=True), rtol=tol, atol=tol * 1e-2
    )


def test_block_scan_dynamic_tg_memory(samples):
    n, tg = 10_000, 256
    x = np.random.default_rng(3).integers(-5, 6, n).astype(np.int32)
    out = np.zeros(n, np.int32)
    ngroups = (n + tg - 1) // tg
    sums = np.zeros(ngroups, np.int32)
    ok, diag = samples.dispatch(
        "block_scan", [x, out, sums, np.uint32(n)], (ngroups,), (tg,), tg_mem=(32 * 4,)
    )
    assert ok, diag
    pad = np.zeros(ngroups * tg, np.int32)
    pad[:n] = x
    ref = np.cumsum(pad.reshape(ngroups, tg), axis=1)
    np.testing.assert_array_equal(out, ref.reshape(-1)[:n])
    np.testing.assert_array_equal(sums, ref[:, -1])


def test_compact_positive_atomics(samples):
    n = 5000
    x = np.random.default_rng(4).standard_normal(n).astype(np.float32)
    out = np.zeros(n, np.float32)
    count = np.zeros(1, np.uint32)
    ok, diag = samples.dispatch(
        "compact_positive", [x, out, count, np.uint32(n)], (n,), (128,), threads=True
    )
    assert ok, diag
    k = int(count[0])
    assert k == int((x > 0).sum())
    np.testing.assert_array_equal(np.sort(out[:k]), np.sort(x[x > 0]))


def test_xor_allreduce_matches_simd_sum(samples):
    x = np.random.default_rng(5).standard_normal(64 * 32).astype(np.float32)
    out = np.zeros((x.size, 2), np.float32)
    ok, diag = samples.dispatch("xor_allreduce", [x, out], (64,), (32,))
    assert ok, diag
    # simd_sum is emulated as the same xor-butterfly -> bit-identical
    np.testing.assert_array_equal(out[:, 0], out[:, 1])
    np.testing.assert_allclose(out[::32, 1], x.reshape(-1, 32).sum(axis=1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("use_bias", [False, True])
def test_gelu_vectors_function_constants_dispatch_threads(samples, use_bias):
    n4, width = 1000, 37  # 2-D grid 37 x 28 with non-uniform edge threadgroups
    height = (n4 + width - 1) // width
    rng = np.random.default_rng(6)
    x, b = (
        rng.standard_normal((n4, 4)).astype(np.float32),
        rng.standard_normal((n4, 4)).astype(np.float32),
    )
    y = np.zeros((n4, 4), np.float16)
    samples.clear_function_constants()
    samples.set_function_constant(0, np.bool_(use_bias))
    samples.set_function_constant(1, np.float32(0.5))
    ok, diag = samples.dispatch(
        "gelu_bias_f4", [x, b, y, np.uint32(n4)], (width, height), (8, 8), threads=True
    )
    assert ok, diag
    v = x * 0.5 + (b if use_bias else 0)
    ref = 0.5 * v * (1 + np.tanh(0.7978845608 * (v + 0.044715 * v**3)))
    np.testing.assert_allclose(y.astype(np.float32), ref, rtol=2e-3, atol=2e-3)


def test_bits_and_bf16_rounding(samples):
    x = np.concatenate(
        [
            np.random.default_rng(7).standard_normal(1000).astype(np.float32) * 1e3,
            np.array([0.0, -0.0, np.inf, -np.inf, 1.00390625, 1.01171875, 65504, 7e4], np.float32),
        ]
    )
    bits = np.zeros(x.size, np.uint32)
    xb = np.zeros(x.size, np.uint16)
    rt = np.zeros(x.size, np.float32)
    ok, diag = samples.dispatch("bits_and_bf16", [x, bits, xb, rt], (x.size,), (64,), threads=True)
    assert ok, diag
    np.testing.assert_array_equal(bits, x.view(np.uint32))
    np.testing.assert_array_equal(xb, to_bf16_bits(x))


def _fc_affine(samples, x, bufs, has_bias, has_scale, tile=None):
    samples.clear_function_constants()
    samples.set_function_constant(10, np.bool_(has_bias))
    samples.set_function_constant(11, np.bool_(has_scale))
    if tile is not None:
        samples.set_function_constant(12, np.int32(tile))
    y = np.full_like(x, np.nan)
    ok, diag = samples.dispatch(
        "fc_affine", [x, y, np.uint32(x.size)] + bufs, (x.size,), (64,), threads=True
    )
    return ok, diag, y


def test_function_constant_gated_arguments(samples):
    x = np.random.default_rng(8).standard_normal(100).astype(np.float32)
    bias = np.arange(5, dtype=np.float32)
    # both arguments compiled out: nothing bound at 3 and 4
    ok, diag, y = _fc_affine(samples, x, [], False, False)
    assert ok, diag
    np.testing.assert_array_equal(y, x)
    # only `scale` exists: index 3 left unbound (None)
    ok, diag, y = _fc_affine(samples, x, [None, np.float32(3)], False, True)
    assert ok, diag
    np.testing.assert_array_equal(y, x * 3)
    ok, diag, y = _fc_affine(samples, x, [bias, np.float32(2)], True, True, tile=5)
    assert ok, diag
    np.testing.assert_allclose(y, x * 2 + bias[np.arange(x.size) % 5], rtol=1e-6)
    # enabled but not bound: an error that names the function constant
    ok, diag, y = _fc_affine(samples, x, [None, np.float32(2)], True, True, tile=5)
    assert not ok and "index 3" in diag and "has_bias" in diag, diag
    # `tile` is read (bias enabled) but was never set
    ok, diag, y = _fc_affine(samples, x, [bias, np.float32(2)], True, True)
    assert not ok and "'tile'" in diag, diag


def test_constants_derived_from_function_constants_follow_each_dispatch(samples):
    out = np.zeros(3, np.int32)
    for tile, ref in [(4, [16, 4, 1]), (9, [81, 6, 1]), (None, [-1, -1, 0])]:
        samples.clear_function_constants()
        samples.set_function_constant(10, np.bool_(tile is not None))
        samples.set_function_constant(11, np.bool_(False))
        if tile is not None:
            samples.set_function_constant(12, np.int32(tile))
        ok, diag = samples.dispatch("fc_derived", [out], (1,), (1,))
        assert ok, diag
        np.testing.assert_array_equal(out, ref)
    ok, diag = samples.dispatch("fc_derived_unguarded", [out], (1,), (1,))  # `tile` still unset
    assert not ok and "tile_sq" in diag, diag


def test_quad_group_functions(samples):
    n = 62  # dispatchThreads: the second threadgroup has 30 threads, its last quad only 2 lanes
    rng = np.random.default_rng(9)
    x = rng.standard_normal(64).astype(np.float32)
    u = rng.integers(0, 2**32, 64, dtype=np.uint64).astype(np.uint32)
    outf = np.full((n, 9), np.nan, np.float32)
    outu = np.zeros((n, 6), np.uint32)
    ok, diag = samples.dispatch("quad_ops", [x, u, outf, outu], (n,), (32,), threads=True)
    assert ok, diag
    np.testing.assert_array_equal(outf[:60, 0], outf[:60, 1])  # same butterfly as by hand
    for q0 in range(0, n, 4):
        lanes = np.arange(q0, min(q0 + 4, n))
        xv, uv = x[lanes], u[lanes]
        f, o = outf[lanes], outu[lanes]
        np.testing.assert_allclose(f[:, 0], xv.sum(), rtol=1e-6, atol=1e-6)
        assert (f[:, 2] == xv.max()).all() and (f[:, 3] == xv.min()).all()
        np.testing.assert_allclose(f[:, 4], np.cumsum(xv), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(f[:, 5], np.cumsum(xv) - xv, rtol=1e-6, atol=1e-6)
        assert (f[:, 6] == xv[0]).all()
        np.testing.assert_allclose(f[:, 8], xv.prod(), rtol=1e-6)
        if lanes.size == 4:
            np.testing.assert_array_equal(f[:, 7], np.roll(xv, -1))
        assert (o[:, 0] == np.bitwise_or.reduce(uv)).all() and (
            o[:, 1] == np.bitwise_and.reduce(uv)
        ).all()
        assert (o[:, 2] == np.bitwise_xor.reduce(uv)).all()
        assert (o[:, 3] == sum(1 << i for i in range(lanes.size) if xv[i] > 0)).all()
        assert (o[:, 4] == (1 << lanes.size) - 1).all()
        np.testing.assert_array_equal(
            o[:, 5],
            [1 | (2 if (xv > 0).any() else 0) | (4 if i == 0 else 0) for i in range(lanes.size)],
        )


@pytest.mark.parametrize("other", [0, 1, 2])
def test_simd_reductions_do_not_depend_on_schedule(samples, other):
    x = np.random.default_rng(10).standard_normal(64 * 256).astype(np.float32)
    ref = np.zeros((x.size, 2), np.float32)
    ok, diag = samples.dispatch("xor_allreduce", [x, ref], (64,), (256,))
    assert ok, diag
    out = np.zeros_like(ref)
    samples.set_option("schedule", other)
    ok, diag = samples.dispatch("xor_allreduce", [x, out], (64,), (256,))
    assert ok, diag
    np.testing.assert_array_equal(out, ref)


# ---------------------------------------------------------------- bug finding
def test_missing_barrier_is_caught(samples):
    x = np.arange(1024, dtype=np.float32)
    out = np.zeros_like(x)
    ok, diag = samples.dispatch("shift_left_missing_barrier", [x, out], (4,), (256,))
    ref = np.roll(x.reshape(4, 256), -1, axis=1).reshape(-1)
    # every thread reads its neighbour's slot before the neighbour has written it
    assert not np.array_equal(out, ref)
    assert np.isnan(out).any()  # threadgroup memory is poisoned with 0xFF (NaN) per threadgroup


def test_early_return_before_barrier_is_caught(samples):
    n = 1000
    x = np.ones(n, np.float32)
    out = np.zeros(n, np.float32)
    ok, diag = samples.dispatch("early_return_before_barrier", [x, out, np.uint32(n)], (4,), (256,))
    assert not ok and "threadgroup_barrier" in diag and "returned" in diag, diag


def test_uninitialised_threadgroup_memory_is_caught(samples):
    out = np.zeros(128, np.float32)
    ok, diag = samples.dispatch("uninitialised_tg_read", [out], (2,), (64,))
    assert np.isnan(out[32:64]).all() and (out[:32] == 1).all()


def test_shuffle_from_exited_lane_is_caught(samples):
    out = np.zeros(32, np.float32)
    ok, diag = samples.dispatch("shuffle_from_exited_lane", [out], (1,), (32,))
    assert not ok and "inactive" in diag, diag


def test_unknown_kernel_and_threadgroup_limit(samples):
    ok, diag = samples.dispatch("no_such_kernel", [], (1,), (1,))
    assert not ok and "no kernel" in diag
    out = np.zeros(2048, np.float32)
    ok, diag = samples.dispatch("uninitialised_tg_read", [out], (1,), (2048,))
    assert not ok and "exceeds 1024" in diag


# ---------------------------------------------------------------- mlxq's needs
def test_rounding_and_conversions(samples):
    x = np.array(
        [
            0.5,
            1.5,
            2.5,
            -0.5,
            -1.5,
            -2.5,
            0.49999997,
            2.4999998,
            3.5,
            -0.0,
            1e-8,
            254.5,
            255.5,
            7.0,
            -7.5,
            65519.0,
            1e-5,
            0.1,
            300.0,
            -1e30,
            1e30,
            np.inf,
            -np.inf,
            100.25,
        ],
        np.float32,
    )
    n = x.size
    out = np.full((n, 4), np.nan, np.float32)
    codes = np.zeros(n, np.uint8)
    h = np.zeros(n, np.float16)
    ok, diag = samples.dispatch("shim_rounding", [x, out, codes, h], (n,), (8,), threads=True)
    assert ok, diag
    away = np.sign(x) * np.floor(np.abs(x.astype(np.float64)) + 0.5)
    np.testing.assert_array_equal(out[:, 0], away.astype(np.float32))
    np.testing.assert_array_equal(out[:, 1], np.rint(x))
    small = np.abs(x) < 1e6  # x * 3 + 1 is exact in float64 there: one rounding, like fma
    np.testing.assert_array_equal(
        out[small, 2], (x[small].astype(np.float64) * 3 + 1).astype(np.float32)
    )
    np.testing.assert_array_equal(out[:, 3], x)
    np.testing.assert_array_equal(
        codes, np.minimum(np.floor(np.abs(x.astype(np.float64)) + 0.5), 255)
    )
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(h, x.astype(np.float16))


def test_subword_threadgroup_reads_and_64bit_shifts(samples):
    words = np.random.default_rng(11).integers(0, 2**32, 128, dtype=np.uint64).astype(np.uint32)
    out = np.zeros(64, np.uint32)
    ok, diag = samples.dispatch("shim_tg_bytes", [words, out], (1,), (32,))
    assert ok, diag
    lanes = np.arange(32)
    np.testing.assert_array_equal(out[:32], words.view(np.uint8)[(lanes * 5) % 512])
    pairs = words[4 * lanes].astype(np.uint64) | (
        words[4 * lanes + 1].astype(np.uint64) << np.uint64(32)
    )
    np.testing.assert_array_equal(
        out[32:], ((pairs >> lanes.astype(np.uint64)) & 0xFFFFFFFF).astype(np.uint32)
    )


@pytest.mark.parametrize("fc", [False, True])
def test_simd_votes_and_reductions_with_infinities(samples, fc):
    x = np.random.default_rng(12).random(32).astype(np.float32) * 0.5
    x[[3, 17]] = [-np.inf, np.inf]
    out = np.full((6, 32), np.nan, np.float32)
    samples.clear_function_constants()
    samples.set_function_constant(30, np.bool_(fc))
    ok, diag = samples.dispatch("shim_simd", [x, out], (1,), (32,))
    assert ok, diag
    assert (out[0] == 1).all() and (out[1] == -np.inf).all() and (out[2] == np.inf).all()
    np.testing.assert_array_equal(out[3], x[np.arange(32) ^ 3])
    assert np.isnan(out[4]).all()  # inf + -inf
    assert (out[5] == float(fc)).all()
    x[17] = 0.25
    ok, diag = samples.dispatch("shim_simd", [x, out], (1,), (32,))
    assert ok, diag
    assert (out[0] == 0).all() and (out[2] == x.max()).all()


def test_builds_are_cached_by_content(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXQ_EMU_CACHE", str(tmp_path))
    src = tmp_path / "one.metal"
    src.write_text("kernel void k(device float* o [[buffer(0)]]) { o[0] = 1.0; }\n")
    a = build([str(src)], include_dirs=[], name="t", opt="-O0")
    assert build([str(src)], include_dirs=[], name="t", opt="-O0") == a
    src.write_text("kernel void k(device float* o [[buffer(0)]]) { o[0] = 2.0; }\n")
    b = build([str(src)], include_dirs=[], name="t", opt="-O0")
    assert b != a
    # Two builds live side by side in one process without sharing a registry.
    out = np.zeros(1, np.float32)
    for d, want in ((a, 1.0), (b, 2.0)):
        ok, diag = Emulator(d).dispatch("k", [out], (1,), (1,))
        assert ok, diag
        assert out[0] == want
