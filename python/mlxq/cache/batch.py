"""Batch caches: sequences of different lengths, left-padded into one buffer.

mlx-lm 0.32's continuous batching (``BatchGenerator``) keeps every layer's
K/V for all running sequences in one ``BatchKVCache`` (or
``BatchRotatingKVCache``): row ``b`` holds ``left_padding[b]`` rows of
padding, then that sequence's tokens, so that all sequences write each
decoded token at the same row (``_idx``) and masks hide the padding. mlx-lm
cannot quantize those caches. :class:`BatchQuantizedKVCache` (here) and
:class:`~mlxq.BatchRotatingQuantizedKVCache` (batch_rotating.py) follow the
same protocol over ``mx.quantize`` triples, written by the ring primitives
(O(1) and in place per decoded token):

* ``prepare`` / ``finalize`` — a prefill of right-padded prompts, whose
  padding is rolled to the left afterwards;
* ``filter`` (sequences leave), ``extend`` (a batch joins), ``extract``
  (one sequence's cache, e.g. for a prompt cache) and ``merge`` (single
  caches into a batch);
* ``make_mask``, ``state``, ``trim``, ``size``, ``empty`` and ``nbytes``.

After every step their content equals ``mx.quantize`` of what mlx-lm's own
batch cache holds after the same calls, padding included.

``left_padding`` and ``offset`` are kept on the host (they follow from the
calls alone) and handed out as int32 arrays, so bookkeeping never waits for
the device and never grows a lazy graph.
"""

from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from ..arguments import as_int
from ..kv_format import KVFormat
from ..masks import create_causal_mask, left_padded
from .base import QuantizedStorage, quantization_options
from .decode_step import DecodePlan
from .kv import QuantizedKVCache, _GrowingCache


def roll_rows(x: mx.array, shifts: np.ndarray) -> mx.array:
    """Each sequence ``b`` of ``x [B, H, S, *]`` rolled by ``shifts[b]`` rows
    along the sequence axis (towards the end)."""
    n = x.shape[2]
    shifts = mx.array(np.asarray(shifts, dtype=np.int32))
    rows = (mx.arange(n)[None, None, :, None] - shifts[:, None, None, None]) % n
    return mx.take_along_axis(x, rows, axis=2)


def _host_ints(v, name: str, where: str) -> np.ndarray:
    if isinstance(v, mx.array):
        v = np.array(v)
    v = np.asarray(v)
    if v.ndim != 1 or not (v.size == 0 or np.issubdtype(v.dtype, np.integer)):
        raise ValueError(f"[{where}] {name} must be a 1-D list of ints, got {v!r}.")
    return v.astype(np.int64)


