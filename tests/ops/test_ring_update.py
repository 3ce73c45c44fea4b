"""RingUpdate and QuantizedRingUpdate: wrap-around writes, in place when the
buffer is donated, quantize-on-write bit-identical to mx.quantize."""

import mlx.core as mx
import numpy as np
import pytest

import mlxq

DTYPES = [mx.float32, mx.float16, mx.bfloat16]


def np_of(a: mx.array) -> np.ndarray:
    # bfloat16 has no NumPy dtype: compare its bit patterns.
    if a.dtype == mx.bfloat16:
        return np.array(a.view(mx.uint16))
    return np.array(a)


def ring_rows(S, pos, T):
    return [(pos + t) % S for t in range(T)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "S,T,pos", [(8, 1, 0), (8, 3, 6), (8, 8, 5), (5, 5, 0), (7, 2, 13), (16, 0, 3)]
)
def test_ring_update_matches_numpy(dtype, S, T, pos):
    B, H, D = 2, 3, 24
    buf = mx.random.normal((B, H, S, D)).astype(dtype)
    upd = mx.random.normal((B, H, T, D)).astype(dtype)
    expect = np_of(buf).copy()
    expect[:, :, ring_rows(S, pos, T)] = np_of(upd)
    for p in (pos, mx.array(pos, dtype=mx.int32), mx.array([pos])):
        out = mlxq.ring_update(buf, upd, p)
        np.testing.assert_array_equal(np_of(out), expect)


def test_ring_update_strided_inputs():
    # A transposed update ([B, T, H, D] projected keys) and a strided buffer
    # view are read through their strides.
    B, H, S, D, T = 1, 4, 10, 16, 3
    upd = mx.random.normal((B, T, H, D)).transpose(0, 2, 1, 3)
    big = mx.random.normal((B, H, S, 2 * D))
    buf = big[..., ::2]
    out = mlxq.ring_update(buf, upd, 9)
    expect = np.array(buf).copy()
    expect[:, :, ring_rows(S, 9, T)] = np.array(upd)
    np.testing.assert_array_equal(np.array(out), expect)


def test_ring_update_copy_leaves_caller_array_unchanged():
    buf = mx.zeros((1, 2, 6, 8))
    mx.eval(buf)
    before = np.array(buf)
    out = mlxq.ring_update(buf, mx.ones((1, 2, 2, 8)), 5)
    mx.eval(out)
    np.testing.assert_array_equal(np.array(buf), before)
    assert np.array(out)[0, 0, [5, 0]].min() == 1


def settle():
    """Waits until the GPU backend has dropped its references to the last step.

    MLX's GPU backends keep an evaluation's buffers alive until a completion
    handler runs (on CUDA, a worker thread, after mx.eval has returned). A write
    issued before that sees its buffer still referenced and must copy. In a
    decode step the rest of the forward pass runs in between; back-to-back
    writes, as here, wait for it.
    """
    mx.synchronize()


def test_ring_update_in_place_when_donated():
    # 64 MiB buffer: a copy per write would show up in the peak.
    B, H, S, D = 1, 8, 16384, 128
    buf = mx.zeros((B, H, S, D))
    mx.eval(buf)
    row = mx.ones((B, H, 1, D))
    mx.eval(row)
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    for i in range(4):
        buf = mlxq.ring_update(buf, row, i)
        mx.eval(buf)
        settle()
    assert mx.get_peak_memory() - base < 1 << 20
    assert np.array(buf[0, 0, :5, 0]).tolist() == [1, 1, 1, 1, 0]


