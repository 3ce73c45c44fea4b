"""RingUpdate, QuantizedRingUpdate and the strided copy (metal/ring_update.metal)
on the emulator, dispatched through mlxq._ext._metal_plan_*.

QuantizedRingUpdate must write rows bit-identical to MLX's Metal
mx.quantize: it is checked against MLX's own affine_quantize kernel (taken
from the installed MLX headers and run on the emulator, mlx_oracle.py),
against an independent NumPy model of that arithmetic, and against
mx.quantize on the CPU wherever the two MLX backends agree.
"""

import mlx.core as mx
import numpy as np
import pytest
from harness import (
    PARTS,
    in_buffer,
    poisoned,
    run_copy4d,
    run_quantized_ring_update,
    run_quantized_ring_update_part,
    run_ring_update,
)
from mlx_oracle import (
    BITS,
    GROUP_SIZES,
    build_oracle,
    cpu_quantize_differs,
    metal_quantize_model,
    mlx_metal_quantize,
)

STORAGE = {
    "f32": np.float32,
    "f16": np.float16,
    "bf16": np.uint16,
    "i8": np.int8,
    "c64": np.complex64,
}


def random_storage(rng, shape, tag):
    x = rng.standard_normal(shape).astype(np.float32)
    if tag == "bf16":
        return (x.view(np.uint32) >> 16).astype(np.uint16)
    if tag == "i8":
        return rng.integers(-128, 128, shape).astype(np.int8)
    if tag == "c64":
        return (x + 1j * rng.standard_normal(shape)).astype(np.complex64)
    return x.astype(STORAGE[tag])


def ring_rows(S, pos, T):
    return [(pos + t) % S for t in range(T)]


@pytest.fixture(scope="module")
def oracle():
    return build_oracle()


# --- RingUpdate ----------------------------------------------------------------------------


@pytest.mark.parametrize("tag", ["f32", "f16", "bf16", "i8", "c64"])
@pytest.mark.parametrize(
    "S,T,pos", [(8, 1, 0), (8, 3, 6), (8, 8, 5), (5, 5, 0), (7, 2, 13), (16, 0, 3), (9, 4, -3)]
)
def test_ring_update(emu, rng, tag, S, T, pos):
    B, H, D = 2, 3, 24
    buf = random_storage(rng, (B, H, S, D), tag)
    upd = random_storage(rng, (B, H, T, D), tag)
    expect = buf.copy()
    expect[:, :, ring_rows(S, pos, T)] = upd
    plan = run_ring_update(emu, buf, upd, pos)
    assert plan["kernel"] == f"mlxq_ring_update_u{8 * buf.itemsize}"
    np.testing.assert_array_equal(buf, expect)


def test_ring_update_strided_update(emu, rng):
    # A transposed update ([B, T, H, D] projected keys), read through its strides.
    B, H, S, D, T = 1, 4, 10, 16, 3
    upd = rng.standard_normal((B, T, H, D)).astype(np.float32).transpose(0, 2, 1, 3)
    buf = rng.standard_normal((B, H, S, D)).astype(np.float32)
    expect = buf.copy()
    expect[:, :, ring_rows(S, 9, T)] = upd
    run_ring_update(emu, buf, upd, 9)
    np.testing.assert_array_equal(buf, expect)


@pytest.mark.parametrize("tag", ["f32", "bf16", "i8", "c64"])
@pytest.mark.parametrize("layout", ["every_other", "transposed", "sliced_rows"])
def test_copy4d(emu, rng, tag, layout):
    """The copy a non-donatable or strided ring buffer gets before its update."""
    if layout == "every_other":
        src = random_storage(rng, (2, 3, 5, 34), tag)[..., ::2]
    elif layout == "transposed":
        src = random_storage(rng, (2, 7, 3, 16), tag).transpose(0, 2, 1, 3)
    else:
        src = random_storage(rng, (1, 2, 40, 8), tag)[:, :, 3:30]
    np.testing.assert_array_equal(run_copy4d(emu, src), src)


# --- QuantizedRingUpdate ------------------------------------------------------------------------


