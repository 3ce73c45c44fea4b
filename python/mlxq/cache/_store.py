"""Buffer operations of the caches, for plain arrays and quantized triples.

A cache keeps its keys and values either as plain arrays ``[B, H, S, D]`` or
as ``(packed, scales, biases)`` triples exactly as :func:`mx.quantize` returns
them, every component with the sequence on axis 2. :class:`Plain` and
:class:`Quantized` give both layouts the same few operations, so each cache's
bookkeeping (growth, ring rotation, temporal order) is written once.

Writes go through the ring primitives, which update the buffer in place when
the caller holds no other reference to it.
"""

from typing import Sequence, Tuple

import mlx.core as mx

import mlxq

BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)

Triple = Tuple[mx.array, mx.array, mx.array]


class Plain:
    """Keys/values stored as they come: one array ``[B, H, S, D]``."""

    quantized = False

    def encode(self, x: mx.array) -> mx.array:
        return x

    def zeros(self, like: mx.array, n: int) -> mx.array:
        """``n`` zero rows in the stored layout of ``like`` ([B, H, *, D] input)."""
        B, H, _, D = like.shape
        return mx.zeros((B, H, n, D), like.dtype)

    def length(self, t: mx.array) -> int:
        return t.shape[2]

    def rows(self, t: mx.array, start=None, stop=None) -> mx.array:
        return t[..., start:stop, :]

    def concat(self, parts: Sequence[mx.array]) -> mx.array:
        return mx.concatenate(list(parts), axis=2)

    def write(self, buffer: mx.array, update: mx.array, pos: int) -> mx.array:
        return mlxq.ring_update(buffer, update, pos)

    def head_dim(self, t: mx.array) -> int:
        return t.shape[3]

    def dtype(self, t: mx.array):
        return t.dtype

    def nbytes(self, t: mx.array) -> int:
        return t.nbytes

    def check(self, t, name: str, where: str) -> mx.array:
        if not isinstance(t, mx.array) or t.ndim != 4:
            shape = tuple(t.shape) if isinstance(t, mx.array) else type(t).__name__
            raise ValueError(f"[{where}] {name} must be a 4-D array [B, H, S, D], got {shape}.")
        return t


class Quantized:
    """Keys/values stored quantized along the head dimension (a triple)."""

    quantized = True

    def __init__(self, group_size: int, bits: int):
        self.group_size = group_size
        self.bits = bits

    def encode(self, x: mx.array) -> Triple:
        return tuple(mx.quantize(x, group_size=self.group_size, bits=self.bits))

    def zeros(self, like: mx.array, n: int) -> Triple:
        B, H, _, D = like.shape
        return (
            mx.zeros((B, H, n, D * self.bits // 32), mx.uint32),
            mx.zeros((B, H, n, D // self.group_size), like.dtype),
            mx.zeros((B, H, n, D // self.group_size), like.dtype),
        )

    def length(self, t: Triple) -> int:
        return t[0].shape[2]

    def rows(self, t: Triple, start=None, stop=None) -> Triple:
        return tuple(a[..., start:stop, :] for a in t)

    def concat(self, parts: Sequence[Triple]) -> Triple:
        return tuple(mx.concatenate([p[i] for p in parts], axis=2) for i in range(3))

    def write(self, buffer: Triple, update: mx.array, pos: int) -> Triple:
        return tuple(
            mlxq.quantized_ring_update(
                buffer, update, pos, group_size=self.group_size, bits=self.bits
            )
        )

    def head_dim(self, t: Triple) -> int:
        return t[0].shape[3] * 32 // self.bits

    def dtype(self, t: Triple):
        return t[1].dtype

    def nbytes(self, t: Triple) -> int:
        return sum(a.nbytes for a in t)

    def check(self, t, name: str, where: str) -> Triple:
        if not (isinstance(t, (tuple, list)) and len(t) == 3
                and all(isinstance(a, mx.array) and a.ndim == 4 for a in t)):
            raise ValueError(
                f"[{where}] {name} must be a (packed, scales, biases) triple of 4-D "
                f"arrays as mx.quantize returns, got {_describe(t)}."
            )
        packed, scales, biases = t
        groups = packed.shape[3] * 32 / (self.bits * self.group_size)
        if (packed.dtype != mx.uint32 or scales.shape != biases.shape
                or packed.shape[:3] != scales.shape[:3] or groups != scales.shape[3]):
            raise ValueError(
                f"[{where}] {name} is not a triple of bits={self.bits}, "
                f"group_size={self.group_size}: {_describe(t)}."
            )
        return tuple(t)


def _describe(t) -> str:
    if isinstance(t, (tuple, list)):
        return "(" + ", ".join(_describe(a) for a in t) + ")"
    if isinstance(t, mx.array):
        return f"{str(t.dtype).rsplit('.', 1)[-1]} {tuple(t.shape)}"
    return type(t).__name__


def check_quantization(group_size, bits, where: str) -> None:
    if bits not in BITS:
        raise ValueError(f"[{where}] bits must be one of {BITS}, got {bits!r}.")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"[{where}] group_size must be one of {GROUP_SIZES}, got {group_size!r}.")