def test_ring_update_compiled_step_does_not_retrace():
    traces = []

    def step(buf, row, pos):
        traces.append(1)
        return mlxq.ring_update(buf, row, pos)

    step_c = mx.compile(step)
    buf = mx.zeros((1, 2, 8, 4))
    for i in range(10):
        buf = step_c(buf, mx.full((1, 2, 1, 4), float(i + 1)), mx.array(i, dtype=mx.int32))
        mx.eval(buf)
    assert len(traces) == 1
    # Positions 8 and 9 wrapped onto rows 0 and 1.
    assert np.array(buf[0, 0, :, 0]).tolist() == [9, 10, 3, 4, 5, 6, 7, 8]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_quantized_ring_update_bit_identical_to_mx_quantize(dtype, bits, group_size):
    B, H, S, D, T, pos = 2, 2, 9, 256, 4, 7
    # Mixed scales, constant groups and exact zeros exercise every branch of
    # the scale/bias snapping.
    x = mx.random.normal((B, H, T, D)) * mx.array([0.01, 1.0, 50.0, 3.0])[:, None]
    x = x.astype(dtype)
    x[0, 0, 0, :group_size] = 0.0
    x[1, 1, 1, :group_size] = 2.5
    buf = mx.quantize(
        mx.random.normal((B, H, S, D)).astype(dtype), group_size=group_size, bits=bits
    )
    mx.eval(buf)
    before = [np_of(a).copy() for a in buf]
    out = mlxq.quantized_ring_update(buf, x, pos, group_size=group_size, bits=bits)
    ref = mx.quantize(x, group_size=group_size, bits=bits)
    rows = ring_rows(S, pos, T)
    others = [r for r in range(S) if r not in rows]
    for got, want, old in zip(out, ref, before):
        got = np_of(got)
        np.testing.assert_array_equal(got[:, :, rows], np_of(want))
        np.testing.assert_array_equal(got[:, :, others], old[:, :, others])


def test_quantized_ring_update_in_place_when_donated():
    B, H, S, D = 1, 8, 16384, 128
    buf = mx.quantize(mx.zeros((B, H, S, D)), group_size=64, bits=8)
    mx.eval(buf)
    row = mx.random.normal((B, H, 1, D))
    mx.eval(row)
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    for i in range(4):
        buf = mlxq.quantized_ring_update(buf, row, i, group_size=64, bits=8)
        mx.eval(buf)
        settle()
    assert mx.get_peak_memory() - base < 1 << 20
    ref = mx.quantize(row, group_size=64, bits=8)
    np.testing.assert_array_equal(np.array(buf[0][:, :, 3:4]), np.array(ref[0]))


def test_quantized_ring_update_copy_leaves_caller_arrays_unchanged():
    # Buffers still referenced by the caller are not donated: the outputs are
    # copies and the caller's three arrays keep their contents.
    buf = mx.quantize(mx.random.normal((1, 2, 6, 64)), group_size=32, bits=4)
    mx.eval(buf)
    before = [np_of(a).copy() for a in buf]
    x = mx.random.normal((1, 2, 2, 64))
    out = mlxq.quantized_ring_update(buf, x, 5, group_size=32, bits=4)
    mx.eval(out)
    for a, old in zip(buf, before):
        np.testing.assert_array_equal(np_of(a), old)
    ref = mx.quantize(x, group_size=32, bits=4)
    for got, want in zip(out, ref):
        np.testing.assert_array_equal(np_of(got)[:, :, [5, 0]], np_of(want))


def test_owned_quantized_ring_update_writes_in_place_while_shared():
    # An owned write (a cache, the buffers' only holder) takes the buffers
    # even while the caller still holds them: no copy, and the caller's
    # arrays see the new rows.
    buf = tuple(mx.quantize(mx.random.normal((1, 2, 6, 64)), group_size=32, bits=4))
    mx.eval(buf)
    x = mx.random.normal((1, 2, 2, 64))
    mlxq._ext._take_ring_copies()
    out = mlxq._ext.quantized_ring_update(*buf, x, 5, group_size=32, bits=4, owned=True)
    mx.eval(out)
    assert mlxq._ext._take_ring_copies() == 0
    ref = mx.quantize(x, group_size=32, bits=4)
    for got, held, want in zip(out, buf, ref):
        np.testing.assert_array_equal(np_of(got)[:, :, [5, 0]], np_of(want))
        np.testing.assert_array_equal(np_of(held), np_of(got))  # the same memory


