"""The sliding-window batch cache: mlx-lm's ``BatchRotatingKVCache``, quantized.

Each sequence keeps at most ``max_size`` tokens in a ring shared by the
batch (see batch.py for the batch side). Step for step as mlx-lm's:

* a one-token step writes every sequence's token at ring row ``_idx``,
  in place, wrapping to row 0 once the ring has ``max_size`` rows (then
  ``rotated``);
* a longer step puts the ring in temporal order, keeps the newest
  ``max_size - 1`` rows and appends the new ones, so each new token sees at
  least ``max_size`` of context;
* ``prepare(lengths=, right_padding=)`` makes that longer step roll each
  right-padded sequence first, so padding never evicts its tokens.

``recent=R`` (``R < max_size``) keeps every sequence's last ``R`` tokens
exact, as :class:`~mlxq.RotatingQuantizedKVCache` does for one sequence: a
:class:`~mlxq.cache.recent.RecentWindow` over the ring's written rows
(``_offset``), which every sequence shares (see batch_recent.py for how
the batch operations move it).

mlx-lm's own class raises in ``to_quantized``; this one is what its
``to_quantized`` returns while :mod:`mlxq.mlx_lm` is enabled.
"""

from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from ..arguments import as_int
from ..kv_format import KVFormat
from ..masks import left_padded
from . import batch_recent, batch_rows, checks, decode_step, quantized
from .base import BaseCache
from .batch_rows import host_ints, set_rows
from .decode_step import DecodePlan
from .decode_step import remember_mask as _remember_mask
from .recent import window_for
from .rotating import RotatingQuantizedKVCache, grow_ring, overwrite_in_place, window_split


