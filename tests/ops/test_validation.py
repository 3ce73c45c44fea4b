"""Every input rule of mlxq.quantized_sdpa raises ValueError with a useful message.

One case per check in csrc/quantized_sdpa.cpp (and the Python layer), each
matched against the part of the message that names the offending input and
the values received, so a message that lost its specifics fails too.
"""

import mlx.core as mx
import numpy as np
import pytest
from support.helpers import quantize

import mlxq

B, HQ, HKV, L, N, D = 2, 8, 2, 3, 10, 128


def base_inputs():
    """Valid inputs as keyword arguments of mlxq._ext.quantized_sdpa."""
    rng = np.random.default_rng(0)
    kp, ks, kb = quantize(rng.standard_normal((B, HKV, N, D), dtype=np.float32), 64, 4)
    vp, vs, vb = quantize(rng.standard_normal((B, HKV, N, D), dtype=np.float32), 64, 4)
    return dict(
        q=mx.array(rng.standard_normal((B, HQ, L, D), dtype=np.float32)),
        k_packed=kp,
        k_scales=ks,
        k_biases=kb,
        v_packed=vp,
        v_scales=vs,
        v_biases=vb,
        scale=D**-0.5,
    )


def zeros(shape, dtype=mx.float32):
    return mx.zeros(shape, dtype=dtype)


def ext_call(**changes):
    args = base_inputs()
    args.update(changes)
    return mlxq._ext.quantized_sdpa(**args)


def py_call(**changes):
    """Through the public wrapper, with triples and a Python-level mask."""
    a = base_inputs()
    kwargs = dict(scale=a["scale"], mask=None, sinks=None)
    keys = (a["k_packed"], a["k_scales"], a["k_biases"])
    values = (a["v_packed"], a["v_scales"], a["v_biases"])
    kwargs.update(changes)
    keys, values = kwargs.pop("keys", keys), kwargs.pop("values", values)
    return mlxq.quantized_sdpa(kwargs.pop("q", a["q"]), keys, values, **kwargs)


def test_valid_base_inputs_run():
    # The cases below each break exactly one rule of these inputs.
    out = ext_call()
    mx.eval(out)
    assert out.shape == (B, HQ, L, D) and np.isfinite(np.array(out)).all()
    mx.eval(py_call(mask="causal", sinks=zeros((HQ,))))


def packed(words, dtype=mx.uint32, heads=HKV, n=N, batch=B):
    return mx.zeros((batch, heads, n, words), dtype=dtype)


