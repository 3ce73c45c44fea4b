"""Sliding-window caches: ``RotatingKVCache`` and ``RotatingQuantizedKVCache``.

mlx-lm's ring semantics, step for step, so that fetches, offsets and masks
are bit-identical to mlx-lm's ``RotatingKVCache``:

* The buffer holds at most ``max_size`` tokens; the first ``keep`` tokens
  are never evicted, the others are overwritten oldest first.
* A one-token step writes the token at the ring index (``_idx``), wrapping
  back to ``keep`` at the end: an O(1) in-place write through the ring
  primitive. The buffer grows 256 tokens at a time until it reaches
  ``max_size``.
* A multi-token step first puts the buffer in temporal order, keeps the
  newest ``max_size - 1`` tokens (plus the ``keep`` ones) and appends the
  new tokens, so every new token sees at least ``max_size`` of context.

``RotatingQuantizedKVCache`` runs the same ring over ``mx.quantize`` triples,
which lets sliding-window models use a quantized cache (mlx-lm's
``RotatingKVCache.to_quantized`` raises).
"""

import functools
from typing import Optional

import mlx.core as mx
import numpy as np

from ..arguments import as_int
from ..kv_format import KVFormat
from ..masks import create_causal_mask
from ..split import RecentSplit, RingColumns
from . import checks, decode_step, quantized
from .base import BaseCache
from .decode_step import DecodePlan
from .recent import window_for


def overwrite_in_place(cache, prev: int) -> bool:
    """Whether a ring's one-token write may go in place without MLX's
    donation check. While the ring fills, the slot is fresh. Once it is full,
    the slot holds a token the previous fetch exposed: in place is safe only
    if an evaluation has taken the previous step's graph (generate_step's
    pipeline: it then runs first on the stream). In a lazily evaluated loop
    the previous step still reads the slot, and the write goes by MLX's
    donation rule (a copy while the buffer is shared)."""
    if not cache._owned:
        return False
    return prev < cache.max_size or cache._store.scheduled(cache.keys)


def grow_ring(cache, keys, values, written: int) -> None:
    """A ring's growth before a one-token write (mlx-lm's rule): while it
    is shorter than ``max_size`` and full (``written`` tokens), 256 more
    zero rows (up to ``max_size``), and the write goes at ``written``."""
    store = cache._store
    length = 0 if cache.keys is None else store.length(cache.keys)
    if cache.keys is not None and (written < length or length >= cache.max_size):
        return
    n = min(cache.step, cache.max_size - written)
    new_k, new_v = store.zeros(keys, n), store.zeros(values, n, values=True)
    if cache.keys is None:
        cache.keys, cache.values = new_k, new_v
    else:
        cache.keys = store.concat([cache.keys, new_k])
        cache.values = store.concat([cache.values, new_v])
    cache._owned = True  # fresh buffers, held by nobody else
    cache._idx = written


