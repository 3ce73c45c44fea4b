"""Attention entry points: plain K/V go to MLX, quantized triples to mlxq."""

from typing import Optional, Sequence, Tuple, Union

import mlx.core as mx

from . import _ext, routing, workspace
from .quantization import triple_format
from .rotation import check_head_dim, is_rotated, rotate

QuantizedTensor = Tuple[mx.array, mx.array, mx.array]
Mask = Union[None, str, mx.array]


def is_quantized(x) -> bool:
    """True for a ``(packed, scales, biases)`` triple as ``mx.quantize`` returns."""
    return isinstance(x, (tuple, list)) and len(x) == 3


def _split_mask(mask: Mask):
    if mask is None:
        return "", None
    if isinstance(mask, str):
        return mask, None
    if isinstance(mask, mx.array):
        return "", mask
    raise ValueError(
        f'[mlxq.sdpa] mask must be None, "causal" or an mx.array, got {type(mask).__name__}.'
    )


def quantized_sdpa(
    q: mx.array,
    keys: Sequence[mx.array],
    values: Sequence[mx.array],
    *,
    scale: float,
    mask: Mask = None,
    sinks: Optional[mx.array] = None,
    group_size: Optional[int] = None,
    bits: Optional[int] = None,
    v_bits: Optional[int] = None,
    v_group_size: Optional[int] = None,
    stream: Union[None, mx.Stream, mx.Device] = None,
) -> mx.array:
    """Fused scaled dot-product attention over affine-quantized keys and values.

    Computes ``softmax(scale * q @ dequantize(K).T + mask) @ dequantize(V)``
    without dequantizing ``K`` or ``V`` to memory: each key and value row is
    unpacked once, in registers, for all the query heads that share it.

    Args:
        q (array): Queries ``[B, H_q, L, D_k]`` in float32, float16 or bfloat16.
        keys (tuple(array, array, array)): ``(packed, scales, biases)`` of keys
          ``[B, H_kv, N, D_k]`` as returned by :func:`mx.quantize`. May be a
          strided view, such as ``buffer[..., :offset, :]`` of a cache; it is
          read in place.
        values (tuple(array, array, array)): The same for values
          ``[B, H_kv, N, D_v]``. Either may be a
          :class:`~mlxq.rotation.RotatedTriple` (a ``kv_rotate`` cache's
          fetch: rows quantized in the Hadamard basis); the queries, or the
          output, are then rotated to match, so the result is the attention
          over the unrotated keys and values. Values may also be a
          :class:`~mlxq.quantization.FormattedTriple` that carries its own
          ``bits`` / ``group_size`` (a cache with separate K/V quantization).
        scale (float): Scale applied to ``q @ K.T``.
        mask (str or array, optional): ``None``, ``"causal"`` (bottom-right
          aligned, as :func:`mx.fast.scaled_dot_product_attention`), or an
          array broadcastable to ``[B, H_q, L, N]``: bool (``True`` attends) or
          additive. Default: ``None``.
        sinks (array, optional): Per-head logits ``[H_q]`` added to the softmax
          denominator (attention sinks). Default: ``None``.
        group_size (int, optional): Quantization group size of the keys (32,
          64 or 128). Inferred from the shapes when omitted.
        bits (int, optional): Bits per element of the keys (2, 3, 4, 5, 6 or
          8). Inferred from the shapes when omitted.
        v_bits (int, optional): Bits per element of the values, when they
          differ from the keys' (e.g. 8-bit keys with 4-bit values). Default:
          the keys' bits (the value head dim is inferred from it).
        v_group_size (int, optional): Group size of the values. Default:
          the keys' group size.
        stream (Stream, optional): Stream or device to run on.

    Returns:
        array: ``[B, H_q, L, D_v]`` in the dtype of ``q``. A query that sees no
        key at all (every key masked) gets zeros.

    Raises:
        ValueError: If a shape, dtype, bits/group size or mask is unsupported
          or inconsistent; the message names the offending input.
    """
    if not (is_quantized(keys) and is_quantized(values)):
        raise ValueError(
            "[mlxq.quantized_sdpa] keys and values must each be a "
            "(packed, scales, biases) triple as mx.quantize returns."
        )
    if isinstance(stream, mx.DeviceType):  # mx.cpu / mx.gpu, as MLX's ops take them
        stream = mx.Device(stream)
    # Values that carry their own quantization (a cache's separate V widths).
    carried_group, carried_bits = triple_format(values)
    v_bits = carried_bits if v_bits is None else v_bits
    v_group_size = carried_group if v_group_size is None else v_group_size
    if is_rotated(keys) and isinstance(q, mx.array):
        # Keys stored in the Hadamard basis (mlxq.rotation): scores need H q.
        check_head_dim(q.shape[-1], "mlxq.quantized_sdpa")
        q = rotate(q, stream=stream)
    mask_mode, mask_arr = _split_mask(mask)
    out = _ext.quantized_sdpa(  # validates every input, even when routed below
        q,
        *keys,
        *values,
        scale=scale,
        mask_mode=mask_mode,
        mask=mask_arr,
        sinks=sinks,
        bits=bits,
        group_size=group_size,
        v_bits=v_bits,
        v_group_size=v_group_size,
        stream=stream,
    )
    if q.shape[2] > 8:  # decode never routes: skip the checks
        routed = _dequantized_route(
            q,
            keys,
            values,
            scale,
            mask,
            mask_mode,
            mask_arr,
            sinks,
            (bits, group_size),
            (v_bits, v_group_size),
            stream,
        )
        if routed is not None:
            out = routed
    else:  # decoding: this stream's prefill dense K/V buffers are no longer needed
        workspace.release(stream)
    if is_rotated(values):
        # Rotated values: the output comes back as H^T (P H V) = P V (H is
        # its own inverse).
        check_head_dim(out.shape[-1], "mlxq.quantized_sdpa")
        out = rotate(out, stream=stream)
    return out