def test_quantized_ring_update_parts_are_separate_primitives():
    """Each of the three outputs comes from its own single-output primitive
    (a multi-output one keeps its inputs and siblings referenced under MLX's
    GPU eval, so nothing could be donated): evaluating one part computes only
    that part, and the others can be evaluated later, or never."""
    B, H, S, D = 1, 8, 16384, 128
    buf = mx.quantize(mx.random.normal((B, H, S, D)), group_size=64, bits=8)
    x = mx.random.normal((B, H, 2, D))
    mx.eval(buf, x)
    before = [np_of(a).copy() for a in buf]
    ref = [np_of(a) for a in mx.quantize(x, group_size=64, bits=8)]
    rows = ring_rows(S, S - 1, 2)
    out = mlxq.quantized_ring_update(buf, x, S - 1, group_size=64, bits=8)
    # buf is still referenced, so the part evaluated is copied: only the
    # scales (1 MiB), not the 16 MiB of codes a sibling would bring along.
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    mx.eval(out[1])
    assert mx.get_peak_memory() - base < 4 << 20
    np.testing.assert_array_equal(np_of(out[1])[:, :, rows], ref[1])
    for part in (2, 0):
        mx.eval(out[part])
        got = np_of(out[part])
        np.testing.assert_array_equal(got[:, :, rows], ref[part])
        keep = np.ones(S, bool)
        keep[rows] = False
        np.testing.assert_array_equal(got[:, :, keep], before[part][:, :, keep])
    # One part alone, the other two never evaluated.
    only = mlxq.quantized_ring_update(buf, x, 3, group_size=64, bits=8)[2]
    mx.eval(only)
    np.testing.assert_array_equal(np_of(only)[:, :, 3:5], ref[2])


def test_quantized_ring_update_parts_not_merged_by_compile():
    # The same array passed as scales and biases: the scales and biases
    # primitives then have identical inputs, and only their part tells them
    # apart (is_equivalent), so compile must not merge them. (Compile never
    # merges the function's outputs, hence the * 1.)
    def step(packed, params, row, pos):
        out = mlxq.quantized_ring_update((packed, params, params), row, pos, group_size=32, bits=4)
        return out[0], out[1] * 1, out[2] * 1

    packed = mx.zeros((1, 1, 4, 4), mx.uint32)
    params = mx.zeros((1, 1, 4, 1))
    row = mx.random.normal((1, 1, 1, 32)) + 3.0
    ref = mx.quantize(row, group_size=32, bits=4)
    assert not np.array_equal(np.array(ref[1]), np.array(ref[2]))
    for fn in (step, mx.compile(step)):
        out = fn(packed, params, row, mx.array(2, dtype=mx.int32))
        mx.eval(out)
        for got, want in zip(out, ref):
            np.testing.assert_array_equal(np.array(got[:, :, 2:3]), np.array(want))


def test_quantized_ring_update_compiled_step_does_not_retrace():
    traces = []

    def step(packed, scales, biases, row, pos):
        traces.append(1)
        return mlxq.quantized_ring_update((packed, scales, biases), row, pos, group_size=32, bits=4)

    step_c = mx.compile(step)
    buf = mx.quantize(mx.zeros((1, 1, 4, 32)), group_size=32, bits=4)
    rows = mx.random.normal((6, 1, 1, 1, 32))
    for i in range(6):
        buf = step_c(*buf, rows[i], mx.array(i, dtype=mx.int32))
        mx.eval(buf)
    assert len(traces) == 1
    ref = mx.quantize(rows[5], group_size=32, bits=4)
    np.testing.assert_array_equal(np.array(buf[0][:, :, 1:2]), np.array(ref[0]))


# ---------------------------------------------------------------- bad input


