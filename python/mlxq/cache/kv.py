"""Growing caches: ``KVCache`` and ``QuantizedKVCache``.

Both keep a buffer preallocated in steps of 256 tokens along the sequence and
append each update at ``offset`` through the ring primitives, in place; a full
buffer grows exactly as mlx-lm's does (cut to ``offset`` unless that is a
whole number of steps, then extended with zero steps), so buffers, fetches
and saved states match mlx-lm's bit for bit.
"""

from typing import Optional

from ..arguments import as_int
from ..kv_format import KVFormat
from ..masks import create_attention_mask
from ..split import RecentSplit
from . import checks, decode_step, quantized
from .base import BaseCache
from .decode_step import DecodePlan
from .latent import latent_fetch
from .recent import window_for


class KVCache(BaseCache):
    """mlx-lm's ``KVCache``: unquantized keys and values, grown 256 tokens at a time."""

    mlx_lm_name = "KVCache"

    def __init__(self):
        self.keys = None
        self.values = None
        self.offset = 0

    def update_and_fetch(self, keys, values):
        """Append ``keys``/``values`` ``[B, H, T, D]``; return all cached so far.

        The result is ``buffer[..., :offset, :]`` (a view of the buffer) for
        plain caches and the same slice of each component for quantized ones.
        """
        return self._append(keys, values)

    def _append(self, keys, values):
        """The update; fetches every row written, [0, offset)."""
        T = checks.update(self, keys, values)
        prev = self._used()
        stop = prev + T
        if self.keys is None or prev + T > self._store.length(self.keys):
            self._grow(keys, values, T)
        if self._owned:  # the decode path: write and fetch in one call
            self.keys, self.values, k, v = self._store.write_and_fetch(
                self.keys, self.values, keys, values, prev, stop
            )
            self._advance(T)
            return self._fetched(k, v)
        self.keys, self.values = self._store.write_kv(
            self.keys, self.values, keys, values, prev, False
        )
        self._owned = True  # donated or copied: ours alone now
        self._advance(T)
        if stop == self._store.length(self.keys):
            return self._fetched(self.keys, self.values)
        rows = self._store.rows
        return self._fetched(rows(self.keys, stop=stop), rows(self.values, stop=stop))

    def _advance(self, T: int) -> None:
        """Count ``T`` written tokens."""
        self.offset += T

    def _grow(self, keys, values, T: int) -> None:
        store, prev = self._store, self._used()
        n = (T + self.step - 1) // self.step * self.step
        new_k, new_v = self._blank(keys, n), self._blank(values, n, values=True)
        if self.keys is None:
            self.keys, self.values = new_k, new_v
            return
        if prev % self.step:
            self.keys = store.rows(self.keys, stop=prev)
            self.values = store.rows(self.values, stop=prev)
        self.keys = store.concat([self.keys, new_k])
        self.values = store.concat([self.values, new_v])
        self._owned = True  # fresh buffers, held by nobody else

    def _blank(self, like, n: int, values: bool = False):
        """``n`` empty rows for an update shaped like ``like``: zero words,
        as mlx-lm's caches grow."""
        return self._store.zeros(like, n, values)

    # The compiled step's hooks (decode_step.py).
    def _decode_slot(self):
        prev = self._used()
        capacity = decode_step.grow_for(self, prev, blank=self._blank)
        return DecodePlan("grow", prev, self.offset, capacity, 0)

    def _decoded(self, plan) -> None:
        self.offset += 1

    def make_mask(self, N: int, *, return_array: bool = False, window_size=None):
        """None, ``"causal"`` or a bool array for an ``N``-token step (mlx-lm's rule)."""
        return create_attention_mask(N, self.offset, return_array, window_size)

    def temporal(self):
        """Keys and values oldest first: for a growing cache, the fetch itself."""
        return self.keys_and_values()

    def restore(self, keys, values, offset: int, ring_index=None):
        """Adopt persisted buffers (``offset`` tokens valid); returns ``self``."""
        if ring_index is not None and ring_index != offset:
            raise ValueError(
                f"[{self._where('restore')}] a growing cache has no ring: ring_index must be "
                f"None or equal to offset ({offset}), got {ring_index}."
            )
        self.offset = offset
        self._adopt(keys, values, "restore")
        return self

    @classmethod
    def merge(cls, caches):
        """mlx-lm's ``BatchKVCache`` of ``caches`` (needs mlx-lm)."""
        from mlx_lm.models.cache import BatchKVCache

        return BatchKVCache.merge(caches)

    def to_quantized(
        self,
        group_size: int = 64,
        bits: int = 4,
        hadamard: bool = False,
        v_group_size: Optional[int] = None,
        v_bits: Optional[int] = None,
        recent: int = 0,
        *,
        kv_rotate: Optional[bool] = None,
        keep_recent: Optional[int] = None,
        latent: bool = False,
    ) -> "QuantizedKVCache":
        """The same tokens in a :class:`QuantizedKVCache` (the whole buffer is
        quantized; in the Hadamard basis with ``hadamard``, see mlxq.hadamard;
        values with ``v_group_size`` / ``v_bits`` when given; the last
        ``recent`` tokens also kept exact; an MLA latent cache with
        ``latent``). ``kv_rotate`` and ``keep_recent`` are deprecated names
        of ``hadamard`` and ``recent``."""
        where = self._where("to_quantized")
        hadamard, recent = quantized.options(where, hadamard, recent, kv_rotate, keep_recent)
        cache = QuantizedKVCache(
            group_size, bits, hadamard, v_group_size, v_bits, recent, latent=latent
        )
        cache.offset = self.offset
        if self.keys is not None:
            quantized.encode_buffers(cache, self.keys, self.values)
            if cache._recent is not None:
                cache._recent.fill(*self.keys_and_values(), self.offset)
        return cache