class RotatingKVCache(BaseCache):
    """mlx-lm's ``RotatingKVCache(max_size, keep=0)`` with O(1) in-place decode writes."""

    mlx_lm_name = "RotatingKVCache"
    _SCALARS = ("offset", "keep", "max_size", "_idx")

    def __init__(self, max_size: int, keep: int = 0):
        self.keys = None
        self.values = None
        self.offset = 0
        self.max_size = max_size
        self.keep = keep
        self._idx = 0
        self._configure()

    def _configure(self) -> None:
        where = self._where("__init__")
        self.max_size = as_int(self.max_size, "max_size", where, minimum=1)
        self.keep = as_int(self.keep, "keep", where, minimum=0)
        if self.keep >= self.max_size:
            raise ValueError(f"[{where}] keep ({self.keep}) must be < max_size ({self.max_size}).")

    @property
    def ring_index(self) -> int:
        """Where the next one-token step writes (mlx-lm's ``_idx``), before rotation."""
        return self._idx

    def _check_positions(self, length: int, where: str) -> None:
        if self.offset < 0:
            raise ValueError(f"[{where}] offset must be >= 0, got {self.offset}.")
        if not 0 <= self._idx <= min(length, self.offset):
            raise ValueError(
                f"[{where}] ring index {self._idx} must lie in [0, min(buffer rows "
                f"{length}, offset {self.offset})]."
            )

    # ---------------------------------------------------------------- updates
    def update_and_fetch(self, keys, values):
        """Add ``keys``/``values`` ``[B, H, T, D]``; return what attention should see.

        One token: the buffer (``[..., :offset, :]`` until it is full), in
        ring order. Several tokens: the kept context in temporal order
        followed by the new tokens.
        """
        if checks.update(self, keys, values) == 1:
            return self._update_in_place(keys, values)[0]
        return self._fetched(*self._update_concat(keys, values))

    def _trim(self, trim_size: int, v, append=None):
        """``v`` without the ``trim_size`` rows after the kept prefix, ``append``
        added (mlx-lm's ``RotatingKVCache._trim``)."""
        rows = self._store.rows
        parts = (
            [rows(v, stop=self.keep), rows(v, start=trim_size + self.keep)]
            if trim_size > 0
            else [v]
        )
        if append is not None:
            parts.append(append)
        return self._store.concat(parts)

    def _temporal_order(self, v):
        """The buffer oldest token first, cut to the tokens it holds."""
        rows, idx = self._store.rows, self._idx
        if idx == self._store.length(v):
            return v
        if idx < self.offset:  # wrapped: the oldest evictable token sits at idx
            return self._store.concat(
                [rows(v, stop=self.keep), rows(v, start=idx), rows(v, self.keep, idx)]
            )
        return rows(v, stop=idx)

    def _update_concat(self, keys, values):
        store = self._store
        new_k, new_v = store.encode(keys), store.encode(values, values=True)
        if self.keys is None:
            self.keys, self.values = new_k, new_v
        else:
            old_k = self._temporal_order(self.keys)
            old_v = self._temporal_order(self.values)
            excess = store.length(old_k) - self.max_size + 1
            self.keys = self._trim(excess, old_k, new_k)
            self.values = self._trim(excess, old_v, new_v)
        self._owned = True  # fresh buffers (quantized or concatenated here)
        self.offset += keys.shape[2]
        self._idx = store.length(self.keys)
        return self.keys, self.values

    def _update_in_place(self, keys, values, window=None):
        """A one-token write at the ring's index. With a recent ``window``
        whose rings a decode step writes (RecentWindow.decode_rings) and a
        write that may go in place, the window's rows go in the same op at
        the token's position; returns ``(fetch, step)``, ``step`` the
        window's step result then (RecentWindow.decoded), else None."""
        store, prev = self._store, self.offset
        grow_ring(self, keys, values, prev)
        self._settle_ring()
        in_place = overwrite_in_place(self, prev)
        rings = window.decode_rings(keys, prev) if window is not None and in_place else None
        step = None
        if rings is not None:
            self.keys, self.values, ring_k, ring_v = store.write_recent(
                self.keys, self.values, keys, values, self._idx, rings, prev % window.slots
            )
            step = window.decoded(ring_k, ring_v, prev)
        else:
            self.keys, self.values = store.write_kv(
                self.keys, self.values, keys, values, self._idx, in_place
            )
        self._owned = True
        self.offset += 1
        self._idx += 1
        return self.keys_and_values(), step

    def _decode_slot(self):
        """The bookkeeping of _update_in_place, without the write. While
        the ring fills, a growing buffer (see KVCache); then mlx-lm's
        ring: back to max_size rows after a longer step, the index wrapped."""
        if self.offset < self.max_size:
            if self._idx != self.offset:
                raise ValueError(
                    f"[{self._where('prepare_decode')}] a filling ring's index "
                    f"({self._idx}) must equal its offset ({self.offset})."
                )
            capacity = decode_step.grow_for(self, self.offset, limit=self.max_size)
            return DecodePlan("grow", self.offset, self.offset, capacity, 0)
        # mlx-lm's window-mask roll uses the index before the step.
        shift = (0 if self._idx >= self.max_size else self._idx) + 1
        if self._store.length(self.keys) < self.max_size:
            # Not a ring mlx-lm's updates make: leave it to eager decode.
            raise ValueError(
                f"[{self._where('prepare_decode')}] a ring that has seen {self.offset} tokens "
                f"holds only {self._store.length(self.keys)} rows (max_size {self.max_size})."
            )
        self._settle_ring()
        return DecodePlan("ring", self._idx, self.offset, self.max_size, shift)

    def _settle_ring(self) -> None:
        """Before a one-token write into a grown ring: back to max_size rows
        after a longer step, the index wrapped to ``keep``."""
        excess = self._store.length(self.keys) - self.max_size
        if excess > 0:
            self.keys = self._trim(excess, self.keys)
            self.values = self._trim(excess, self.values)
            self._owned = True
            self._idx = self.max_size
        if self._idx == self.max_size:
            self._idx = self.keep

    def _decoded(self, plan) -> None:
        self.offset += 1
        self._idx = plan.pos + 1

    # ------------------------------------------------------------ the extras
    def temporal(self):
        """Keys and values oldest first: the ``keep`` tokens, then the rest in order.

        Holds ``min(offset, max_size)`` tokens in steady decoding, and all
        the tokens the last step attended to right after a multi-token step
        (up to ``max_size - 1 + T``).
        """
        if self.keys is None:
            raise ValueError(f"[{self._where('temporal')}] the cache is empty.")
        return self._fetched(self._temporal_order(self.keys), self._temporal_order(self.values))

    def restore(self, keys, values, offset: int, ring_index: int):
        """Adopt persisted buffers with their ``offset`` and ring index; returns ``self``."""
        where = self._where("restore")
        self.offset = as_int(offset, "offset", where)
        self._idx = as_int(ring_index, "ring_index", where)
        self._adopt(keys, values, "restore")
        return self

    def size(self) -> int:
        return min(self.offset, self.max_size)

    def is_trimmable(self) -> bool:
        return self.offset < self.max_size

    def trim(self, n: int) -> int:
        """Forget the last ``n`` tokens; refused once the ring has filled up.

        Once ``offset`` reaches ``max_size`` new tokens overwrite old ones,
        so the tokens before the trimmed ones are no longer all in the
        buffer and the ring cannot go back (speculative decoding must stop
        drafting into such a cache).
        """
        n = as_int(n, "n", self._where("trim"), minimum=0)
        if n and not self.is_trimmable():
            raise ValueError(
                f"[{self._where('trim')}] cannot trim {n} tokens: the ring is full "
                f"(offset {self.offset} >= max_size {self.max_size}), older tokens are "
                "being overwritten and trimming would expose evicted positions."
            )
        n = super().trim(n)  # offset (and the recent window)
        self._idx -= n
        return n

    def make_mask(self, N: int, *, return_array: bool = False, window_size=None):
        """The mask for an ``N``-token step, exactly as mlx-lm's ``RotatingKVCache``.

        Several tokens: ``"causal"`` while it is exact, else a bool array
        ``[N, min(offset, max_size - 1) + N]``. One token: ``None``, or, when
        ``window_size < max_size`` and the window has filled, a bool vector
        over the ring in ring order.
        """
        if N > 1:
            window_size = window_size or self.max_size
            offset = min(self.max_size - 1, self.offset)
            if offset + N > window_size or return_array:
                return create_causal_mask(N, offset, window_size=window_size)
            return "causal"
        if window_size is None or self.offset < window_size or self.max_size <= window_size:
            return None
        idx = 0 if self._idx >= self.max_size else self._idx
        n = min(self.offset + 1, self.max_size)
        return mx.roll(mx.arange(n) >= n - window_size, shift=idx + 1)

    @classmethod
    def merge(cls, caches):
        """mlx-lm's ``BatchRotatingKVCache`` of ``caches`` (needs mlx-lm; like
        mlx-lm's own rings, ``keep`` tokens are not pinned in a batch)."""
        from mlx_lm.models.cache import BatchRotatingKVCache

        return BatchRotatingKVCache.merge(caches)

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
    ) -> "RotatingQuantizedKVCache":
        """The same ring, quantized as laid out (ring order and index kept;
        in the Hadamard basis with ``hadamard``, see mlxq.hadamard; values
        with ``v_group_size`` / ``v_bits`` when given; the last ``recent``
        tokens also kept exact). ``kv_rotate`` and ``keep_recent`` are
        deprecated names of ``hadamard`` and ``recent``. A ring is never an
        MLA latent cache (``latent=True`` raises)."""
        where = self._where("to_quantized")
        if latent:
            raise ValueError(
                f"[{where}] an MLA latent cache cannot be a sliding-window ring: "
                "run the model without max_kv_size."
            )
        hadamard, recent = quantized.options(where, hadamard, recent, kv_rotate, keep_recent)
        cache = RotatingQuantizedKVCache(
            self.max_size, self.keep, group_size, bits, hadamard, v_group_size, v_bits, recent
        )
        cache.offset, cache._idx = self.offset, self._idx
        if self.keys is not None:
            quantized.encode_buffers(cache, self.keys, self.values)
            if cache._recent is not None:
                cache._recent.fill(*self.temporal(), self.offset)
        return cache