def quantizer_rows(rng, shape, group_size, tag):
    """Rows that reach every branch of the scale/bias computation: mixed
    magnitudes, an all-zero group, a constant group, an all-negative group
    (where MLX's GPU and CPU quantizers differ), and groups of values on
    exact .5 code ties (round half away from zero vs to even)."""
    B, H, T, D = shape
    x = (rng.standard_normal(shape) * np.array([0.01, 1.0, 50.0, 3.0])[:T, None]).astype(np.float32)
    g = group_size
    x[0, 0, 0, :g] = 0.0
    x[-1, -1, -1, :g] = 2.5
    x[0, -1, 0, g : 2 * g] = -np.abs(x[0, -1, 0, g : 2 * g]) - 0.1
    ties = np.resize(np.array([0.0, 3.0, 0.5, 2.5, 1.5, 1.0], np.float32), g)
    x[-1, 0, 0, -g:] = ties
    x[0, 0, -1, -g:] = -ties
    if tag == "f32":
        return x
    if tag == "f16":
        return x.astype(np.float16)
    return np.array(mx.array(x).astype(mx.bfloat16).view(mx.uint16))


@pytest.mark.parametrize("tag", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_quantized_ring_update_bit_identical_to_mlx_metal_quantize(
    emu, oracle, rng, tag, bits, group_size
):
    B, H, S, D, T, pos = 2, 2, 9, 256, 4, 7
    x = quantizer_rows(rng, (B, H, T, D), group_size, tag)
    old = mx.quantize(
        mx.array(rng.standard_normal((B, H, S, D)).astype(np.float32)),
        group_size=group_size,
        bits=bits,
    )
    buf = [
        np.array(old[0]),
        random_storage(rng, (B, H, S, D // group_size), tag),
        random_storage(rng, (B, H, S, D // group_size), tag),
    ]
    before = [a.copy() for a in buf]
    plan = run_quantized_ring_update(emu, buf, x, pos, group_size=group_size, bits=bits, tag=tag)
    assert plan["kernel"] == f"mlxq_quantized_ring_update_{tag}_b{bits}"

    rows = ring_rows(S, pos, T)
    others = [r for r in range(S) if r not in rows]
    mlx_gpu = mlx_metal_quantize(oracle, x, group_size, bits, tag)
    *model, info = metal_quantize_model(x, group_size, bits, tag)
    for got, want, mine, old_rows in zip(buf, mlx_gpu, model, before):
        np.testing.assert_array_equal(got[:, :, rows], want)  # MLX's own Metal kernel
        np.testing.assert_array_equal(got[:, :, rows], mine)  # the NumPy model
        np.testing.assert_array_equal(got[:, :, others], old_rows[:, :, others])

    # Against mx.quantize on the CPU: equal except in the groups where MLX's
    # two backends differ -- and those exist here.
    xm = mx.array(x).view(mx.bfloat16) if tag == "bf16" else mx.array(x)
    cpu = [
        np.array(a.view(mx.uint16)) if a.dtype == mx.bfloat16 else np.array(a)
        for a in mx.quantize(xm, group_size=group_size, bits=bits, stream=mx.cpu)
    ]
    differs = cpu_quantize_differs(info)  # [B, H, T, G]
    same = ~differs
    np.testing.assert_array_equal(buf[1][:, :, rows][same], cpu[1][same])
    np.testing.assert_array_equal(buf[2][:, :, rows][same], cpu[2][same])
    wpg = group_size * bits // 32
    packed = buf[0][:, :, rows].reshape(B, H, T, -1, wpg)
    np.testing.assert_array_equal(packed[same], cpu[0].reshape(B, H, T, -1, wpg)[same])
    assert differs.any()
    assert not all(np.array_equal(a[:, :, rows], b) for a, b in zip(buf, cpu))


@pytest.mark.parametrize("bits", [3, 8])
def test_quantized_ring_update_strided_update_wraps(emu, oracle, rng, bits):
    B, H, S, D, T, pos, gs = 1, 3, 5, 128, 5, 3, 64
    # [B, T, H, D] projections viewed as [B, H, T, D], inside a larger buffer
    x = in_buffer(rng.standard_normal((B, T, H, D)).astype(np.float32), 7, axis=1).transpose(
        0, 2, 1, 3
    )
    buf = [
        np.zeros((B, H, S, D * bits // 32), np.uint32),
        np.zeros((B, H, S, D // gs), np.float32),
        np.zeros((B, H, S, D // gs), np.float32),
    ]
    run_quantized_ring_update(emu, buf, x, pos, group_size=gs, bits=bits, tag="f32")
    want = mlx_metal_quantize(oracle, np.ascontiguousarray(x), gs, bits, "f32")
    rows = ring_rows(S, pos, T)  # all 5 rows, starting at 3
    for got, w in zip(buf, want):
        np.testing.assert_array_equal(got[:, :, rows], w)


def test_empty_update_dispatches_nothing():
    import mlxq

    plan = mlxq._ext._metal_plan_ring_update(dict(B=1, H=2, S=8, T=0, D=16, itemsize=4))
    assert 0 in plan["grid"]
    plan = mlxq._ext._metal_plan_quantized_ring_update(
        dict(B=1, H=2, S=8, T=0, D=64, group_size=64, bits=4)
    )
    assert 0 in plan["grid"]


@pytest.mark.parametrize("tag", ["f32", "bf16"])
@pytest.mark.parametrize("bits", [3, 4, 8])
@pytest.mark.parametrize("part", [0, 1, 2])
def test_quantized_ring_update_part_writes_only_its_array(emu, oracle, rng, tag, bits, part):
    """Each QuantizedRingUpdate primitive owns one array of the triple: a
    part-k dispatch writes its rows of that array and nothing else, even with
    distinct (poisoned) arrays bound in the other two slots."""
    B, H, S, D, T, pos, gs = 2, 2, 6, 128, 3, 4, 64
    x = quantizer_rows(rng, (B, H, T, D), gs, tag)
    shapes = [(B, H, S, D * bits // 32), (B, H, S, D // gs), (B, H, S, D // gs)]
    own = (
        random_storage(rng, shapes[part], tag)
        if part
        else rng.integers(0, 2**32, shapes[0], dtype=np.uint64).astype(np.uint32)
    )
    before = own.copy()
    others = {
        name: (np.full(shapes[i], 0xFFFFFFFF, np.uint32) if i == 0 else poisoned(shapes[i], tag))
        for i, name in enumerate(PARTS)
        if i != part
    }
    untouched = {name: a.copy() for name, a in others.items()}
    plan = run_quantized_ring_update_part(
        emu, part, own, x, pos, group_size=gs, bits=bits, tag=tag, others=others
    )
    assert plan["kernel"] == f"mlxq_quantized_ring_update_{tag}_b{bits}"
    for name, a in others.items():
        assert a.tobytes() == untouched[name].tobytes(), f"part {part} wrote {name}"
    rows = ring_rows(S, pos, T)
    kept = [r for r in range(S) if r not in rows]
    want = mlx_metal_quantize(oracle, x, gs, bits, tag)[part]
    np.testing.assert_array_equal(own[:, :, rows], want)
    np.testing.assert_array_equal(own[:, :, kept], before[:, :, kept])


@pytest.mark.parametrize("tag", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_quantized_kv_update_writes_all_three_arrays(emu, oracle, rng, tag, bits, group_size):
    """QuantizedKVUpdate's dispatch per side (MQ_PART_ALL): one dispatch
    writes codes, scales and biases of the new rows, each bit-identical to
    MLX's Metal quantize, into three distinct arrays, and no other row."""
    B, H, S, D, T, pos = 1, 2, 7, 256, 3, 5
    x = quantizer_rows(rng, (B, H, T, D), group_size, tag)
    shapes = [(B, H, S, D * bits // 32), (B, H, S, D // group_size), (B, H, S, D // group_size)]
    buf = [
        rng.integers(0, 2**32, shapes[0], dtype=np.uint64).astype(np.uint32),
        random_storage(rng, shapes[1], tag),
        random_storage(rng, shapes[2], tag),
    ]
    before = [a.copy() for a in buf]
    plan = run_quantized_ring_update_part(
        emu,
        3,
        buf[0],
        x,
        pos,
        group_size=group_size,
        bits=bits,
        tag=tag,
        others=dict(zip(PARTS, buf)),
    )
    assert plan["kernel"] == f"mlxq_quantized_ring_update_{tag}_b{bits}"
    rows = ring_rows(S, pos, T)
    kept = [r for r in range(S) if r not in rows]
    for got, want, old in zip(buf, mlx_metal_quantize(oracle, x, group_size, bits, tag), before):
        np.testing.assert_array_equal(got[:, :, rows], want)
        np.testing.assert_array_equal(got[:, :, kept], old[:, :, kept])