class BatchRows:
    """What both batch caches share: per-sequence ``left_padding`` and
    ``offset`` (host arrays), the quantization, and the padding logic of
    ``prepare``, ``extend``, ``merge`` and ``to_quantized``."""

    _lp = np.zeros(0, np.int64)
    _off = np.zeros(0, np.int64)
    _idx = 0
    # The int32 device copies of left_padding and offset, made when asked for
    # (a decode step reads each layer's offset for RoPE; the padding only
    # when the step's mask is made).
    _lp_array = None
    _off_array = None

    def _init_rows(self, left_padding) -> None:
        lp = _host_ints(left_padding, "left_padding", self._where("__init__"))
        if (lp < 0).any():
            raise ValueError(f"[{self._where('__init__')}] left_padding must be >= 0, got {lp}.")
        self._set_rows(lp, -lp)

    def _set_rows(self, lp: np.ndarray, off: np.ndarray) -> None:
        if lp is not self._lp:
            self._lp, self._lp_array = lp, None
        if off is not self._off:
            self._off, self._off_array = off, None

    @property
    def left_padding(self) -> mx.array:
        """Padding rows before each sequence's first token, int32 ``[B]``."""
        if self._lp_array is None:
            self._lp_array = mx.array(self._lp.astype(np.int32))
        return self._lp_array

    @left_padding.setter
    def left_padding(self, v) -> None:
        self._set_rows(_host_ints(v, "left_padding", self._where("left_padding")), self._off)

    @property
    def offset(self) -> mx.array:
        """Each sequence's token count (its next RoPE position), int32 ``[B]``."""
        if self._off_array is None:
            self._off_array = mx.array(self._off.astype(np.int32))
        return self._off_array

    @offset.setter
    def offset(self, v) -> None:
        self._set_rows(self._lp, _host_ints(v, "offset", self._where("offset")))

    @property
    def batch_size(self) -> int:
        return len(self._lp)

    def _check_batch(self, keys) -> None:
        if isinstance(keys, mx.array) and keys.ndim == 4 and keys.shape[0] != self.batch_size:
            raise ValueError(
                f"[{self._where('update_and_fetch')}] keys hold {keys.shape[0]} sequences; "
                f"the batch cache holds {self.batch_size}."
            )

    # ------------------------------------------------------- quantization
    @classmethod
    def _quantized_like(cls, caches: Sequence, where: str) -> KVFormat:
        """The format the quantized ones among ``caches`` share (a
        ValueError naming the first that differs)."""
        first = None
        for i, c in enumerate(caches):
            if not hasattr(c, "bits"):
                continue
            # mlx-lm's own quantized caches have no format: theirs is plain.
            f = getattr(c, "format", None) or KVFormat(c.group_size, c.bits)
            if first is None:
                first = (i, f)
            elif f != first[1]:
                raise ValueError(
                    f"[{where}] cannot batch caches of different quantization: cache "
                    f"{first[0]} is {first[1]}, cache {i} is {f}."
                )
        if first is None:
            raise ValueError(f"[{where}] none of the caches is quantized.")
        return first[1]

    def _stored(self, t, values: bool = False):
        """``t`` (a triple of this quantization, or unquantized rows to encode)."""
        if isinstance(t, mx.array):
            return self._store.encode(t, values)
        return self._store.check(t, "values" if values else "keys", self._where("merge"))

    def _check_fits(self, others: Sequence, where: str) -> None:
        """ValueError unless every cache in ``others`` holds K/V of this
        cache's heads, head dims and dtype."""
        shapes = []
        for c in (self, *others):
            if c.keys is None:
                continue
            k, v = c.keys, c.values
            plain = isinstance(k, mx.array)
            hk = k.shape[3] if plain else self._store.head_dim(k)
            hv = v.shape[3] if plain else self._store.head_dim(v, values=True)
            kk = k if plain else k[0]
            shapes.append(
                (kk.shape[1], hk, hv, str(k.dtype if plain else k[1].dtype).rsplit(".", 1)[-1])
            )
        for s in shapes[1:]:
            if s != shapes[0]:
                raise ValueError(
                    f"[{where}] cannot batch caches with different (kv heads, key head dim, "
                    f"value head dim, dtype): {shapes[0]} vs {s}."
                )

    # ------------------------------------------------------ merge, quantize
    def _take_sequences(self, caches: Sequence, lengths: Sequence[int]) -> None:
        """Fill this new batch with the newest ``lengths[b]`` tokens of each
        single cache, left-padded to the longest (``merge``)."""
        self._check_fits(caches, self._where("merge"))
        longest = max(lengths, default=0)
        if longest == 0:
            return
        parts = [
            None
            if c.keys is None
            else tuple(self._stored(t, i == 1) for i, t in enumerate(_oldest_first(c)))
            for c in caches
        ]
        store, ref = self._store, next(p for p in parts if p is not None)
        stacked = []
        for side in (0, 1):
            rows = []
            for p, n in zip(parts, lengths):
                t = store.rows(ref[side], stop=0) if p is None else p[side]
                t = store.rows(t, start=store.length(t) - n)  # the newest n (a ring may hold more)
                rows.append(store.pad_rows(t, longest - n, 0, side == 1))
            stacked.append(store.concat_batch(rows))
        self.keys, self.values = stacked
        # Not ours alone: a one-sequence concatenate (or an unpadded slice)
        # is the single cache's own buffer, so the first write copies
        # unless MLX finds that cache let go.
        self._owned = False
        self._idx = longest

    def _take_batch(self, batch, where: str) -> None:
        """mlx-lm's batch cache ``batch``: its padding, offsets and ``_idx``,
        and its whole buffer quantized (``to_quantized``)."""
        self._set_rows(
            _host_ints(batch.left_padding, "left_padding", where),
            _host_ints(batch.offset, "offset", where),
        )
        self._idx = batch._idx
        if batch.keys is not None:
            self._encode_buffers(batch.keys, batch.values)

    # ------------------------------------------------------------- padding
    def prepare(self, *, left_padding=None, lengths=None, right_padding=None) -> None:
        """Before a prefill: more left padding (only while empty), or the
        right padding of the prompts about to be written (rolled to the
        left by :meth:`finalize`)."""
        where = self._where("prepare")
        if left_padding is not None:
            if self.keys is not None:
                raise ValueError(f"[{where}] left padding can only be added to an empty cache.")
            more = _host_ints(left_padding, "left_padding", where)
            self._set_rows(self._lp + more, self._off - more)
        if right_padding is not None and max(right_padding) > 0:
            self._take_right_padding(
                _host_ints(lengths, "lengths", where),
                _host_ints(right_padding, "right_padding", where),
            )

    def _roll(self, shifts: np.ndarray) -> None:
        """Roll each sequence right by ``shifts`` rows: padding that was on
        its right moves to its left."""
        rolled = [
            self._store.map(t, lambda a: roll_rows(a, shifts)) for t in (self.keys, self.values)
        ]
        self.keys, self.values = rolled
        self._owned = True  # gathered: a fresh buffer
        self._set_rows(self._lp + shifts, self._off - shifts)

    def _right_aligned(self, c, idx: int, length: int):
        """``c``'s keys/values and left padding, shifted to end at row ``idx``
        of a ``length``-row buffer (``extend``; ``self`` is not empty)."""
        left = idx - c._idx
        store = self._store
        parts = []
        for t, values in ((c.keys, False), (c.values, True)):
            t = self._empty_rows(c.batch_size, values) if t is None else t
            right = length - store.length(t) - left
            if right < 0:
                t = store.rows(t, stop=store.length(t) + right)
                right = 0
            parts.append(store.pad_rows(t, left, right, values))
        return parts[0], parts[1], c._lp + left, c._off

    def _empty_rows(self, B: int, values: bool):
        """No rows, in this batch's layout, for ``B`` sequences (an empty
        cache joining a non-empty one)."""
        ref = self.values if values else self.keys
        H, D = ref[0].shape[1], self._store.head_dim(ref, values)
        # Zero-row buffers, not encoded (a rotation refuses empty arrays).
        return self._store.zeros(mx.zeros((B, H, 0, D), self._store.dtype(ref)), 0, values)

    def _extend(self, other, where: str) -> None:
        """Both caches right-aligned at the longer's ``_idx``, then stacked."""
        if not isinstance(other, BatchRows):
            other = type(self).quantize(other, **self.format.kwargs())
        elif other.format != self.format:
            raise ValueError(
                f"[{where}] cannot extend a cache quantized as {self.format} "
                f"with one quantized as {other.format}."
            )
        if self.keys is None and other.keys is None:
            self._set_rows(
                np.concatenate([self._lp, other._lp]), np.concatenate([self._off, other._off])
            )
            return
        self._check_fits([other], where)
        host = self if self.keys is not None else other
        store = self._store
        idx = max(self._idx, other._idx)
        length = max(store.length(c.keys) for c in (self, other) if c.keys is not None)
        ours = host._right_aligned(self, idx, length)
        theirs = host._right_aligned(other, idx, length)
        self.keys, self.values = (store.concat_batch([ours[i], theirs[i]]) for i in (0, 1))
        self._owned = True
        self._set_rows(np.concatenate([ours[2], theirs[2]]), np.concatenate([ours[3], theirs[3]]))
        self._idx = idx

    # ---------------------------------------------------------------- state
    # ``state`` is mlx-lm's batch state followed by the format (group_size,
    # bits, then KVFormat.extras), so that ``from_state(state)`` alone, as
    # mlx-lm restores caches, rebuilds it.
    def _quantization_state(self) -> tuple:
        return (self.group_size, self.bits) + self.format.extras()

    def _take_quantization(self, tail: tuple, where: str) -> None:
        if len(tail) < 2:
            raise ValueError(
                f"[{where}] a quantized batch state ends with (group_size, bits[, hadamard"
                f"[, v_group_size, v_bits]]); got {len(tail)} entries after the batch's."
            )
        key = KVFormat(as_int(tail[0], "group_size", where), as_int(tail[1], "bits", where))
        self.format = key.with_extras(tuple(tail[2:]), where)
        self._configure()

    @property
    def meta_state(self):
        return ()

    @meta_state.setter
    def meta_state(self, v):
        if tuple(v):
            raise ValueError(
                f"[{self._where('meta_state')}] a batch cache keeps everything in state; "
                f"got meta_state {tuple(v)!r}."
            )

    def size(self) -> int:
        return self._idx

    def _check_positions(self, length: int, where: str) -> None:
        if not 0 <= self._idx <= length:
            raise ValueError(f"[{where}] _idx {self._idx} is outside [0, {length}].")

    def _filter_rows(self, batch_indices) -> None:
        """Keep the sequences ``batch_indices`` (in that order)."""
        take = np.asarray(batch_indices, dtype=np.int64).reshape(-1)
        if self.keys is not None:
            idx = mx.array(take.astype(np.int32))
            self.keys, self.values = (
                self._store.map(t, lambda a: mx.take(a, idx, axis=0))
                for t in (self.keys, self.values)
            )
            self._owned = True
        self._set_rows(self._lp[take], self._off[take])