class RotatingQuantizedKVCache(RotatingKVCache):
    """The ring of :class:`RotatingKVCache` over quantized triples.

    Fetches equal ``mx.quantize`` of a ``RotatingKVCache``'s fetches after
    the same updates; one-token steps quantize and write in one in-place
    primitive.

    ``recent=R`` (``R < max_size - keep``) also keeps the last ``R``
    tokens exact, as for :class:`~mlxq.QuantizedKVCache`: a one-token
    step's fetch is then the quantized ring with the window's slots hidden
    plus the exact window, both as laid out in their rings; a longer step's,
    the quantized rows before the window plus the window in order.
    """

    mlx_lm_name = "RotatingQuantizedKVCache"  # mlx-lm has no such class
    _SCALARS = RotatingKVCache._SCALARS + ("group_size", "bits")
    format = KVFormat()
    recent = 0
    to_quantized = quantized.already_quantized

    def __init__(
        self,
        max_size: int,
        keep: int = 0,
        group_size: int = 64,
        bits: int = 8,
        hadamard: bool = False,
        v_group_size: Optional[int] = None,
        v_bits: Optional[int] = None,
        recent: int = 0,
        *,
        kv_rotate: Optional[bool] = None,
        keep_recent: Optional[int] = None,
    ):
        where = self._where("__init__")
        hadamard, recent = quantized.options(where, hadamard, recent, kv_rotate, keep_recent)
        self.format = KVFormat(group_size, bits, v_group_size, v_bits, hadamard)
        self.recent = recent
        super().__init__(max_size, keep)

    def _configure(self) -> None:
        super()._configure()
        self._store = quantized.store(self)
        where = self._where("__init__")
        self.recent = as_int(self.recent, "recent", where, minimum=0)
        if self.recent >= self.max_size - self.keep:
            raise ValueError(
                f"[{where}] recent ({self.recent}) must be < max_size - keep "
                f"({self.max_size - self.keep}): the window must fit in the ring's evictable part."
            )
        self._recent = window_for(self._recent, self.recent, self.offset)

    @classmethod
    def merge(cls, caches) -> "BatchRotatingQuantizedKVCache":  # noqa: F821
        """A :class:`~mlxq.BatchRotatingQuantizedKVCache` of ``caches`` (one
        sequence each, one ``max_size``; a recent window is not carried
        over, and ``keep`` tokens are not pinned, as in mlx-lm's batches)."""
        from .batch_rotating import BatchRotatingQuantizedKVCache

        return BatchRotatingQuantizedKVCache.merge(caches)

    def update_and_fetch(self, keys, values):
        """See RotatingKVCache; with ``recent``, the fetch is a
        :class:`RecentSplit` of keys and one of values."""
        if self._recent is None:
            return super().update_and_fetch(keys, values)
        prev = self.offset
        if checks.update(self, keys, values) > 1:
            fetch, layout, step = self._update_concat(keys, values), None, None
        else:
            fetch, step = self._update_in_place(keys, values, self._recent)
            layout = self._newest_layout()
        return window_split(self, fetch, keys, values, prev, self.offset, layout, step)

    def _newest_layout(self):
        """Where a one-token step's newest tokens lie: ``(keep, span,
        newest)``, the token ``j`` steps back from the newest at slot
        ``keep + (newest - j) mod span`` (back from the slot just written,
        wrapping from ``keep`` to the buffer's end once tokens have been
        evicted)."""
        length = self._store.length(self.keys)
        if self.offset > length:
            return self.keep, length - self.keep, self._idx - 1 - self.keep
        return 0, length, self._idx - 1