CASES = [
    # queries
    (
        "q_3d",
        lambda: ext_call(q=zeros((HQ, L, D))),
        r"queries must be 4-D \[B, H_q, L, D\], got shape \(8, 3, 128\)",
    ),
    (
        "q_int",
        lambda: ext_call(q=zeros((B, HQ, L, D), mx.int32)),
        r"queries must be float32, float16 or bfloat16, got int32",
    ),
    (
        "q_empty_head_dim",
        lambda: ext_call(q=zeros((B, HQ, L, 0))),
        r"keys has an empty head dimension",
    ),
    # one triple on its own
    (
        "k_scales_3d",
        lambda: ext_call(k_scales=zeros((B, HKV, N)), k_biases=zeros((B, HKV, N))),
        r"keys scales must be 4-D \[B, H_kv, N, \.\.\.\], got shape \(2, 2, 10\)",
    ),
    (
        "k_packed_not_uint32",
        lambda: ext_call(k_packed=packed(16, mx.int32)),
        r"keys packed must be uint32 .*got int32",
    ),
    (
        "v_packed_not_uint32",
        lambda: ext_call(v_packed=packed(16, mx.uint8)),
        r"values packed must be uint32 .*got uint8",
    ),
    (
        "scales_int",
        lambda: ext_call(
            k_scales=zeros((B, HKV, N, 2), mx.int32), k_biases=zeros((B, HKV, N, 2), mx.int32)
        ),
        r"keys scales must be float32, float16 or bfloat16, got int32",
    ),
    (
        "biases_dtype",
        lambda: ext_call(v_biases=zeros((B, HKV, N, 2), mx.float16)),
        r"values biases dtype float16 does not match its scales dtype float32",
    ),
    (
        "scales_biases_shape",
        lambda: ext_call(k_biases=zeros((B, HKV, N, 4))),
        r"keys scales shape \(2, 2, 10, 2\) does not match its biases shape \(2, 2, 10, 4\)",
    ),
    (
        "packed_vs_scales_bhn",
        lambda: ext_call(k_packed=packed(16, n=N + 1)),
        r"keys packed shape \(2, 2, 11, 16\) and scales shape \(2, 2, 10, 2\) disagree on "
        r"\[B, H_kv, N\]",
    ),
    # keys against values
    (
        "kv_scales_dtype",
        lambda: ext_call(
            v_scales=zeros((B, HKV, N, 2), mx.bfloat16), v_biases=zeros((B, HKV, N, 2), mx.bfloat16)
        ),
        r"same scales dtype, got float32 and bfloat16",
    ),
    (
        "kv_bhn",
        lambda: ext_call(
            v_packed=packed(16, n=N - 1),
            v_scales=zeros((B, HKV, N - 1, 2)),
            v_biases=zeros((B, HKV, N - 1, 2)),
        ),
        r"keys \(2, 2, 10, 16\) and values \(2, 2, 9, 16\) disagree on \[B, H_kv, N\]",
    ),
    (
        "kv_bits_differ",
        lambda: ext_call(v_packed=packed(32)),  # 8-bit values, 4-bit keys
        r"values scales width 2 does not match 256 values in groups of 64",
    ),
    # queries against K/V
    (
        "batch",
        lambda: ext_call(q=zeros((B + 1, HQ, L, D))),
        r"queries batch 3 does not match the keys batch 2",
    ),
    (
        "heads_not_multiple",
        lambda: ext_call(q=zeros((B, 7, L, D))),
        r"number of query heads \(7\) must be a multiple of the number of KV heads \(2\)",
    ),
    (
        "zero_kv_heads",
        lambda: ext_call(
            k_packed=packed(16, heads=0),
            k_scales=zeros((B, 0, N, 2)),
            k_biases=zeros((B, 0, N, 2)),
            v_packed=packed(16, heads=0),
            v_scales=zeros((B, 0, N, 2)),
            v_biases=zeros((B, 0, N, 2)),
        ),
        r"must be a multiple of the number of KV heads \(0\)",
    ),
    (
        "q_head_dim_too_big",
        lambda: ext_call(q=zeros((B, HQ, L, 576))),
        r"query head dimension 576 exceeds the maximum 512",
    ),
    (
        "v_head_dim_too_big",
        lambda: ext_call(
            v_packed=packed(72), v_scales=zeros((B, HKV, N, 9)), v_biases=zeros((B, HKV, N, 9))
        ),
        r"value head dimension 576 exceeds the maximum 512",
    ),
    # bits and group size
    ("bits_explicit", lambda: ext_call(bits=7), r"bits must be 2, 3, 4, 5, 6 or 8, got 7\."),
    (
        "bits_inferred",
        lambda: ext_call(k_packed=packed(28)),
        r"bits must be 2, 3, 4, 5, 6 or 8, got 7 \(inferred from the packed width\)",
    ),
    (
        "group_size_explicit",
        lambda: ext_call(group_size=16),
        r"group_size must be 32, 64 or 128, got 16\.",
    ),
    (
        "group_size_inferred",
        lambda: ext_call(k_scales=zeros((B, HKV, N, 8)), k_biases=zeros((B, HKV, N, 8))),
        r"group_size must be 32, 64 or 128, got 16 \(inferred from the scales width\)",
    ),
    (
        "packed_width_vs_q",
        lambda: ext_call(k_packed=packed(17)),
        r"keys packed width 17 does not hold 128 values of 4 bits \(expected 16\)",
    ),
    (
        "packed_width_vs_explicit_bits",
        lambda: ext_call(bits=8),
        r"keys packed width 16 does not hold 128 values of 8 bits \(expected 32\)",
    ),
    (
        "scales_width",
        lambda: ext_call(group_size=32),
        r"keys scales width 2 does not match 128 values in groups of 32",
    ),
    # scale
    ("scale_nan", lambda: ext_call(scale=float("nan")), r"scale must be finite, got nan"),
    ("scale_inf", lambda: ext_call(scale=float("inf")), r"scale must be finite, got inf"),
    # masks
    (
        "mask_string",
        lambda: ext_call(mask_mode="upper"),
        r"mask must be None, \"causal\" or an array, got \"upper\"",
    ),
    (
        "mask_string_py",
        lambda: py_call(mask="Causal"),
        r"mask must be None, \"causal\" or an array, got \"Causal\"",
    ),
    (
        "causal_and_array",
        lambda: ext_call(mask_mode="causal", mask=mx.ones((L, N), mx.bool_)),
        r"either mask=\"causal\" or a mask array, not both",
    ),
    (
        "mask_int",
        lambda: py_call(mask=mx.ones((L, N), mx.int32)),
        r"mask array must be bool or float32/float16/bfloat16, got int32",
    ),
    (
        "mask_not_broadcastable",
        lambda: py_call(mask=mx.ones((L, N + 1), mx.bool_)),
        r"mask shape \(3, 11\) cannot be broadcast to \[B, H_q, L, N\] = \(2, 8, 3, 10\)",
    ),
    (
        "mask_wrong_heads",
        lambda: py_call(mask=mx.ones((1, HKV, L, N), mx.bool_)),
        r"mask shape \(1, 2, 3, 10\) cannot be broadcast",
    ),
    (
        "mask_5d",
        lambda: py_call(mask=mx.ones((1, 1, 1, L, N), mx.bool_)),
        r"mask shape \(1, 1, 1, 3, 10\) cannot be broadcast",
    ),
    (
        "mask_python_type",
        lambda: py_call(mask=[[True] * N] * L),
        r"mask must be None, \"causal\" or an mx\.array, got list",
    ),
    (
        "mask_numpy",
        lambda: py_call(mask=np.ones((L, N), bool)),
        r"mask must be None, \"causal\" or an mx\.array, got ndarray",
    ),
    # sinks
    (
        "sinks_length",
        lambda: py_call(sinks=zeros((HKV,))),
        r"sinks must have shape \(H_q,\) = \(8,\), got \(2,\)",
    ),
    (
        "sinks_2d",
        lambda: py_call(sinks=zeros((1, HQ))),
        r"sinks must have shape \(H_q,\) = \(8,\), got \(1, 8\)",
    ),
    (
        "sinks_int",
        lambda: py_call(sinks=zeros((HQ,), mx.int32)),
        r"sinks must be float32, float16 or bfloat16, got int32",
    ),
    # the Python layer
    (
        "keys_plain_array",
        lambda: py_call(keys=zeros((B, HKV, N, D))),
        r"keys and values must each be a \(packed, scales, biases\) triple",
    ),
    (
        "values_pair",
        lambda: py_call(values=(packed(16), zeros((B, HKV, N, 2)))),
        r"keys and values must each be a \(packed, scales, biases\) triple",
    ),
]


@pytest.mark.parametrize("make_call,pattern", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_raises(make_call, pattern):
    with pytest.raises(ValueError, match=pattern) as info:
        make_call()
    assert str(info.value).startswith("[mlxq."), str(info.value)


def test_sdpa_mixed_plain_and_quantized_raises():
    # mlxq.sdpa routes to the kernel as soon as either side is a triple.
    a = base_inputs()
    keys = (a["k_packed"], a["k_scales"], a["k_biases"])
    with pytest.raises(ValueError, match=r"each be a \(packed, scales, biases\) triple"):
        mlxq.sdpa(a["q"], keys, zeros((B, HKV, N, D)), scale=1.0)
