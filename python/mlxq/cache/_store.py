"""Buffer operations of the caches, for plain arrays and quantized triples.

A cache keeps its keys and values either as plain arrays ``[B, H, S, D]`` or
as ``(packed, scales, biases)`` triples exactly as :func:`mx.quantize` returns
them, every component with the sequence on axis 2. :class:`Plain` and
:class:`Quantized` give both layouts the same few operations, so each cache's
bookkeeping (growth, ring rotation, temporal order) is written once.

Writes go through the ring primitives. A cache passes ``owned=True`` for
buffers it made itself (the only holder): those are written in place even
while MLX's in-flight command buffers or earlier fetches still share their
memory (see ``QuantizedKVUpdate`` in csrc/ring_update.h). Buffers handed in
from outside (``restore``, ``state``) are written in place only when MLX says
they may be donated, else copied first.
"""

from typing import Optional, Sequence, Tuple

import mlx.core as mx

from .. import _ext
from ..quantization import BITS, GROUP_SIZES, FormattedTriple
from ..ring import quantized_ring_update
from ..rotation import RotatedTriple, mark, rotate

Triple = Tuple[mx.array, mx.array, mx.array]


class Plain:
    """Keys/values stored as they come: one array ``[B, H, S, D]``."""

    quantized = False
    key = ("plain",)  # what compiled decode graphs depend on

    def encode(self, x: mx.array, values: bool = False) -> mx.array:
        return x

    def zeros(self, like: mx.array, n: int, values: bool = False) -> mx.array:
        """``n`` zero rows in the stored layout of ``like`` ([B, H, *, D] input)."""
        B, H, _, D = like.shape
        return mx.zeros((B, H, n, D), like.dtype)

    def length(self, t: mx.array) -> int:
        return t.shape[2]

    def rows(self, t: mx.array, start=None, stop=None) -> mx.array:
        return t[..., start:stop, :]

    def concat(self, parts: Sequence[mx.array]) -> mx.array:
        return mx.concatenate(list(parts), axis=2)

    def fetched(self, t: mx.array, values: bool = False) -> mx.array:
        return t

    def map(self, t: mx.array, fn) -> mx.array:
        """``fn`` applied to the stored array (every component of a triple)."""
        return fn(t)

    def concat_batch(self, parts: Sequence[mx.array]) -> mx.array:
        """``parts`` stacked along the batch axis."""
        return mx.concatenate(list(parts), axis=0)

    def pad_rows(self, t: mx.array, before: int, after: int, values: bool = False) -> mx.array:
        """``t`` with ``before`` and ``after`` rows of encoded zeros around it."""
        return _pad_rows(self, t, before, after, values)

    def write_kv(self, keys, values, new_keys, new_values, pos: int, owned: bool):
        """One step's write of K and V rows at ``pos`` (two ring updates)."""
        return (
            _ext.ring_update(keys, new_keys, pos, owned=owned),
            _ext.ring_update(values, new_values, pos, owned=owned),
        )

    def write_and_fetch(self, keys, values, new_keys, new_values, pos: int, stop: int):
        """An owned write at ``pos``, then rows [0, stop): (buffers..., views...)."""
        k, v = self.write_kv(keys, values, new_keys, new_values, pos, True)
        return k, v, self.rows(k, stop=stop), self.rows(v, stop=stop)

    def scheduled(self, t: mx.array) -> bool:
        """Whether an evaluation has taken ``t`` (see rotating.overwrite_in_place)."""
        return _ext._scheduled(t)

    def head_dim(self, t: mx.array, values: bool = False) -> int:
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
    """Keys/values stored quantized along the head dimension (a triple).

    Keys take ``(group_size, bits)``; values take ``(v_group_size, v_bits)``
    when given (for example 8-bit keys with 4-bit values), else the same.
    With separate value quantization every value fetch is a
    :class:`~mlxq.quantization.FormattedTriple`, which tells attention its
    width. With ``rotate``, rows are quantized in the Hadamard basis
    (mlxq.rotation): every write rotates its new rows first, and every fetch
    is a :class:`~mlxq.rotation.RotatedTriple`, which attention undoes.

    Methods that take one tensor take ``values=True`` for the values' side.
    """

    quantized = True

    def __init__(
        self,
        group_size: int,
        bits: int,
        rotate: bool = False,
        v_group_size: Optional[int] = None,
        v_bits: Optional[int] = None,
    ):
        self.group_size = group_size
        self.bits = bits
        self.v_group_size = group_size if v_group_size is None else v_group_size
        self.v_bits = bits if v_bits is None else v_bits
        self.rotate = rotate
        self.separate = (self.v_group_size, self.v_bits) != (group_size, bits)
        self.key = ("quantized", group_size, bits, self.v_group_size, self.v_bits, rotate)

    def format(self, values: bool = False) -> Tuple[int, int]:
        """``(group_size, bits)`` of one side."""
        return (self.v_group_size, self.v_bits) if values else (self.group_size, self.bits)

    def _basis(self, x: mx.array) -> mx.array:
        return rotate(x) if self.rotate else x

    def encode(self, x: mx.array, values: bool = False) -> Triple:
        gs, bits = self.format(values)
        return tuple(mx.quantize(self._basis(x), group_size=gs, bits=bits))

    def zeros(self, like: mx.array, n: int, values: bool = False) -> Triple:
        B, H, _, D = like.shape
        gs, bits = self.format(values)
        return (
            mx.zeros((B, H, n, D * bits // 32), mx.uint32),
            mx.zeros((B, H, n, D // gs), like.dtype),
            mx.zeros((B, H, n, D // gs), like.dtype),
        )

    def length(self, t: Triple) -> int:
        return t[0].shape[2]

    def rows(self, t: Triple, start=None, stop=None) -> Triple:
        return tuple(a[..., start:stop, :] for a in t)

    def fetched(self, t: Triple, values: bool = False) -> Triple:
        """``t`` as a cache hands it out: values carry their format when it
        differs from the keys'; marked when rotated."""
        if values and self.separate:
            t = FormattedTriple(t, self.v_group_size, self.v_bits)
        return mark(t) if self.rotate else t

    def concat(self, parts: Sequence[Triple]) -> Triple:
        return tuple(mx.concatenate([p[i] for p in parts], axis=2) for i in range(3))

    def map(self, t: Triple, fn) -> Triple:
        return tuple(fn(a) for a in t)

    def concat_batch(self, parts: Sequence[Triple]) -> Triple:
        return tuple(mx.concatenate([p[i] for p in parts], axis=0) for i in range(3))

    def pad_rows(self, t: Triple, before: int, after: int, values: bool = False) -> Triple:
        # Encoded zeros, not zero words: mx.quantize of a zero row has a
        # nonzero scale, and padding must read as the quantized zeros an
        # unquantized cache's padding becomes.
        return _pad_rows(self, t, before, after, values)

    def write_kv(self, keys, values, new_keys, new_values, pos: int, owned: bool):
        """One step's write of K and V rows at ``pos``: owned buffers take one
        ``QuantizedKVUpdate`` (one launch); others a ring update per array."""
        if owned:
            return self._kv_update(keys, values, new_keys, new_values, pos, fetch=-1)
        new_keys, new_values = self._basis(new_keys), self._basis(new_values)
        gs, bits = self.format()
        vgs, vbits = self.format(values=True)
        return (
            quantized_ring_update(keys, new_keys, pos, group_size=gs, bits=bits),
            quantized_ring_update(values, new_values, pos, group_size=vgs, bits=vbits),
        )

    def write_and_fetch(self, keys, values, new_keys, new_values, pos: int, stop: int):
        """An owned write at ``pos``, then rows [0, stop) of every array, in
        one call: (K triple, V triple, K views, V views)."""
        return self._kv_update(keys, values, new_keys, new_values, pos, fetch=stop)

    def _kv_update(self, keys, values, new_keys, new_values, pos: int, fetch: int):
        return _ext.quantized_kv_update(
            *keys,
            *values,
            self._basis(new_keys),
            self._basis(new_values),
            pos,
            group_size=self.group_size,
            bits=self.bits,
            fetch=fetch,
            v_group_size=self.v_group_size,
            v_bits=self.v_bits,
        )

    def scheduled(self, t: Triple) -> bool:
        return _ext._scheduled(t[0])

    def head_dim(self, t: Triple, values: bool = False) -> int:
        return t[0].shape[3] * 32 // self.format(values)[1]

    def dtype(self, t: Triple):
        return t[1].dtype

    def nbytes(self, t: Triple) -> int:
        return sum(a.nbytes for a in t)

    def check(self, t, name: str, where: str) -> Triple:
        """``t`` validated as the ``name`` ("keys" or "values") side's triple."""
        if not (
            isinstance(t, (tuple, list))
            and len(t) == 3
            and all(isinstance(a, mx.array) and a.ndim == 4 for a in t)
        ):
            raise ValueError(
                f"[{where}] {name} must be a (packed, scales, biases) triple of 4-D "
                f"arrays as mx.quantize returns, got {_describe(t)}."
            )
        packed, scales, biases = t
        gs, bits = self.format(values=name == "values")
        groups = packed.shape[3] * 32 / (bits * gs)
        if (
            packed.dtype != mx.uint32
            or scales.shape != biases.shape
            or packed.shape[:3] != scales.shape[:3]
            or groups != scales.shape[3]
        ):
            raise ValueError(
                f"[{where}] {name} is not a triple of bits={bits}, group_size={gs}: {_describe(t)}."
            )
        return t if isinstance(t, RotatedTriple) else tuple(t)


def _pad_rows(store, t, before: int, after: int, values: bool):
    if not before and not after:
        return t
    first = t[0] if store.quantized else t
    B, H = first.shape[:2]
    zeros = store.encode(
        mx.zeros((B, H, max(before, after), store.head_dim(t, values)), store.dtype(t)), values
    )
    parts = [store.rows(zeros, stop=before)] if before else []
    parts.append(t)
    if after:
        parts.append(store.rows(zeros, stop=after))
    return store.concat(parts)


def _describe(t) -> str:
    if isinstance(t, (tuple, list)):
        return "(" + ", ".join(_describe(a) for a in t) + ")"
    if isinstance(t, mx.array):
        return f"{str(t.dtype).rsplit('.', 1)[-1]} {tuple(t.shape)}"
    return type(t).__name__


def check_quantization(group_size, bits, where: str, prefix: str = "") -> None:
    """ValueError unless mlxq's kernels take (group_size, bits); ``prefix``
    ("v_") names the values' own."""
    if bits not in BITS:
        raise ValueError(f"[{where}] {prefix}bits must be one of {BITS}, got {bits!r}.")
    if group_size not in GROUP_SIZES:
        raise ValueError(
            f"[{where}] {prefix}group_size must be one of {GROUP_SIZES}, got {group_size!r}."
        )