def test_ring_update_rejects_bad_input():
    buf, upd = mx.zeros((1, 2, 4, 8)), mx.zeros((1, 2, 1, 8))
    cases = [
        (
            lambda: mlxq.ring_update(mx.zeros((2, 4, 8)), upd, 0),
            r"buffer must be 4-D .* got shape \(2, 4, 8\)",
        ),
        (lambda: mlxq.ring_update(buf, mx.zeros((2, 1, 8)), 0), r"update must be 4-D"),
        (
            lambda: mlxq.ring_update(buf, upd.astype(mx.float16), 0),
            r"update dtype float16 does not match the buffer dtype float32",
        ),
        (
            lambda: mlxq.ring_update(buf, mx.zeros((1, 3, 1, 8)), 0),
            r"update shape \(1, 3, 1, 8\) does not match the buffer shape \(1, 2, 4, 8\) in \[B, H\]",
        ),
        (
            lambda: mlxq.ring_update(buf, mx.zeros((1, 2, 1, 9)), 0),
            r"update shape \(1, 2, 1, 9\) does not match the buffer shape \(1, 2, 4, 8\) in the last dimension",
        ),
        (
            lambda: mlxq.ring_update(buf, mx.zeros((1, 2, 5, 8)), 0),
            r"update has 5 rows but the ring holds only 4",
        ),
        (lambda: mlxq.ring_update(buf, upd, -1), r"pos must be >= 0, got -1"),
        (lambda: mlxq.ring_update(buf, upd, mx.array([-2])), r"pos must be >= 0, got -2"),
        (
            lambda: mlxq.ring_update(buf, upd, mx.array([1, 2])),
            r"pos must be an int or a one-element integer array, got shape \(2,\)",
        ),
        (
            lambda: mlxq.ring_update(buf, upd, mx.array(1.0)),
            r"pos array must have an integer dtype, got float32",
        ),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=r"^\[mlxq\.ring_update\] " + message):
            call()


def test_quantized_ring_update_rejects_bad_input():
    buf = mx.quantize(mx.zeros((1, 2, 4, 64)), group_size=32, bits=4)
    upd = mx.zeros((1, 2, 1, 64))

    def call(buffer=buf, update=upd, pos=0, group_size=32, bits=4):
        return mlxq.quantized_ring_update(buffer, update, pos, group_size=group_size, bits=bits)

    p, s, b = buf
    cases = [
        (lambda: call(bits=7), r"bits must be 2, 3, 4, 5, 6 or 8, got 7"),
        (lambda: call(group_size=16), r"group_size must be 32, 64 or 128, got 16"),
        (lambda: call(buffer=(p.astype(mx.int32), s, b)), r"packed must be uint32, got int32"),
        (
            lambda: call(buffer=(p, s, b.astype(mx.float16))),
            r"scales and biases must share one float dtype, got float32 and float16",
        ),
        (
            lambda: call(buffer=(p, s, b[..., :1])),
            r"scales shape \(1, 2, 4, 2\) does not match biases shape \(1, 2, 4, 1\)",
        ),
        (
            lambda: call(buffer=(p[:, :, :3], s, b)),
            r"packed shape \(1, 2, 3, 8\) and scales shape \(1, 2, 4, 2\) disagree on \[B, H, S\]",
        ),
        (
            lambda: call(update=upd.astype(mx.bfloat16)),
            r"update dtype bfloat16 must match the scales dtype float32",
        ),
        (
            lambda: call(update=mx.zeros((1, 2, 5, 64))),
            r"update has 5 rows but the ring holds only 4",
        ),
        (
            lambda: call(update=mx.zeros((1, 2, 1, 128))),
            r"update rows of 128 elements do not fit packed width 8",
        ),
        (
            lambda: call(bits=8),
            r"update rows of 64 elements do not fit packed width 8 and scales width 2 at 8 bits, group size 32",
        ),
        (lambda: call(pos=-3), r"pos must be >= 0, got -3"),
        (lambda: call(update=mx.zeros((1, 2, 64))), r"update must be 4-D"),
    ]
    for fn, message in cases:
        with pytest.raises(ValueError, match=r"^\[mlxq\.quantized_ring_update\] " + message):
            fn()
    with pytest.raises(ValueError, match=r"buffer must be a \(packed, scales, biases\) triple"):
        mlxq.quantized_ring_update((p, s), upd, 0, group_size=32, bits=4)