class QuantizedKVCache(KVCache):
    """mlx-lm's ``QuantizedKVCache``: keys and values quantized as they are written.

    Each update is quantized by the ring primitive itself (bit-identical to
    :func:`mx.quantize`) straight into the ``(packed, scales, biases)``
    buffers; fetches are triples that :func:`mlxq.sdpa` sends to the fused
    kernel. Its :class:`~mlxq.kv_format.KVFormat` (``format``):
    ``hadamard=True`` quantizes rows in the Hadamard basis (mlxq.hadamard);
    ``v_group_size`` / ``v_bits`` quantize the values apart from the keys
    (``bits=8, v_bits=4``: llama.cpp's q8_0-K / q4_0-V pairing). Either
    makes fetches :class:`~mlxq.kv_format.FormattedTriple`, which only
    mlxq's attention reads.

    ``recent=R`` also keeps the last ``R`` tokens exact (see
    mlxq.cache.recent): fetches are then :class:`RecentSplit` pairs, which
    :func:`mlxq.sdpa` attends as the quantized rows before the window plus
    the exact window (every backend; Metal's checked on an emulator only).
    The window is a runtime choice, not part of ``state``: a cache restored
    from a state or file reads its earlier tokens quantized.

    ``latent=True`` makes it an MLA latent cache (DeepSeek-V3, Kimi K2...;
    see mlxq.cache.latent): the keys' slot, the latent, is quantized and
    the values' slot, the RoPE keys, kept exact.
    """

    mlx_lm_name = "QuantizedKVCache"
    _SCALARS = ("offset", "group_size", "bits")
    format = KVFormat()
    recent = 0
    to_quantized = quantized.already_quantized

    def __init__(
        self,
        group_size: int = 64,
        bits: int = 8,
        hadamard: bool = False,
        v_group_size: Optional[int] = None,
        v_bits: Optional[int] = None,
        recent: int = 0,
        *,
        kv_rotate: Optional[bool] = None,
        keep_recent: Optional[int] = None,
        latent: bool = False,
    ):
        super().__init__()
        where = self._where("__init__")
        hadamard, recent = quantized.options(where, hadamard, recent, kv_rotate, keep_recent)
        self.format = KVFormat(group_size, bits, v_group_size, v_bits, hadamard, latent)
        self.recent = as_int(recent, "recent", where, minimum=0)
        if latent and self.recent:
            raise ValueError(
                f"[{where}] an MLA latent cache keeps no recent window (its RoPE keys are "
                "exact already): pass recent=0."
            )
        self._configure()

    def _configure(self) -> None:
        self._store = quantized.store(self)
        self._recent = window_for(self._recent, self.recent, self.offset)

    @classmethod
    def merge(cls, caches) -> "BatchQuantizedKVCache":  # noqa: F821
        """A :class:`~mlxq.BatchQuantizedKVCache` of ``caches`` (one sequence
        each), left-padded to the longest (a recent window is not carried
        over: the batch reads those tokens quantized)."""
        from .batch import BatchQuantizedKVCache

        return BatchQuantizedKVCache.merge(caches)

    def update_and_fetch(self, keys, values):
        """Append and fetch (see KVCache); with ``recent``, the
        fetch is a :class:`RecentSplit` of keys and one of values."""
        if self.format.latent:
            return latent_fetch(self, super().update_and_fetch(keys, values), keys.shape[2])
        if self._recent is None:
            return super().update_and_fetch(keys, values)
        return windowed_fetch(self, keys, values)