def _device_of(stream) -> mx.Device:
    if stream is None:
        return mx.default_device()
    return stream.device if isinstance(stream, mx.Stream) else stream


def _dequantized_route(
    q, keys, values, scale, mask, mask_mode, mask_arr, sinks, k_quant, v_quant, stream
):
    """MLX's fused attention over this layer's dequantized K/V, where it is
    faster than mlxq's kernel (see :mod:`mlxq.routing`); None otherwise.
    ``k_quant`` / ``v_quant``: the (bits, group_size) arguments, validated."""
    device = _device_of(stream)
    backend = routing.gpu_backend() if device.type == mx.gpu else None
    if backend is None:
        return None
    Dk = q.shape[3]
    bits = k_quant[0] or keys[0].shape[3] * 32 // Dk
    group_size = k_quant[1] or Dk // keys[1].shape[3]
    v_bits = v_quant[0] or bits
    Dv = values[0].shape[3] * 32 // v_bits
    v_group_size = v_quant[1] or group_size
    kind = "array" if mask_arr is not None else ("causal" if mask_mode else "none")
    shape = dict(
        L=q.shape[2],
        N=keys[0].shape[2],
        Hq=q.shape[1],
        Hkv=keys[0].shape[1],
        Dk=Dk,
        Dv=Dv,
        dtype=q.dtype,
        scales_dtype=keys[1].dtype,
        mask_kind=kind,
    )
    sinks_dtype = None if sinks is None else sinks.dtype
    if not routing.route_through_mx_fast(backend, sinks_dtype=sinks_dtype, **shape):
        return None
    reused = backend in workspace.BACKENDS and routing.workspace_enabled()
    if reused:
        k, v = workspace.dequantize_kv(
            keys,
            values,
            group_size=group_size,
            bits=bits,
            v_group_size=v_group_size,
            v_bits=v_bits,
            dtype=q.dtype,
            stream=stream,
        )
    else:
        k = mx.dequantize(*keys, group_size=group_size, bits=bits, stream=stream)
        v = mx.dequantize(*values, group_size=v_group_size, bits=v_bits, stream=stream)
    try:
        out = mx.fast.scaled_dot_product_attention(
            q, k, v, scale=scale, mask=mask, sinks=sinks, force_fused=True, stream=stream
        )
    except (ValueError, RuntimeError):  # MLX has no fused kernel here after all
        return None
    if reused:
        workspace.note_reader(stream, out)
    routing.note_route("mx_fast")
    return out


def sdpa(
    q: mx.array,
    keys: Union[mx.array, Sequence[mx.array]],
    values: Union[mx.array, Sequence[mx.array]],
    *,
    scale: float,
    mask: Mask = None,
    sinks: Optional[mx.array] = None,
    group_size: Optional[int] = None,
    bits: Optional[int] = None,
    v_bits: Optional[int] = None,
    v_group_size: Optional[int] = None,
    stream: Union[None, mx.Stream, mx.Device] = None,
) -> mx.array:
    """Scaled dot-product attention over plain or quantized keys and values.

    Plain ``keys``/``values`` arrays go to
    :func:`mx.fast.scaled_dot_product_attention`; ``(packed, scales, biases)``
    triples go to mlxq's fused kernel (:func:`quantized_sdpa`), with bits and
    group size inferred from the shapes unless given.

    Args:
        q (array): Queries ``[B, H_q, L, D_k]``.
        keys (array or tuple): Keys ``[B, H_kv, N, D_k]``, or their quantized triple.
        values (array or tuple): Values ``[B, H_kv, N, D_v]``, or their quantized triple.
        scale (float): Scale applied to ``q @ K.T``.
        mask (str or array, optional): ``None``, ``"causal"`` or an array
          broadcastable to ``[B, H_q, L, N]`` (bool or additive).
        sinks (array, optional): Per-head attention-sink logits ``[H_q]``.
        group_size (int, optional): Quantization group size (triples only).
        bits (int, optional): Quantization bits (triples only).
        v_bits, v_group_size (int, optional): The values' own quantization,
          when it differs from the keys' (see :func:`quantized_sdpa`).
        stream (Stream, optional): Stream or device to run on.

    Returns:
        array: ``[B, H_q, L, D_v]`` in the dtype of ``q``.

    Example:
        >>> k = mx.quantize(keys, group_size=64, bits=4)
        >>> v = mx.quantize(values, group_size=64, bits=4)
        >>> out = mlxq.sdpa(q, k, v, scale=q.shape[-1] ** -0.5, mask="causal")
    """
    if is_quantized(keys) or is_quantized(values):
        return quantized_sdpa(
            q,
            keys,
            values,
            scale=scale,
            mask=mask,
            sinks=sinks,
            group_size=group_size,
            bits=bits,
            v_bits=v_bits,
            v_group_size=v_group_size,
            stream=stream,
        )
    return mx.fast.scaled_dot_product_attention(
        q, keys, values, scale=scale, mask=mask, sinks=sinks, stream=stream
    )