class BatchQuantizedKVCache(BatchRows, QuantizedStorage, _GrowingCache):
    """mlx-lm's ``BatchKVCache`` over quantized triples.

    ``left_padding[b]`` rows of padding precede sequence ``b``'s tokens;
    all sequences write each update at row ``_idx`` (in place, quantized by
    the ring primitive) and fetches are the first ``_idx`` rows, which
    :func:`mlxq.sdpa` attends under the mask from :meth:`make_mask`.
    """

    mlx_lm_name = "BatchQuantizedKVCache"  # mlx-lm has no such class

    def __init__(
        self,
        left_padding: Sequence[int],
        group_size: int = 64,
        bits: int = 8,
        hadamard: bool = False,
        v_group_size: Optional[int] = None,
        v_bits: Optional[int] = None,
        *,
        kv_rotate: Optional[bool] = None,
    ):
        self.keys = self.values = None
        hadamard, _ = quantization_options(self._where("__init__"), hadamard, kv_rotate=kv_rotate)
        self.format = KVFormat(group_size, bits, v_group_size, v_bits, hadamard)
        self._idx = 0
        self._right_padding = None
        self._init_rows(left_padding)
        self._configure()

    def _configure(self) -> None:
        self._use_quantized_store()

    # ------------------------------------------------------------- writes
    def _used(self) -> int:
        return self._idx

    def _advance(self, T: int) -> None:
        self._idx += T
        self._set_rows(self._lp, self._off + T)

    def _blank(self, like, n: int, values: bool = False):
        # Encoded zeros: finalize rolls the whole buffer, so rows past _idx
        # come round to the front, where they must read as the quantized
        # zeros of an unquantized cache's growth.
        B, H, _, D = like.shape
        return self._store.encode(mx.zeros((B, H, n, D), like.dtype), values)

    def _decode_slot(self):
        """A compiled step's plan: the buffer in whole key classes as a
        growing cache's, every sequence writing at row ``_idx``."""
        if self._right_padding is not None:
            raise ValueError(
                f"[{self._where('prepare_decode')}] finalize() must be called before decoding."
            )
        capacity = self._grow_for_decode(self._idx)  # encoded blanks past it (_blank)
        rows = lambda a: tuple(int(x) for x in a)  # noqa: E731
        return DecodePlan("batch", self._idx, rows(self._off), capacity, 0, rows(self._lp))

    def _decoded(self, plan) -> None:
        self._advance(1)

    def update_and_fetch(self, keys, values):
        """Write ``[B, H, T, D]`` at row ``_idx`` of every sequence; return
        rows ``[0, _idx)`` (padding included: the mask hides it)."""
        self._check_batch(keys)
        return self._append(keys, values, None)

    def _take_right_padding(self, lengths, right_padding) -> None:
        self._right_padding = right_padding

    def finalize(self) -> None:
        """After a right-padded prefill: roll each sequence's padding to its left."""
        if self._right_padding is not None:
            shifts, self._right_padding = self._right_padding, None
            self._roll(shifts)

    # ---------------------------------------------------------------- state
    @property
    def state(self):
        self._handing_out()
        batch = (self.keys, self.values, self.offset, self.left_padding, self._idx)
        return batch + self._quantization_state()

    @state.setter
    def state(self, v):
        where = self._where("state")
        keys, values, offset, left_padding, idx = tuple(v)[:5]
        self._take_quantization(tuple(v)[5:], where)
        self._set_rows(
            _host_ints(left_padding, "left_padding", where), _host_ints(offset, "offset", where)
        )
        self._idx = as_int(idx, "_idx", where, minimum=0)
        self._right_padding = None
        self._adopt(keys, values, "state")

    # ------------------------------------------------------------ the rest
    def trim(self, n: int) -> int:
        n = min(self._idx, self._check_trim(n))
        self._idx -= n
        self._set_rows(self._lp, self._off - n)
        return n

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **kwargs):
        """``[B, 1, N, _idx + N]`` bool: causal (and windowed), padding hidden."""
        mask = create_causal_mask(N, self._idx, window_size=window_size)
        return left_padded(mask, self.left_padding)

    def filter(self, batch_indices) -> None:
        """Keep only the sequences ``batch_indices``; drop padding every one
        of them has (the buffer shrinks from the left)."""
        self._filter_rows(batch_indices)
        trim = int(self._lp.min()) if len(self._lp) else 0
        if trim > 0:
            if self.keys is not None:
                self.keys, self.values = (
                    self._store.map(t, lambda a: mx.contiguous(a[..., trim:, :]))
                    for t in (self.keys, self.values)
                )
            self._idx -= trim
            self._set_rows(self._lp - trim, self._off)

    def extend(self, other) -> None:
        """Append ``other``'s sequences (a batch cache, quantized like this
        one or unquantized, which is then quantized)."""
        self._extend(other, self._where("extend"))

    def extract(self, idx: int) -> QuantizedKVCache:
        """Sequence ``idx``'s tokens as a :class:`~mlxq.QuantizedKVCache`."""
        pad = int(self._lp[idx])
        rows = slice(idx, idx + 1)
        cache = QuantizedKVCache(**self.format.kwargs())
        k, v = (
            self._store.map(t, lambda a: mx.contiguous(a[rows, :, pad : self._idx]))
            for t in (self.keys, self.values)
        )
        self._handing_out()  # the copy is lazy: no in-place write before it is made
        return cache.restore(k, v, self._idx - pad)

    @classmethod
    def merge(cls, caches: Sequence) -> "BatchQuantizedKVCache":
        """One batch cache from single-sequence caches (mlxq's quantized
        ones; unquantized ones are quantized alike), left-padded to the
        longest."""
        where = f"mlxq.{cls.__name__}.merge"
        params = cls._quantized_like(caches, where).kwargs()
        lengths = [tokens_held(c) for c in caches]
        longest = max(lengths, default=0)
        cache = cls([longest - n for n in lengths], **params)
        cache._take_sequences(caches, lengths)
        cache._set_rows(cache._lp, cache._off + cache._idx)
        return cache

    @classmethod
    def quantize(cls, batch, group_size=64, bits=4, **quantization) -> "BatchQuantizedKVCache":
        """mlx-lm's ``BatchKVCache`` ``batch``, quantized (its whole buffer)."""
        where = f"mlxq.{cls.__name__}.quantize"
        cache = cls(np.zeros(len(batch.offset), np.int64), group_size, bits, **quantization)
        cache._take_batch(batch, where)
        rp = getattr(batch, "_right_padding", None)
        cache._right_padding = None if rp is None else _host_ints(rp, "right_padding", where)
        return cache


def tokens_held(c) -> int:
    """How many tokens a single cache holds: ``size()``, except for mlx-lm's
    ``QuantizedKVCache``, whose ``size()`` is its base class's 0."""
    return c.size() if hasattr(c, "max_size") or not hasattr(c, "bits") else c.offset


def _oldest_first(c):
    """A single cache's keys and values, oldest token first (mlxq's caches,
    or mlx-lm's ``KVCache``/``QuantizedKVCache``/``RotatingKVCache``), as
    plain arrays/tuples."""
    if hasattr(c, "temporal"):
        k, v = c.temporal()
    elif hasattr(c, "_temporal_order"):  # mlx-lm's RotatingKVCache
        k, v = c._temporal_order(c.keys), c._temporal_order(c.values)
    else:  # mlx-lm's KVCache / QuantizedKVCache: rows [0, offset)
        k, v = c.keys_and_values()
    return tuple(t if isinstance(t, mx.array) else tuple(t) for t in (k, v))
