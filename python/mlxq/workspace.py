"""One reused buffer per stream for the dense K/V of a routed prefill layer.

A prefill layer routed to MLX's fused attention (:mod:`mlxq.routing`) needs
its K and V dequantized: an ``O(N * D)`` copy of one layer. ``mx.dequantize``
would make a fresh one per layer, and MLX's GPU backends keep every kernel's
inputs until the command buffer (Metal) or CUDA graph that ran it completes,
with several in flight: at 128k tokens on an 8B model (0.5 GB per layer)
tens of layers' copies were alive at once. So on CUDA and Metal every layer
writes into the same two buffers (``_ext.dequantize_into``), each write
ordered after the previous routed attention, the last reader of their
contents.

The buffers grow geometrically with the context and are dropped at the next
decode-sized call on the same stream (:func:`release`), so a generation does not keep a layer's
worth of dense K/V after its prefill.
"""

from typing import Dict, Optional, Tuple

import mlx.core as mx

from . import _ext

# Backends with a DequantizeInto kernel (elsewhere the route uses mx.dequantize).
# Metal's (metal/dequantize.metal) is verified on the emulator only.
BACKENDS = ("cuda", "metal")

_buffers: Dict[Tuple[str, str, str], mx.array] = {}
_last_reader: Dict[str, mx.array] = {}


def _stream_key(stream) -> str:
    if stream is None:
        stream = mx.default_stream(mx.default_device())
    elif isinstance(stream, mx.Device):
        stream = mx.default_stream(stream)
    return str(stream)


def _buffer(key, elements: int, dtype, stream) -> mx.array:
    buf = _buffers.get(key)
    if buf is None or buf.size < elements:
        size = max(elements, 2 * buf.size) if buf is not None else elements
        # mx.zeros materialises a full buffer (not a broadcast scalar), so the
        # kernel can write into it.
        buf = mx.zeros((size,), dtype=dtype, stream=stream)
        _buffers[key] = buf
    return buf


def dequantize_kv(
    keys,
    values,
    *,
    group_size: int,
    bits: int,
    dtype,
    stream,
    v_group_size: Optional[int] = None,
    v_bits: Optional[int] = None,
) -> Tuple[mx.array, mx.array]:
    """K and V dequantized into this stream's workspace buffers, after the
    previous routed attention on the stream (V with ``v_bits`` /
    ``v_group_size`` when given). Pair with :func:`note_reader`."""
    skey = _stream_key(stream)
    after = [_last_reader[skey]] if skey in _last_reader else []
    out = []
    sides = (
        ("k", keys, group_size, bits),
        ("v", values, v_group_size or group_size, v_bits or bits),
    )
    for name, (packed, scales, biases), group_size, bits in sides:
        B, H, N, W = packed.shape
        elements = B * H * N * (W * 32 // bits)
        buf = _buffer((skey, name, str(dtype)), elements, dtype, stream)
        out.append(
            _ext.dequantize_into(
                buf,
                packed,
                scales,
                biases,
                group_size=group_size,
                bits=bits,
                after=after,
                stream=stream,
            )
        )
    return out[0], out[1]


def note_reader(stream, out: mx.array) -> None:
    """``out`` read this stream's workspace: the next write waits for it."""
    _last_reader[_stream_key(stream)] = out


def release(stream=None) -> None:
    """Drops the workspaces of ``stream`` (a stream or device; None: the
    default stream); their memory returns once in-flight work is done."""
    if not (_buffers or _last_reader):
        return
    skey = _stream_key(stream)
    for key in [k for k in _buffers if k[0] == skey]:
        del _buffers[key]
    _last_reader.pop(skey, None)


def release_all() -> None:
    """Drops every stream's workspaces."""
    _buffers.clear()
    _last_reader.clear()


def held_bytes(stream: Optional[mx.Stream] = None) -> int:
    """Bytes of workspace held (all streams, or one)."""
    skey = None if stream is None else _stream_key(stream)
    return sum(b.nbytes for k, b in _buffers.items() if skey is None or k[0] == skey)
