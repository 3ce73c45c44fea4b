"""Float64 NumPy oracle for QuantizedSDPA.

Deliberately simple: one (batch, head) at a time, full score matrix, plain
softmax in float64. Everything the kernel rounds (f32 accumulation, q*scale
in f32, the split-K merge) is exact here to ~1e-16, so the measured error is
the kernel's alone.
"""

import mlx.core as mx
import numpy as np

from mlxq.guard import parts
from support.helpers import to_f64


def dequantize64(triple, group_size: int, bits: int) -> np.ndarray:
    """``scale * code + bias`` of an ``mx.quantize`` triple, in float64.

    ``mx.dequantize`` returns the scales' dtype, which would round each
    dequantized element to f16/bf16 (about 4e-3 relative for bf16) -- far more
    than the kernel's f32 error. So the codes are extracted exactly, with
    ``mx.dequantize`` under unit scales and zero biases, and scaled in float64.
    """
    packed, scales, biases = parts(triple)
    ones = mx.ones(scales.shape, dtype=mx.float32)
    codes = to_f64(
        mx.dequantize(packed, ones, mx.zeros_like(ones), group_size=group_size, bits=bits)
    )
    s = np.repeat(to_f64(scales), group_size, axis=-1)
    b = np.repeat(to_f64(biases), group_size, axis=-1)
    return codes * s + b


def mask64(mask, shape):
    """(visible bool, additive float64) arrays of ``shape`` = [B, Hq, L, N]."""
    B, Hq, L, N = shape
    if mask is None:
        return np.ones(shape, bool), np.zeros(shape)
    if isinstance(mask, str):
        assert mask == "causal"
        # Bottom-right aligned: query l sees keys n <= l + N - L.
        vis = np.arange(N)[None, :] <= np.arange(L)[:, None] + N - L
        return np.broadcast_to(vis, shape), np.zeros(shape)
    if mask.dtype == mx.bool_:
        return np.broadcast_to(np.array(mask), shape), np.zeros(shape)
    add = np.broadcast_to(to_f64(mask), shape)
    vis = add != -np.inf  # an additive -inf hides the key
    return vis, np.where(vis, add, 0.0)


def hadamard64(D: int) -> np.ndarray:
    """The orthonormal Walsh-Hadamard matrix of order D (Sylvester's, as
    mx.hadamard_transform and scipy.linalg.hadamard order it), in float64."""
    h = np.ones((1, 1))
    while h.shape[0] < D:
        h = np.block([[h, h], [h, -h]])
    assert h.shape[0] == D, f"{D} is not a power of two"
    return h / np.sqrt(D)


def sdpa64(
    q,
    keys,
    values,
    *,
    scale,
    mask=None,
    sinks=None,
    group_size,
    bits,
    rotated=(False, False),
    v_bits=None,
    v_group_size=None,
    return_lse=False,
):
    """Reference output [B, Hq, L, Dv] in float64; rows with no visible key are 0.
    With ``return_lse`` also each row's log-sum-exp [B, Hq, L] (natural log
    of the softmax denominator, sinks included; -inf where it is empty).

    Values are dequantized with ``v_bits`` / ``v_group_size`` when given,
    else with the keys' ``bits`` / ``group_size``.

    ``rotated``: (keys, values) stored in the Hadamard basis (mlxq.rotation);
    their rows are rotated back in float64 first, so the reference is the
    attention over the unrotated keys and values, with the queries as given.
    """
    q64 = to_f64(q)  # exactly as given; scale is applied in float64
    k64 = dequantize64(keys, group_size, bits)
    v64 = dequantize64(
        values,
        group_size if v_group_size is None else v_group_size,
        bits if v_bits is None else v_bits,
    )
    if rotated[0]:
        k64 = k64 @ hadamard64(k64.shape[-1])  # symmetric: rows times H = H times rows
    if rotated[1]:
        v64 = v64 @ hadamard64(v64.shape[-1])
    B, Hq, L, _ = q64.shape
    Hkv, N, Dv = v64.shape[1], v64.shape[2], v64.shape[3]
    rep = Hq // Hkv
    visible, additive = mask64(mask, (B, Hq, L, N))
    sink64 = None if sinks is None else to_f64(sinks)

    out = np.zeros((B, Hq, L, Dv))
    lse = np.full((B, Hq, L), -np.inf)
    for b in range(B):
        for h in range(Hq):
            kvh = h // rep  # GQA: consecutive query heads share a KV head
            s = scale * (q64[b, h] @ k64[b, kvh].T) + additive[b, h]
            vis = visible[b, h]
            s = np.where(vis, s, -np.inf)
            m = s.max(axis=-1, keepdims=True)
            if sink64 is not None:
                m = np.maximum(m, sink64[h])
            live = vis.any(axis=-1)
            m = np.where(live[:, None], m, 0.0)  # no inf - inf on dead rows
            p = np.where(vis, np.exp(s - m), 0.0)
            denom = p.sum(axis=-1, keepdims=True)
            if sink64 is not None:
                denom = denom + np.exp(sink64[h] - m)
            o = (p @ v64[b, kvh]) / np.where(live[:, None], denom, 1.0)
            out[b, h] = np.where(live[:, None], o, 0.0)
            with np.errstate(divide="ignore"):
                lse[b, h] = m[:, 0] + np.log(denom[:, 0])
    return (out, lse) if return_lse else out
