"""One reused buffer per stream for the dense K/V of a routed prefill layer.

A prefill layer routed to MLX's fused attention (:mod:`mlxq.routing`) needs
its K and V dequantized: an ``O(N * D)`` copy of one layer. On CUDA and Metal
every layer writes into the same two buffers of its stream, each write
ordered after the previous routed attention, and the buffers are dropped at
the next decode-sized call on the stream (csrc/prefill_workspace.h says
why). :func:`mlxq.quantized_sdpa` does all of this itself; these functions
are for tests and benchmarks.
"""

from typing import Optional, Tuple

import mlx.core as mx

from . import _ext

# Backends with a DequantizeInto kernel. Metal's (metal/dequantize.metal) is
# verified on the emulator only.
BACKENDS = ("cuda", "metal")


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
    return _ext._workspace_dequantize_kv(
        *keys,
        *values,
        group_size=group_size,
        bits=bits,
        v_group_size=v_group_size or group_size,
        v_bits=v_bits or bits,
        dtype=dtype,
        stream=stream,
    )


def note_reader(stream, out: mx.array) -> None:
    """``out`` read this stream's workspace: the next write waits for it."""
    _ext._workspace_note_reader(out, stream=stream)


def release(stream=None) -> None:
    """Drops the workspaces of ``stream`` (a stream or device; None: the
    default stream); their memory returns once in-flight work is done."""
    _ext._workspace_release(stream=stream)


def release_all() -> None:
    """Drops every stream's workspaces."""
    _ext._workspace_release_all()


def held_bytes(stream: Optional[mx.Stream] = None) -> int:
    """Bytes of workspace held (all streams, or one)."""
    return _ext._workspace_held_bytes(stream)
