"""Ring-buffer writes into (quantized) KV-cache buffers."""

from typing import Sequence, Tuple, Union

import mlx.core as mx

from . import _ext

Position = Union[int, mx.array]


def ring_update(
    buffer: mx.array,
    update: mx.array,
    pos: Position,
    *,
    stream: Union[None, mx.Stream, mx.Device] = None,
) -> mx.array:
    """Write ``update`` into ``buffer`` at sequence position ``pos``, wrapping.

    Row ``t`` of ``update`` lands on sequence row ``(pos + t) % S``, so one
    write may straddle the end of the ring. The write is in place when
    ``buffer`` can be donated (drop your other references first:
    ``keys = mlxq.ring_update(keys, k, pos)``); otherwise the result is a
    copy and ``buffer`` is left unchanged.

    Args:
        buffer (array): ``[B, H, S, D]``.
        update (array): ``[B, H, T, D]`` with ``T <= S``, same dtype as ``buffer``.
        pos (int or array): Start position, ``>= 0``. Pass an int32 array in a
          compiled decode step so that it does not retrace per token; an
          array position is taken modulo ``S``.
        stream (Stream, optional): Stream or device to run on.

    Returns:
        array: The updated ``[B, H, S, D]`` buffer.
    """
    return _ext.ring_update(buffer, update, pos, stream=stream)


def quantized_ring_update(
    buffer: Sequence[mx.array],
    update: mx.array,
    pos: Position,
    *,
    group_size: int,
    bits: int,
    stream: Union[None, mx.Stream, mx.Device] = None,
) -> Tuple[mx.array, mx.array, mx.array]:
    """Quantize ``update`` and write it into a quantized ring buffer, in place.

    Each new row is quantized exactly as ``mx.quantize(update, group_size,
    bits)`` does on this backend (bit-identical codes, scales and biases), and
    written at sequence row ``(pos + t) % S`` of all three arrays, each by
    its own single-output primitive (so that each array can be donated).

    Args:
        buffer (tuple(array, array, array)): ``(packed, scales, biases)`` of
          ``S`` rows, as ``mx.quantize`` returns for ``[B, H, S, D]``.
        update (array): ``[B, H, T, D]`` in the dtype of the scales.
        pos (int or array): Start position (see :func:`ring_update`).
        group_size (int): Quantization group size (32, 64 or 128).
        bits (int): Bits per element (2, 3, 4, 5, 6 or 8).
        stream (Stream, optional): Stream or device to run on.

    Returns:
        tuple(array, array, array): The updated ``(packed, scales, biases)``.
    """
    if not (isinstance(buffer, (tuple, list)) and len(buffer) == 3):
        raise ValueError(
            "[mlxq.quantized_ring_update] buffer must be a (packed, scales, biases) triple."
        )
    return _ext.quantized_ring_update(
        *buffer, update, pos, group_size=group_size, bits=bits, stream=stream
    )