def window_split(cache, fetch, keys, values, prev: int, end: int, layout=None, step=None):
    """The :class:`RecentSplit` pair of a ring's step with a recent window
    (a single ring's or a batch ring's; positions ``prev`` before the step,
    ``end`` after it). ``fetch``: a longer step's unfetched (K, V), the kept
    context then the new rows in order, cut before the window's rows; or,
    with ``layout`` (where the newest tokens lie: ``_newest_layout``), a
    one-token step's fetched ring as laid out, whose window slots are
    hidden from the quantized part and each exact row's mask column is its
    slot. ``step``: the window's step when the write op took it already
    (RotatingQuantizedKVCache._update_in_place)."""
    if step is None:
        step = cache._recent.step(keys, values, prev)
    lo, exact_k, exact_v, order = step
    qk, qv = fetch
    if layout is None:
        n = cache._store.length(qk) - (end - lo)
        qk, qv = cache._fetched(qk, qv)
        return RecentSplit(qk, exact_k, rows=n), RecentSplit(qv, exact_v, rows=n)
    keep, span, newest = layout
    t = np.arange(end - lo) if order is None else order
    # Exact row i holds position lo + t[i], (prev - lo - t[i]) steps back
    # from the newest token: column keep + (newest - prev + lo + t[i]) % span.
    columns = RingColumns(keep, span, newest - prev + lo, t)
    visible = ring_visible(cache._store.length(qk), keep, span, end - lo, newest % span)
    return RecentSplit(qk, exact_k, visible, columns), RecentSplit(qv, exact_v, visible, columns)