@batch_rows.batch_side
class BatchRotatingQuantizedKVCache(BaseCache):
    """A batch of quantized rings of ``max_size`` rows (mlx-lm's ``BatchRotatingKVCache``)."""

    mlx_lm_name = "BatchRotatingQuantizedKVCache"  # mlx-lm has no such class
    format = KVFormat()
    recent = 0
    to_quantized = quantized.already_quantized

    def __init__(
        self,
        max_size: int,
        left_padding: Sequence[int],
        group_size: int = 64,
        bits: int = 8,
        hadamard: bool = False,
        v_group_size: Optional[int] = None,
        v_bits: Optional[int] = None,
        recent: int = 0,
        *,
        kv_rotate: Optional[bool] = None,
    ):
        self.keys = None
        self.values = None
        where = self._where("__init__")
        self.max_size = as_int(max_size, "max_size", where, minimum=1)
        hadamard, recent = quantized.options(where, hadamard, recent, kv_rotate=kv_rotate)
        self.format = KVFormat(group_size, bits, v_group_size, v_bits, hadamard)
        self.recent = recent
        self._idx = 0
        self._offset = 0  # tokens written to the ring (the batch's longest)
        self.rotated = False
        self._lengths = None  # each sequence's true end during a right-padded prefill
        batch_rows.init_rows(self, left_padding)
        self._configure()

    def _configure(self) -> None:
        self._store = quantized.store(self)
        where = self._where("__init__")
        self.recent = as_int(self.recent, "recent", where, minimum=0)
        if self.recent and self.recent >= self.max_size:
            raise ValueError(
                f"[{where}] recent ({self.recent}) must be < max_size ({self.max_size}): "
                "the window must fit in the ring."
            )
        # (from_state configures before the ring's positions are known)
        self._recent = window_for(self._recent, self.recent, getattr(self, "_offset", 0))

    def _used(self) -> int:
        return min(self._offset, self._store.length(self.keys))

    # ------------------------------------------------------------- writes
    def update_and_fetch(self, keys, values):
        """One token: written at ring row ``_idx``, the ring returned in ring
        order. Several: the kept context in temporal order, then the new rows.
        With ``recent``, a :class:`RecentSplit` of keys and one of values:
        as :class:`~mlxq.RotatingQuantizedKVCache` splits its fetches."""
        batch_rows.check_batch(self, keys)
        one = checks.update(self, keys, values) == 1
        prev = self._offset
        if self._recent is None:
            return (
                self._update_in_place(keys, values)
                if one
                else self._fetched(*self._update_concat(keys, values))
            )
        if one:
            fetch, layout = self._update_in_place(keys, values), self._newest_layout()
        else:
            fetch, layout = self._update_concat(keys, values), None
        return window_split(self, fetch, keys, values, prev, self._offset, layout)

    def _newest_layout(self):
        """Where a one-token step's newest tokens lie (see
        RotatingQuantizedKVCache._newest_layout): back from the slot just
        written, wrapping over the whole buffer (a batch ring keeps no
        tokens; one still filling has spare rows past ``_idx``, which the
        wrap never reaches)."""
        return 0, self._store.length(self.keys), self._idx - 1

    def _to_temporal_order(self) -> None:
        """Unroll a wrapped ring so that row 0 is the oldest."""
        if self.rotated:
            shift = -self._idx
            self.keys, self.values = (
                self._store.map(t, lambda a: mx.roll(a, shift, axis=2))
                for t in (self.keys, self.values)
            )
            self._owned = True
            self._idx = self._store.length(self.keys)
            self.rotated = False

    def _trim(self, trim_size: int, t, append=None):
        if trim_size > 0:
            t = self._store.rows(t, start=trim_size)
        return t if append is None else self._store.concat([t, append])

    def _update_concat(self, keys, values):
        store = self._store
        new_k, new_v = store.encode(keys), store.encode(values, values=True)
        if self.keys is None:
            self.keys, self.values = new_k, new_v
        else:
            self._to_temporal_order()
            if store.length(self.keys) > self._idx:
                self.keys = store.rows(self.keys, stop=self._idx)
                self.values = store.rows(self.values, stop=self._idx)
            if self._lengths is not None:  # padded sequences: roll, so none is cut short
                self._roll(np.maximum(0, self._off - self._lengths), widened=True)
            trim_size = self._idx - self.max_size + 1
            lp = self._lp - trim_size if trim_size > 0 else self._lp
            set_rows(self, lp, self._off)
            self.keys = self._trim(trim_size, self.keys, new_k)
            self.values = self._trim(trim_size, self.values, new_v)
        T = keys.shape[2]
        set_rows(self, self._lp, self._off + T)
        self._offset += T
        self._idx = store.length(self.keys)
        self._owned = True  # encoded or concatenated here
        return self.keys, self.values

    def _update_in_place(self, keys, values):
        where = self._where("update_and_fetch")
        if self._lengths is not None:
            raise ValueError(f"[{where}] finalize() must be called before decoding.")
        store, prev = self._store, self._offset
        grow_ring(self, keys, values, prev)
        lp = self._settle_ring()
        self.keys, self.values = store.write_kv(
            self.keys, self.values, keys, values, self._idx, overwrite_in_place(self, prev)
        )
        self._owned = True
        set_rows(self, lp, self._off + 1)
        self._offset += 1
        self._idx += 1
        return self.keys_and_values()

    def _settle_ring(self) -> np.ndarray:
        """Before a one-token write into a grown ring: back to max_size rows
        after a longer step, the index wrapped (the ring then rotated);
        returns the left padding after the write (mlx-lm's bookkeeping)."""
        lp = self._lp
        trim_size = self._store.length(self.keys) - self.max_size
        if trim_size > 0:
            self.keys = self._trim(trim_size, self.keys)
            self.values = self._trim(trim_size, self.values)
            self._idx = self.max_size
            lp = lp - trim_size
        if self._idx == self.max_size:
            self.rotated = True
            self._idx = 0
        return lp - 1 if self.rotated else lp

    # ---------------------------------------------------- compiled decode
    def _decode_slot(self):
        """A compiled step's plan: _update_in_place's bookkeeping without
        the write, and mlx-lm's mask for the step (from the state before
        it, as the model asks for it) over the buffer the step reads."""
        where = self._where("prepare_decode")
        if self._lengths is not None:
            raise ValueError(f"[{where}] finalize() must be called before decoding.")
        state = (self._idx, self._offset, self.rotated, self.max_size, self._lp.tobytes())
        filling = self._offset < self.max_size and not self.rotated
        if filling and self._idx == self._offset:
            capacity = decode_step.grow_for(self, self._offset, limit=self.max_size)
            lp = self._lp
        else:
            if self._store.length(self.keys) < self.max_size:
                raise ValueError(f"[{where}] a ring short of max_size that has wrapped.")
            lp = self._settle_ring()
            capacity = self.max_size
        key = _remember_mask(state + (capacity,), lambda: self._step_mask(state, capacity))
        set_rows(self, lp, self._off)
        rows = tuple(int(x) for x in self._off)
        return DecodePlan("batch_ring", self._idx, rows, capacity, 0, key)

    def _step_mask(self, state: tuple, capacity: int) -> np.ndarray:
        """make_mask(1) in ``state`` (the ring's before the step), on the
        host, over ``capacity`` rows: ``[B, 1, 1, capacity]`` bool (the rows
        past mlx-lm's mask hidden)."""
        idx, written, rotated, max_size, _ = state
        lp = self._lp  # not yet moved by the step's bookkeeping
        offset = min(max_size - 1, written)
        n = offset + 1
        keys = np.arange(n)
        visible = (offset >= keys) & (offset < keys + max_size)
        rotated = rotated or idx >= max_size
        hidden = max(0, idx - max_size) + int(rotated)
        visible = visible[None] & (keys[None] >= (lp - hidden)[:, None])
        if rotated:
            visible = np.roll(visible, (0 if idx >= max_size else idx) + 1, axis=-1)
        out = np.zeros((len(lp), 1, 1, capacity), np.bool_)
        out[..., :n] = visible[:, None, None, :]
        return out

    def _decoded(self, plan) -> None:
        set_rows(self, self._lp, self._off + 1)
        self._offset += 1
        self._idx += 1

    # ------------------------------------------------------------- padding
    def _take_right_padding(self, lengths, right_padding) -> None:
        self._lengths = lengths + self._off
        if self._recent is not None:  # room for the rows the rolls bring in
            more = int(np.max(right_padding, initial=0))
            self._recent = batch_recent.widened(self._recent, more, self._offset)

    def _roll(self, shifts: np.ndarray, widened: bool) -> None:
        """Roll each sequence right by ``shifts`` rows, its window too (kept
        ``widened`` while more right-padded rows may come)."""
        batch_rows.roll(self, shifts)
        if self._recent is not None:
            size = self._recent.size if widened else self.recent
            self._recent = batch_recent.rolled(self._recent, size, shifts, self._offset)

    def finalize(self) -> None:
        """After a right-padded prefill: roll each sequence's padding to its left."""
        if self._lengths is not None:
            shifts = np.maximum(0, self._off - self._lengths)
            self._lengths = None
            self._roll(shifts, widened=False)

    # ---------------------------------------------------------------- state
    @property
    def state(self):
        self._handing_out()
        batch = (
            self.keys,
            self.values,
            self.offset,
            self.left_padding,
            self.max_size,
            self._offset,
            self._idx,
            self.rotated,
        )
        return batch + batch_rows.quantization_state(self)

    @state.setter
    def state(self, v):
        where = self._where("state")
        keys, values, offset, left_padding, max_size, _offset, idx, rotated = tuple(v)[:8]
        batch_rows.take_quantization(self, tuple(v)[8:], where)
        set_rows(
            self, host_ints(left_padding, "left_padding", where), host_ints(offset, "offset", where)
        )
        self.max_size = as_int(max_size, "max_size", where, minimum=1)
        self._offset = as_int(_offset, "_offset", where, minimum=0)
        self._idx = as_int(idx, "_idx", where, minimum=0)
        self.rotated = bool(rotated)
        self._lengths = None
        self._adopt(keys, values, "state")
        if self._recent is not None:  # adopted rows were never held exactly
            self._recent.reset(self._offset)

    # ------------------------------------------------------------ the rest
    def size(self) -> int:
        return min(self._offset, self.max_size)

    def is_trimmable(self) -> bool:
        return self._offset < self.max_size

    def trim(self, n: int) -> int:
        n = min(self._offset, as_int(n, "n", self._where("trim"), minimum=0))
        self._offset -= n
        self._idx -= n
        set_rows(self, self._lp, self._off - n)
        if self._recent is not None and n:
            self._recent.trimmed(self._offset + n, self._offset)
        return n

    def make_mask(self, N: int, window_size=None, return_array: bool = False, **kwargs):
        """``[B, 1, N, S]`` bool, exactly mlx-lm's: causal within the window,
        padding hidden, in ring order for a one-token step on a full ring."""
        window_size = window_size or self.max_size
        offset = min(self.max_size - 1, self._offset)
        keys = mx.arange(offset + N)[None]
        queries = mx.arange(offset, offset + N)[:, None]
        mask = (queries >= keys) & (queries < keys + window_size)
        shift = max(0, self._idx - self.max_size + int(N > 1))
        rotated = N == 1 and (self.rotated or self._idx >= self.max_size)
        hidden = shift + int(rotated)
        mask = left_padded(mask, self.left_padding - hidden if hidden else self.left_padding)
        if rotated:
            idx = 0 if self._idx >= self.max_size else self._idx
            mask = mx.roll(mask, shift=idx + 1, axis=-1)
        return mask

    def filter(self, batch_indices) -> None:
        """Keep only the sequences ``batch_indices``."""
        batch_rows.filter_rows(self, batch_indices)
        if self._recent is not None:
            take = np.asarray(batch_indices, dtype=np.int64).reshape(-1)
            self._recent = batch_recent.filtered(self._recent, take, self._offset, 0)

    def extend(self, other) -> None:
        """Append ``other``'s sequences (both unrolled first unless their
        rings line up)."""
        if batch_rows.is_batch(other) or hasattr(other, "max_size"):
            if other.max_size != self.max_size:
                raise ValueError(
                    f"[{self._where('extend')}] cannot extend a ring of max_size "
                    f"{self.max_size} with one of {other.max_size}."
                )
        if not batch_rows.is_batch(other):
            other = type(self).quantize(other, **self.format.kwargs(), recent=self.recent)
        if (self.keys is not None or other.keys is not None) and (
            self.rotated != other.rotated or self._idx != other._idx
        ):
            self._to_temporal_order()
            other._to_temporal_order()
        offset = max(self._offset, other._offset)
        sides = [  # (exact rows, end, sequences) of each side, in its own positions
            (_exact_rows(self), self._offset, self.batch_size),
            (_exact_rows(other), other._offset, len(other.offset)),
        ]
        batch_rows.extend(self, other, self._where("extend"))
        self._offset = offset
        if self._recent is not None:
            self._recent = batch_recent.joined(self.recent, sides, offset)

    def extract(self, idx: int) -> RotatingQuantizedKVCache:
        """Sequence ``idx``'s ring as a :class:`~mlxq.RotatingQuantizedKVCache`
        (temporal order, evicted and padding rows dropped)."""
        pad = max(0, int(self._lp[idx]))
        rows = slice(idx, idx + 1)
        k, v = (self._store.map(t, lambda a: a[rows]) for t in (self.keys, self.values))
        end = self._idx
        if self.rotated:
            shift = -self._idx
            k, v = (self._store.map(t, lambda a: mx.roll(a, shift, axis=2)) for t in (k, v))
            end = self.max_size
        k, v = (self._store.map(t, lambda a: mx.contiguous(a[:, :, pad:end])) for t in (k, v))
        cache = RotatingQuantizedKVCache(
            self.max_size, 0, **self.format.kwargs(), recent=self.recent
        )
        self._handing_out()  # the copy is lazy: no in-place write before it is made
        own = int(self._off[idx])
        cache.restore(k, v, own, self._store.length(k))
        if self._recent is not None:  # its positions: the batch's, less its padding
            rows = batch_recent.sequence_rows(self._recent, idx, self._offset, self._offset - own)
            cache._recent = batch_recent.rebuilt(self.recent, rows, own)
        return cache

    @classmethod
    def merge(cls, caches: Sequence) -> "BatchRotatingQuantizedKVCache":
        """One batch ring from single-sequence rings of one ``max_size``
        (mlxq's quantized ones; unquantized ones are quantized alike). Like
        mlx-lm's, a batch ring pins no tokens: rings with ``keep`` tokens
        (``max_kv_size`` caches) batch, and their kept tokens are evicted in
        turn."""
        where = f"mlxq.{cls.__name__}.merge"
        sizes = {c.max_size for c in caches}
        if len(sizes) > 1:
            raise ValueError(
                f"[{where}] cannot batch rings of different max_size: {sorted(sizes)}."
            )
        params = batch_rows.quantized_like(caches, where).kwargs()
        recent = max((getattr(c, "recent", 0) for c in caches), default=0)
        lengths = [batch_rows.tokens_held(c) for c in caches]
        longest = max(lengths, default=0)
        cache = cls(caches[0].max_size, [longest - n for n in lengths], **params, recent=recent)
        batch_rows.take_sequences(cache, caches, lengths)
        set_rows(cache, cache._lp, np.array([int(c.offset) for c in caches], np.int64))
        cache._offset = cache._idx
        if recent:  # each ring's tokens end at the batch's last row
            sides = [(_exact_rows(c), int(c.offset), 1) for c in caches]
            cache._recent = batch_recent.joined(recent, sides, cache._offset)
        return cache

    @classmethod
    def quantize(
        cls, batch, group_size=64, bits=4, **quantization
    ) -> "BatchRotatingQuantizedKVCache":
        """mlx-lm's ``BatchRotatingKVCache`` ``batch``, quantized as laid out."""
        where = f"mlxq.{cls.__name__}.quantize"
        cache = cls(
            batch.max_size, np.zeros(len(batch.offset), np.int64), group_size, bits, **quantization
        )
        batch_rows.take_batch(cache, batch, where)
        cache._offset, cache.rotated = batch._offset, batch.rotated
        lengths = getattr(batch, "_lengths", None)
        cache._lengths = None if lengths is None else host_ints(lengths, "lengths", where)
        if cache._recent is not None:
            cache._recent = batch_recent.rebuilt(cache.recent, _exact_rows(batch), cache._offset)
        return cache


def _exact_rows(c) -> batch_recent.Rows:
    """The rows a ring (a batch's or one sequence's) holds exactly at its
    end, in its own positions: an mlxq cache's window, the newest rows of
    an unquantized ring, else none."""
    if getattr(c, "_recent", None) is not None:
        return batch_recent.held(c._recent, c._offset if batch_rows.is_batch(c) else c.offset)
    end = c._offset if hasattr(c, "_offset") else int(c.offset)
    if c.keys is None or hasattr(c, "bits"):
        return end, None, None
    if hasattr(c, "_temporal_order"):  # one sequence's ring
        keys, values = c._temporal_order(c.keys), c._temporal_order(c.values)
    elif c.rotated:  # a batch's, wrapped at _idx
        keys, values = (mx.roll(t, -c._idx, axis=2) for t in (c.keys, c.values))
    else:
        keys, values = c.keys[..., : c._idx, :], c.values[..., : c._idx, :]
    return batch_recent.newest_rows(keys, values, end)