@pytest.mark.parametrize("fetch", [-1, 0, 1, 5, 9])
def test_quantized_kv_update_writes_both_triples_and_fetches_views(fetch):
    """The caches' one-launch write: K and V rows quantized into both triples
    exactly as quantized_ring_update does, and (fetch >= 0) rows [0, fetch)
    of all six arrays as views that the same primitive outputs."""
    B, H, S, D, T, pos, gs, bits = 2, 3, 9, 64, 2, 4, 32, 4
    k_buf = tuple(
        mx.array(a) for a in mx.quantize(mx.random.normal((B, H, S, D)), group_size=gs, bits=bits)
    )
    v_buf = tuple(
        mx.array(a) for a in mx.quantize(mx.random.normal((B, H, S, D)), group_size=gs, bits=bits)
    )
    k_new, v_new = mx.random.normal((B, H, T, D)), mx.random.normal((B, H, T, D))
    mx.eval(k_buf, v_buf, k_new, v_new)
    want_k = mlxq.quantized_ring_update(k_buf, k_new, pos, group_size=gs, bits=bits)
    want_v = mlxq.quantized_ring_update(v_buf, v_new, pos, group_size=gs, bits=bits)
    mx.eval(want_k, want_v)
    out = mlxq._ext.quantized_kv_update(
        *k_buf, *v_buf, k_new, v_new, pos, group_size=gs, bits=bits, fetch=fetch
    )
    assert len(out) == (2 if fetch < 0 else 4)
    for got, want in zip(out[0] + out[1], want_k + want_v):
        np.testing.assert_array_equal(np_of(got), np_of(want))
    if fetch < 0:
        return
    for view, want in zip(out[2] + out[3], want_k + want_v):
        assert view.shape == want.shape[:2] + (fetch,) + want.shape[3:]
        np.testing.assert_array_equal(np_of(view), np_of(want)[:, :, :fetch])
        # A view computes like the slice it stands for (strided reads).
        np.testing.assert_array_equal(np_of(view + 0), np_of(want[:, :, :fetch] + 0))
    with pytest.raises(ValueError, match=r"fetch rows \[0, 10\) do not fit the buffers' 9 rows"):
        mlxq._ext.quantized_kv_update(
            *k_buf, *v_buf, k_new, v_new, pos, group_size=gs, bits=bits, fetch=10
        )


