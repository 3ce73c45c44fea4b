"""DequantizeInto (metal/dequantize.metal) on the emulator, dispatched through
mlxq._ext._metal_plan_dequantize_into and _metal_plan_fill as the host code
dispatches it, and its plan on its own for shapes too large to emulate.

The output must be scale * code + bias computed in float32 with one fma and
rounded once to the output dtype: it is compared bit for bit with a NumPy
model of that (exact in float64, then rounded to float32 and to the output
dtype), and within the CPU tests' tolerance of a float64 dequantization.
Every output element must be written (the output is poisoned first, by the
fill kernel the host runs) and nothing past it touched.
"""

import struct

import mlx.core as mx
import numpy as np
import pytest
from harness import DT, in_buffer, run_dequantize_into, run_fill
from mlx_oracle import BITS, GROUP_SIZES

import mlxq

STORAGE = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}
ULP = {"f32": 2.0**-23, "f16": 2.0**-10, "bf16": 2.0**-7}
GARBAGE = {"f32": 0x3F800000, "f16": 0x3C00, "bf16": 0x3F80}  # 1.0: not poison, not a result


def random_scales(rng, shape, tag):
    x = rng.standard_normal(shape).astype(np.float32)
    if tag == "bf16":
        return (x.view(np.uint32) >> 16).astype(np.uint16)
    return x.astype(STORAGE[tag])


def to_f64(a, tag):
    if tag == "bf16":
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