def windowed_fetch(cache, keys, values):
    """Append to a growing cache with a recent window and fetch the
    :class:`RecentSplit` pair: the quantized rows before the window, then the
    window's exact rows. The quantized part is the buffers' rows through the
    step's own (``rows``: the count before the window), so a prefill step
    routed to MLX's attention dequantizes them at once and writes the exact
    rows over the window's and the step's (csrc/prefill_route.h: ExactRows).
    Positions are the buffer's rows (``_used()``: a batch's rows, which
    every sequence shares, or a single cache's offset)."""
    prev, window = cache._used(), cache._recent
    fetch = _window_decode(cache, keys, values, prev, window)
    if fetch is not None:
        return fetch
    qk, qv = cache._append(keys, values)
    lo, exact_k, exact_v, order = window.step(keys, values, prev)
    columns = None if order is None else lo + order  # a decode step over buffers not its own
    return (
        RecentSplit(qk, exact_k, None, columns, rows=lo),
        RecentSplit(qv, exact_v, None, columns, rows=lo),
    )


def _window_decode(cache, keys, values, prev: int, window):
    """A decode step (one token, the window full, buffers the cache's own)
    as one op that writes the token into the quantized buffers and into the
    window's rings (RecentWindow.decode_rings), and its fetch: the whole
    buffers with the row count before the window (RecentSplit.rows), and
    the rings as laid out. None for any other step. This runs for every
    generated token of every layer, so it does only what such a step
    needs."""
    if not cache._owned or cache.keys is None or keys.shape[2] != 1:
        return None  # (a longer step's update is checked once, by _append)
    if checks.update(cache, keys, values) != 1:
        return None
    rings = window.decode_rings(keys, prev)
    if rings is None:
        return None
    store = cache._store
    if prev == store.length(cache.keys):
        cache._grow(keys, values, 1)
    cache.keys, cache.values, ring_k, ring_v = store.write_recent(
        cache.keys, cache.values, keys, values, prev, rings
    )
    cache._advance(1)
    lo, exact_k, exact_v, order = window.decoded(ring_k, ring_v, prev)
    qk, qv = cache._fetched(cache.keys, cache.values)  # whole buffers, rows [0, lo)
    columns = lo + order
    return (
        RecentSplit(qk, exact_k, None, columns, rows=lo),
        RecentSplit(qv, exact_v, None, columns, rows=lo),
    )


__all__ = ["KVCache", "QuantizedKVCache", "windowed_fetch"]