@pytest.mark.parametrize("fetch", [-1, 4, 9])
@pytest.mark.parametrize("R,T,pos", [(5, 1, 7), (5, 2, 9), (3, 3, 4)])
@pytest.mark.parametrize("ring_pos", [None, 11, "array"])
def test_quantized_kv_update_writes_a_recent_window(fetch, R, T, pos, ring_pos):
    """With ``recent``, the same op also writes the step's rows (given apart:
    the window keeps them as they came) into the two rings at ring rows
    (pos + t) mod R, or (recent_pos: a sliding-window ring's) at the rings'
    own position, returned last; the quantized outputs are as without."""
    B, H, S, D, gs, bits = 1, 2, 9, 64, 64, 4
    k_buf = tuple(mx.quantize(mx.random.normal((B, H, S, D)), group_size=gs, bits=bits))
    v_buf = tuple(mx.quantize(mx.random.normal((B, H, S, D)), group_size=gs, bits=bits))
    k_new, v_new = mx.random.normal((B, H, T, D)), mx.random.normal((B, H, T, 2 * D))
    v_buf = tuple(mx.quantize(mx.random.normal((B, H, S, 2 * D)), group_size=gs, bits=bits))
    k_rows, v_rows = mx.random.normal(k_new.shape), mx.random.normal(v_new.shape)
    ring_k, ring_v = mx.random.normal((B, H, R, D)), mx.random.normal((B, H, R, 2 * D))
    mx.eval(k_buf, v_buf, k_new, v_new, k_rows, v_rows, ring_k, ring_v)
    before_k, before_v = np.array(ring_k), np.array(ring_v)
    plain = mlxq._ext.quantized_kv_update(
        *k_buf, *v_buf, k_new, v_new, pos, group_size=gs, bits=bits, fetch=fetch
    )
    mx.eval(plain)
    plain = [np_of(a) for part in plain for a in part]
    for rows, expect in [(None, (k_new, v_new)), ((k_rows, v_rows), (k_rows, v_rows))]:
        out = mlxq._ext.quantized_kv_update(
            *k_buf,
            *v_buf,
            k_new,
            v_new,
            pos,
            group_size=gs,
            bits=bits,
            fetch=fetch,
            recent_keys=ring_k,
            recent_values=ring_v,
            recent_pos=mx.array(7, dtype=mx.int32) if ring_pos == "array" else ring_pos,
            **({} if rows is None else dict(recent_key_rows=rows[0], recent_value_rows=rows[1])),
        )
        assert len(out) == len(plain) // 3 + 2
        for got, want in zip([a for part in out[:-2] for a in part], plain):
            np.testing.assert_array_equal(np_of(got), want)
        at = {None: pos, 11: 11, "array": 7}[ring_pos]
        slots = ring_rows(R, at, T)
        for ring, old, new in [(out[-2], before_k, expect[0]), (out[-1], before_v, expect[1])]:
            want = old.copy()
            want[:, :, slots] = np.array(new)
            np.testing.assert_array_equal(np.array(ring), want)
    # Not owned, the callers' rings are left as they were (copied first).
    np.testing.assert_array_equal(np.array(ring_k), before_k)
    np.testing.assert_array_equal(np.array(ring_v), before_v)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize(
    "k_format,v_format",
    [
        ((64, 8), (64, 4)),
        ((32, 8), (32, 4)),
        ((128, 8), (128, 4)),
        ((64, 4), (64, 8)),
        ((64, 8), (32, 4)),
    ],
)
@pytest.mark.parametrize("recent", [False, True])
def test_quantized_kv_update_writes_two_quantizations(dtype, k_format, v_format, recent):
    """K and V of two quantizations (the 4-bit recipe's 8-bit keys beside
    4-bit values, one launch on CUDA; other pairs a launch per side): each
    triple exactly as quantized_ring_update writes it at its own width, over
    rows that held other codes, wrapping, and the window's rows into its
    rings."""
    B, H, S, D, T, pos, R = 2, 3, 9, 128, 2, 8, 5
    (kg, kb), (vg, vb) = k_format, v_format

    def normal(*shape):
        return mx.random.normal(shape).astype(dtype)

    k_buf = tuple(mx.quantize(normal(B, H, S, D), group_size=kg, bits=kb))
    v_buf = tuple(mx.quantize(normal(B, H, S, D), group_size=vg, bits=vb))
    k_new, v_new = normal(B, H, T, D), normal(B, H, T, D)
    ring_k, ring_v = normal(B, H, R, D), normal(B, H, R, D)
    mx.eval(k_buf, v_buf, k_new, v_new, ring_k, ring_v)
    want_k = mlxq.quantized_ring_update(k_buf, k_new, pos, group_size=kg, bits=kb)
    want_v = mlxq.quantized_ring_update(v_buf, v_new, pos, group_size=vg, bits=vb)
    mx.eval(want_k, want_v)
    out = mlxq._ext.quantized_kv_update(
        *k_buf,
        *v_buf,
        k_new,
        v_new,
        pos,
        group_size=kg,
        bits=kb,
        v_group_size=vg,
        v_bits=vb,
        fetch=-1,
        **(dict(recent_keys=ring_k, recent_values=ring_v) if recent else {}),
    )
    assert len(out) == (4 if recent else 2)
    for got, want in zip(out[0] + out[1], want_k + want_v):
        np.testing.assert_array_equal(np_of(got), np_of(want))
    if recent:
        slots = ring_rows(R, pos, T)
        for ring, old, new in [(out[2], ring_k, k_new), (out[3], ring_v, v_new)]:
            want = np_of(old).copy()
            want[:, :, slots] = np_of(new)
            np.testing.assert_array_equal(np_of(ring), want)


def test_quantized_kv_update_writes_owned_recent_rings_in_place():
    # recent_owned: the rings are written in place though the caller holds
    # them (a cache that knows every earlier reader runs first); else copied.
    B, H, S, D, R = 1, 2, 8, 64, 4
    k_buf = tuple(mx.quantize(mx.random.normal((B, H, S, D)), group_size=64, bits=4))
    v_buf = tuple(mx.quantize(mx.random.normal((B, H, S, D)), group_size=64, bits=4))
    new = mx.random.normal((B, H, 1, D))
    for owned, copies in [(False, 2), (True, 0)]:
        rings = (mx.random.normal((B, H, R, D)), mx.random.normal((B, H, R, D)))
        mx.eval(k_buf, v_buf, new, rings)
        mlxq._ext._take_ring_copies()
        out = mlxq._ext.quantized_kv_update(
            *k_buf,
            *v_buf,
            new,
            new,
            6,
            group_size=64,
            bits=4,
            recent_keys=rings[0],
            recent_values=rings[1],
            recent_owned=owned,
        )
        mx.eval(out)
        mx.synchronize()
        assert mlxq._ext._take_ring_copies() == copies
        for ring, held in zip(out[-2:], rings):
            np.testing.assert_array_equal(np.array(ring)[:, :, 2], np.array(new)[:, :, 0])
            assert (np.array(held)[:, :, 2] == np.array(new)[:, :, 0]).all() == owned