def codes_of(packed, bits):
    """The codes of [..., W] uint32 rows, read from the little-endian bit stream."""
    words = packed.astype(np.uint64)
    W = words.shape[-1]
    D = W * 32 // bits
    bit = np.arange(D) * bits
    window = words[..., bit // 32] | (words[..., np.minimum(bit // 32 + 1, W - 1)] << np.uint64(32))
    return ((window >> (bit % 32).astype(np.uint64)) & np.uint64((1 << bits) - 1)).astype(
        np.float64
    )


def reference64(packed, scales, biases, group_size, bits, s_tag):
    s = np.repeat(to_f64(scales, s_tag), group_size, axis=-1)
    z = np.repeat(to_f64(biases, s_tag), group_size, axis=-1)
    return s * codes_of(packed, bits) + z


def model_storage(ref64, out_tag):
    """fma in float32 (the float64 value is exact here: one rounding to f32),
    then one rounding to the output dtype, as output storage."""
    f32 = np.ascontiguousarray(ref64, np.float32)
    if out_tag == "f32":
        return f32
    if out_tag == "f16":
        return f32.astype(np.float16)
    return np.array(mx.array(f32).astype(mx.bfloat16).view(mx.uint16))


def workspace(size, extra, out_tag):
    """1-D workspace of `size + extra` elements holding garbage (1.0)."""
    word = np.array([GARBAGE[out_tag]], np.uint32 if out_tag == "f32" else np.uint16)
    return np.full(size + extra, word.view(STORAGE[out_tag])[0], STORAGE[out_tag])


def inputs(rng, B, H, N, D, group_size, bits, s_tag, layout="sliced"):
    """packed / scales / biases views of [B, H, N, *] in `layout`."""
    W, G = D * bits // 32, D // group_size
    packed = rng.integers(0, 2**32, (B, H, N, W), dtype=np.uint64).astype(np.uint32)
    scales = random_scales(rng, (B, H, N, G), s_tag)
    biases = random_scales(rng, (B, H, N, G), s_tag)
    if layout == "sliced":  # rows [a, a + N) of a cache buffer: buffer[..., a:a+N, :]
        views = [in_buffer(a, extra_rows=7, rng=rng) for a in (packed, scales, biases)]
    elif layout == "odd":  # odd offsets and row strides
        views = [
            in_buffer(a, extra_rows=3, rng=rng, pad_cols=True) for a in (packed, scales, biases)
        ]
    elif layout == "transposed":  # [B, N, H, *] storage read as [B, H, N, *]
        views = [
            np.ascontiguousarray(a.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
            for a in (packed, scales, biases)
        ]
    elif layout == "every_other":  # last axis strided too
        views = []
        for a in (packed, scales, biases):
            big = np.zeros(a.shape[:3] + (2 * a.shape[3],), a.dtype)
            big[..., ::2] = a
            views.append(big[..., ::2])
    else:
        views = [packed, scales, biases]
    for v, a in zip(views, (packed, scales, biases)):
        np.testing.assert_array_equal(v, a)
    return views


def check(emu, rng, B, H, N, D, group_size, bits, s_tag, out_tag, layout="sliced"):
    packed, scales, biases = inputs(rng, B, H, N, D, group_size, bits, s_tag, layout)
    size, extra = B * H * N * D, 37
    ws = workspace(size, extra, out_tag)
    out, plan = run_dequantize_into(
        emu,
        ws,
        packed,
        scales,
        biases,
        group_size=group_size,
        bits=bits,
        s_tag=s_tag,
        out_tag=out_tag,
    )
    assert plan["kernel"] == f"mlxq_dequantize_into_{out_tag}_b{bits}"
    ref = reference64(packed, scales, biases, group_size, bits, s_tag)
    got = to_f64(out, out_tag)
    assert np.isfinite(got).all(), "unwritten (poisoned) elements"
    # Bit for bit: one fma in f32, one rounding to the output dtype.
    np.testing.assert_array_equal(out.view(np.uint8), model_storage(ref, out_tag).view(np.uint8))
    mag = np.maximum(np.abs(ref), 2.0**-14)
    assert (np.abs(got - ref) <= mag * (ULP[out_tag] + 2.0**-22)).all()
    # Nothing past the output: the workspace's tail keeps its garbage.
    assert (
        ws.view(np.uint8)[size * ws.itemsize :] == workspace(0, extra, out_tag).view(np.uint8)
    ).all()
    return plan


@pytest.mark.parametrize("out_tag", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_dequantize_matches_float64(emu, rng, out_tag, bits, group_size):
    s_tag = {"f32": "bf16", "f16": "f16", "bf16": "f32"}[out_tag]
    D = 2 * group_size if group_size < 128 else 128
    check(emu, rng, 2, 3, 5, D, group_size, bits, s_tag, out_tag)


@pytest.mark.parametrize("s_tag", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("layout", ["contiguous", "sliced", "odd", "transposed", "every_other"])
@pytest.mark.parametrize("bits", [3, 4, 5, 8])
def test_dequantize_strided_inputs(emu, rng, s_tag, layout, bits):
    check(emu, rng, 1, 2, 9, 96, 32, bits, s_tag, "bf16", layout)


@pytest.mark.parametrize("N", [1, 2, 13, 33])
@pytest.mark.parametrize("D", [32, 96, 256, 512])
def test_dequantize_ragged_shapes(emu, rng, N, D):
    group_size = 32 if D % 64 else 64
    for bits in (3, 6):
        check(emu, rng, 2, 1, N, D, group_size, bits, "f16", "f32")


def test_dequantize_empty_output_dispatches_nothing(emu, rng):
    packed, scales, biases = inputs(rng, 1, 2, 0, 64, 64, 4, "f16", "contiguous")
    ws = workspace(0, 8, "f16")
    out, plan = run_dequantize_into(
        emu, ws, packed, scales, biases, group_size=64, bits=4, s_tag="f16", out_tag="f16"
    )
    assert out.size == 0 and 0 in plan["grid"] and 0 in plan["fill"]["grid"]
    assert (ws.view(np.uint16) == GARBAGE["f16"]).all()


@pytest.mark.parametrize("tag", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("n_words", [1, 31, 1000, (1 << 16) + 5])
def test_fill_poisons_exactly_its_words(emu, tag, n_words):
    dst = np.zeros(n_words + 9, np.uint32)
    plan = run_fill(emu, dst, n_words, tag)
    assert plan["kernel"] == "mlxq_fill_u32"
    assert (dst[:n_words] == plan["pattern"]).all() and (dst[n_words:] == 0).all()
    vals = dst[:n_words].view(STORAGE[tag])
    assert np.isnan(to_f64(vals, tag)).all()


# --- the plan alone ------------------------------------------------------------------------


def dq_plan(**kw):
    base = dict(B=1, H=8, N=4096, D=128, group_size=64, bits=4)
    base.update(kw)
    return mlxq._ext._metal_plan_dequantize_into(base)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("out_tag", ["f32", "f16", "bf16"])
def test_plan_kernel_names(bits, out_tag):
    p = dq_plan(bits=bits, out_dtype=DT[out_tag])
    assert p["kernel"] == f"mlxq_dequantize_into_{out_tag}_b{bits}"


@pytest.mark.parametrize(
    "B,H,N,D", [(1, 8, 131072, 128), (4, 32, 1, 64), (1, 1, 7, 512), (2, 4, 0, 128)]
)
def test_plan_one_thread_per_8_codes(B, H, N, D):
    p = dq_plan(B=B, H=H, N=N, D=D)
    assert p["grid_is_threads"] and p["grid"] == (D // 8, N, B * H)
    gx, gy, gz = p["group"]
    assert gz == 1 and 1 <= gx * gy <= 256 and gx <= D // 8
    assert p["slots"] == dict(packed=0, scales=1, biases=2, out=3, params=4)
    assert p["order_slot"] not in p["slots"].values()


def test_plan_params_block():
    ws, ss, bs = (11, 12, 13, 1), (21, 22, 23, 2), (31, 32, 33, 3)
    p = dq_plan(
        B=2,
        H=3,
        N=5,
        D=256,
        group_size=128,
        bits=6,
        scale_dtype=DT["bf16"],
        packed_strides=ws,
        scales_strides=ss,
        biases_strides=bs,
    )
    vals = struct.unpack("<12q8i", p["params"])
    assert vals[:12] == ws + ss + bs
    assert vals[12:19] == (2, 3, 5, 256, 128, 6, DT["bf16"])


@pytest.mark.parametrize("kw", [dict(bits=7), dict(group_size=16), dict(D=96, group_size=64)])
def test_plan_rejects_unsupported(kw):
    with pytest.raises(ValueError):
        dq_plan(**kw)


@pytest.mark.parametrize("n_words", [0, 1, 65536, 65537, 10**9])
def test_fill_plan_covers_every_word(n_words):
    p = mlxq._ext._metal_plan_fill(dict(n_words=n_words, dtype=DT["f16"]))
    n, pattern, cols = struct.unpack("<qIi", p["params"])
    assert n == n_words and pattern == 0x7E007E00 == p["pattern"]
    gx, gy, gz = p["grid"]
    assert gz == 1 and gx == cols or n_words == 0
    if n_words:
        assert (gy - 1) * cols < n_words <= gx * gy and gx < 2**32 and gy < 2**32
    else:
        assert 0 in p["grid"]
