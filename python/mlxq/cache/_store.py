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

from typing import Sequence, Tuple

import mlx.core as mx

from .. import _ext
from ..guard import first
from ..hadamard import transform
from ..kv_format import FormattedTriple, KVFormat
from ..kv_format import fetch as handed_out
from ..ring import quantized_ring_update

Triple = Tuple[mx.array, mx.array, mx.array]


class FormatField:
    """A cache attribute read from its quantized format (``cache.format``):
    ``group_size``, ``bits`` and the rest. An unquantized cache has none,
    so the attribute is absent there (``hasattr(cache, "bits")`` is False),
    which is how mlx-lm tells quantized caches apart."""

    NAMES = ("group_size", "bits", "v_group_size", "v_bits", "hadamard")

    def __init__(self, name: str):
        self.name = name

    def __get__(self, cache, owner=None):
        if cache is None:
            return self
        if cache.format is None:
            raise AttributeError(f"an unquantized {owner.__name__} has no {self.name}")
        return getattr(cache.format, self.name)


class Plain:
    """Keys/values stored as they come: one array ``[B, H, S, D]``."""

    quantized = False
    key = ("plain",)  # what compiled decode graphs depend on

    def extras(self) -> tuple:
        """The trailing ``state`` entries of this storage: none."""
        return ()

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
    """Keys/values stored quantized along the head dimension (a triple), in
    a :class:`~mlxq.kv_format.KVFormat`: keys take ``(group_size, bits)``,
    values their own ``(v_group_size, v_bits)``. In the Hadamard basis
    (``hadamard``; mlxq.hadamard) every write transforms its new rows
    first. Fetches in a format only mlxq reads are
    :class:`~mlxq.kv_format.FormattedTriple`, which tell attention.

    Methods that take one tensor take ``values=True`` for the values' side.
    """

    quantized = True

    def __init__(self, format: KVFormat):
        self.format = format
        self.key = ("quantized", format)  # what compiled decode graphs depend on

    def side(self, values: bool = False) -> Tuple[int, int]:
        """``(group_size, bits)`` of one side."""
        return self.format.side(values)

    def extras(self) -> tuple:
        """The trailing ``state`` entries of the format (KVFormat.extras)."""
        return self.format.extras()

    def _basis(self, x: mx.array) -> mx.array:
        return transform(x) if self.format.hadamard else x

    def encode(self, x: mx.array, values: bool = False) -> Triple:
        gs, bits = self.side(values)
        return tuple(mx.quantize(self._basis(x), group_size=gs, bits=bits))

    def zeros(self, like: mx.array, n: int, values: bool = False) -> Triple:
        B, H, _, D = like.shape
        gs, bits = self.side(values)
        return (
            mx.zeros((B, H, n, D * bits // 32), mx.uint32),
            mx.zeros((B, H, n, D // gs), like.dtype),
            mx.zeros((B, H, n, D // gs), like.dtype),
        )

    def length(self, t: Triple) -> int:
        return first(t).shape[2]  # a fetch too

    def rows(self, t: Triple, start=None, stop=None) -> Triple:
        return tuple(a[..., start:stop, :] for a in t)

    def fetched(self, t: Triple, values: bool = False) -> Triple:
        """``t`` as a cache hands it out (see mlxq.kv_format.fetch)."""
        return handed_out(t, self.format, values)

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
        gs, bits = self.side()
        vgs, vbits = self.side(values=True)
        return (
            quantized_ring_update(keys, new_keys, pos, group_size=gs, bits=bits),
            quantized_ring_update(values, new_values, pos, group_size=vgs, bits=vbits),
        )

    def write_and_fetch(self, keys, values, new_keys, new_values, pos: int, stop: int):
        """An owned write at ``pos``, then rows [0, stop) of every array, in
        one call: (K triple, V triple, K views, V views)."""
        return self._kv_update(keys, values, new_keys, new_values, pos, fetch=stop)

    def write_recent(self, keys, values, new_keys, new_values, pos, rings, ring_pos=None):
        """An owned write at ``pos`` that also writes the rows, as they came,
        into a recent window's rings ``(keys, values, owned)`` at ``pos``, or
        at ``ring_pos`` (a sliding-window ring's buffers are written at its
        index, the window at the token's position) (RecentWindow.decode_rings):
        one op, one node. Returns the K and V triples, then the two rings (no
        fetch views: attention takes the buffers and a row count,
        RecentSplit.rows)."""
        ring_k, ring_v, owned = rings
        recent = dict(
            recent_keys=ring_k, recent_values=ring_v, recent_owned=owned, recent_pos=ring_pos
        )
        if self.format.hadamard:  # the window keeps the rows out of the basis
            recent.update(recent_key_rows=new_keys, recent_value_rows=new_values)
        return self._kv_update(keys, values, new_keys, new_values, pos, -1, **recent)

    def _kv_update(self, keys, values, new_keys, new_values, pos: int, fetch: int, **recent):
        f = self.format
        return _ext.quantized_kv_update(
            *keys,
            *values,
            self._basis(new_keys),
            self._basis(new_values),
            pos,
            group_size=f.group_size,
            bits=f.bits,
            fetch=fetch,
            v_group_size=f.v_group_size,
            v_bits=f.v_bits,
            **recent,
        )

    def scheduled(self, t: Triple) -> bool:
        return _ext._scheduled(t[0])

    def head_dim(self, t: Triple, values: bool = False) -> int:
        return t[0].shape[3] * 32 // self.side(values)[1]

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
        gs, bits = self.side(values=name == "values")
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
        return t if isinstance(t, FormattedTriple) else tuple(t)


class Latent(Quantized):
    """An MLA latent cache's storage (``format.latent``): the keys' slot,
    the latent ``[B, 1, S, kv_lora_rank]``, quantized as :class:`Quantized`
    stores it; the values' slot, the RoPE keys ``[B, 1, S, rope_dim]`` the
    model multiplies itself, a plain array as :class:`Plain` stores it.

    Methods that take one tensor serve either side: a triple is the latent,
    an array the RoPE keys.
    """

    _plain = Plain()

    def _side_of(self, t):
        return self._plain if isinstance(t, mx.array) else super()

    def encode(self, x, values: bool = False):
        return self._plain.encode(x) if values else super().encode(x)

    def zeros(self, like, n: int, values: bool = False):
        return self._plain.zeros(like, n) if values else super().zeros(like, n)

    def length(self, t) -> int:
        return self._side_of(t).length(t)

    def rows(self, t, start=None, stop=None):
        return self._side_of(t).rows(t, start, stop)

    def fetched(self, t, values: bool = False):
        return t if values else super().fetched(t)

    def concat(self, parts):
        return self._side_of(parts[0]).concat(parts)

    def map(self, t, fn):
        return self._side_of(t).map(t, fn)

    def concat_batch(self, parts):
        return self._side_of(parts[0]).concat_batch(parts)

    def write_kv(self, keys, values, new_keys, new_values, pos: int, owned: bool):
        """The latent quantized into its triple, the RoPE keys written as
        they come: one write each, in place when ``owned``."""
        gs, bits = self.side()
        latent = _ext.quantized_ring_update(
            *keys, new_keys, pos, group_size=gs, bits=bits, owned=owned
        )
        return tuple(latent), _ext.ring_update(values, new_values, pos, owned=owned)

    def write_and_fetch(self, keys, values, new_keys, new_values, pos: int, stop: int):
        k, v = self.write_kv(keys, values, new_keys, new_values, pos, True)
        return k, v, self.rows(k, stop=stop), self.rows(v, stop=stop)

    def scheduled(self, t) -> bool:
        return self._side_of(t).scheduled(t)

    def head_dim(self, t, values: bool = False) -> int:
        return self._plain.head_dim(t) if values else super().head_dim(t)

    def dtype(self, t):
        return self._side_of(t).dtype(t)

    def nbytes(self, t) -> int:
        return self._side_of(t).nbytes(t)

    def check(self, t, name: str, where: str):
        if name == "values":
            return self._plain.check(t, name, where)
        return super().check(t, name, where)


def _pad_rows(store, t, before: int, after: int, values: bool):
    if not before and not after:
        return t
    first = t if isinstance(t, mx.array) else t[0]
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