def test_quantized_kv_update_rejects_a_bad_recent_window():
    B, H, S, D = 1, 2, 8, 64
    k_buf = tuple(mx.quantize(mx.random.normal((B, H, S, D)), group_size=64, bits=4))
    new = mx.random.normal((B, H, 2, D))
    ring = mx.zeros((B, H, 4, D))

    def call(**kw):
        mlxq._ext.quantized_kv_update(*k_buf, *k_buf, new, new, 0, group_size=64, bits=4, **kw)

    def rings(k, v):
        return dict(recent_keys=k, recent_values=v)

    cases = [
        (rings(ring, ring[:, :, :3]), r"recent keys \(1, 2, 4, 64\) and values"),
        (rings(ring, ring.astype(mx.float16)), r"recent values: rows \(1, 2, 2, 64\)"),
        (rings(ring[:, :, :1], ring[:, :, :1]), r"update has 2 rows but the ring holds only 1"),
        (dict(rings(ring, ring), recent_key_rows=new[:, :, :1]), r"recent keys: rows"),
        (rings(ring[..., :32], ring), r"recent keys: rows"),
        (rings(ring[0], ring), r"recent keys must be 4-D"),
        (dict(recent_keys=ring), r"pass recent_keys and recent_values together"),
        (dict(recent_value_rows=new), r"recent rows need the rings they go to"),
    ]
    for kw, message in cases:
        with pytest.raises(ValueError, match=r"^\[mlxq\.quantized_kv_update\] " + message):
            call(**kw)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize(
    "S,start,span,T,pos",
    [(9, 0, 0, 4, 0), (9, 2, 5, 3, 7), (9, 6, 8, 2, 5), (9, 7, 4, 20, 3), (5, 4, 4, 1, 3)],
)
def test_window_step_joins_the_span_to_the_rows_and_writes_the_newest(
    rng, dtype, S, start, span, T, pos
):
    """A recent window's many-row step (RecentWindow.step): the rings' slots
    [start, start + span) mod S oldest first, then the step's rows; the
    rings with the step's last min(T, S) rows written at pos, the exact
    rows still the rings' old contents."""
    B, H, D = 1, 2, 16

    def arr(n):
        return mx.array(rng.standard_normal((B, H, n, D)).astype(np.float32)).astype(dtype)

    kr, vr, k, v = arr(S), arr(S), arr(T), arr(T)
    mx.eval(kr, vr, k, v)
    before = [np_of(kr), np_of(vr)]
    ek, ev, kr2, vr2 = mlxq._ext.window_step(kr, vr, k, v, start=start, span=span, pos=pos)
    slots = [(start + i) % S for i in range(span)]
    m = min(T, S)
    for ring, rows, exact, written in zip(before, (k, v), (ek, ev), (kr2, vr2)):
        want = np.concatenate([ring[:, :, slots], np_of(rows)], axis=2)
        np.testing.assert_array_equal(np_of(exact), want)
        ring_want = ring.copy()
        ring_want[:, :, ring_rows(S, pos, m)] = np_of(rows)[:, :, T - m :]
        np.testing.assert_array_equal(np_of(written), ring_want)
    np.testing.assert_array_equal(np_of(kr), before[0])  # read, then written into a copy


def test_window_step_refuses_a_span_outside_the_ring():
    ring, rows = mx.zeros((1, 2, 8, 16)), mx.zeros((1, 2, 3, 16))
    for start, span in [(8, 0), (-1, 2), (0, 8), (3, -1)]:
        with pytest.raises(ValueError, match="start must lie in"):
            mlxq._ext.window_step(ring, ring, rows, rows, start=start, span=span, pos=0)
    with pytest.raises(ValueError, match="4-D"):
        mlxq._ext.window_step(ring, ring, rows[0], rows, start=0, span=1, pos=0)