# Rings of up to this many rows keep their visibility masks (one per ring
# position, a row's byte each: 1 MB at most per ring shape), so that a
# decode step uploads none.
_KEPT_VISIBILITY_ROWS = 1024


@functools.lru_cache(maxsize=8)
def _visibility_table(length: int, keep: int, span: int, k: int) -> dict:
    return {}


def ring_visible(length: int, keep: int, span: int, k: int, newest: int) -> mx.array:
    """The ring's rows a one-token step reads quantized: all but the slots of
    the ``k`` newest tokens (``keep + (newest - j) mod span``, j < k), which
    it reads exactly. Kept per ring position and shared by every layer of
    one shape (an evaluated constant: no node, no upload per step). The
    second position asked of one shape (a ring whose length has stopped
    changing) makes every position's at once: an upload per decode step,
    one new mask each, would be a visible share of a GPU step's host time."""
    table = _visibility_table(length, keep, span, k) if length <= _KEPT_VISIBILITY_ROWS else None
    visible = None if table is None else table.get(newest)
    if visible is not None:
        return visible
    if table:
        table.update(_every_position(length, keep, span, k))
        return table[newest]
    visible = mx.array(_visible_rows(length, keep, span, k, np.array([newest]))[0])
    if table is not None:
        mx.eval(visible)
        table[newest] = visible
    return visible


def _visible_rows(length: int, keep: int, span: int, k: int, newest: np.ndarray) -> np.ndarray:
    """``[len(newest), length]`` bool: ring_visible's rows for each newest slot."""
    rows = np.ones((len(newest), length), dtype=np.bool_)
    hidden = keep + (newest[:, None] - np.arange(k)[None, :]) % span
    rows[np.arange(len(newest))[:, None], hidden] = False
    return rows


def _every_position(length: int, keep: int, span: int, k: int) -> dict:
    """ring_visible's mask for each newest slot in ``[0, span)``: rows of one
    upload (views of it), evaluated together."""
    table = mx.array(_visible_rows(length, keep, span, k, np.arange(span)))
    masks = [table[n] for n in range(span)]
    mx.eval(masks)
    return dict(enumerate(masks))
