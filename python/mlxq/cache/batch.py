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
batch cache holds after the same calls, padding included. What both batch
caches share is in batch_rows.py.
"""

from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from ..arguments import as_int
from ..kv_format import KVFormat
from ..masks import create_causal_mask, left_padded
from . import batch_recent, batch_rows, decode_step, quantized
from .batch_rows import host_ints, set_rows
from .decode_step import DecodePlan
from .kv import KVCache, QuantizedKVCache, windowed_fetch
from .latent import latent_fetch
from .recent import window_for


@batch_rows.batch_side
class BatchQuantizedKVCache(KVCache):
    """mlx-lm's ``BatchKVCache`` over quantized triples.

    ``left_padding[b]`` rows of padding precede sequence ``b``'s tokens;
    all sequences write each update at row ``_idx`` (in place, quantized by
    the ring primitive) and fetches are the first ``_idx`` rows, which
    :func:`mlxq.sdpa` attends under the mask from :meth:`make_mask`.

    ``recent=R`` also keeps every sequence's last ``R`` tokens exact, as
    :class:`~mlxq.QuantizedKVCache` does (batch_recent.py): fetches are
    :class:`~mlxq.split.RecentSplit` pairs.
    """

    mlx_lm_name = "BatchQuantizedKVCache"  # mlx-lm has no such class
    format = KVFormat()
    recent = 0
    to_quantized = quantized.already_quantized

    def __init__(
        self,
        left_padding: Sequence[int],
        group_size: int = 64,
        bits: int = 8,
        hadamard: bool = False,
        v_group_size: Optional[int] = None,
        v_bits: Optional[int] = None,
        recent: int = 0,
        *,
        kv_rotate: Optional[bool] = None,
        latent: bool = False,
    ):
        self.keys = self.values = None
        where = self._where("__init__")
        hadamard, recent = quantized.options(where, hadamard, recent, kv_rotate=kv_rotate)
        self.format = KVFormat(group_size, bits, v_group_size, v_bits, hadamard, latent)
        self.recent = as_int(recent, "recent", where, minimum=0)
        if latent and self.recent:
            raise ValueError(
                f"[{where}] an MLA latent cache keeps no recent window (its RoPE keys are "
                "exact already): pass recent=0."
            )
        self._idx = 0
        self._right_padding = None
        batch_rows.init_rows(self, left_padding)
        self._configure()

    def _configure(self) -> None:
        self._store = quantized.store(self)
        self._recent = window_for(self._recent, self.recent, self._idx)

    # ------------------------------------------------------------- writes
    def _used(self) -> int:
        return self._idx

    def size(self) -> int:
        return self._idx

    def _advance(self, T: int) -> None:
        self._idx += T
        set_rows(self, self._lp, self._off + T)

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
        capacity = decode_step.grow_for(self, self._idx, blank=self._blank)
        rows = lambda a: tuple(int(x) for x in a)  # noqa: E731
        return DecodePlan("batch", self._idx, rows(self._off), capacity, 0, rows(self._lp))

    def _decoded(self, plan) -> None:
        self._advance(1)

    def update_and_fetch(self, keys, values):
        """Write ``[B, H, T, D]`` at row ``_idx`` of every sequence; return
        rows ``[0, _idx)`` (padding included: the mask hides it)."""
        batch_rows.check_batch(self, keys)
        if self._recent is not None:  # (over buffer rows: see batch_recent.py)
            return windowed_fetch(self, keys, values)
        fetch = self._append(keys, values)
        return latent_fetch(self, fetch, keys.shape[2]) if self.format.latent else fetch

    def _take_right_padding(self, lengths, right_padding) -> None:
        self._right_padding = right_padding
        if self._recent is not None:  # room for the rows finalize rolls in
            more = int(np.max(right_padding, initial=0))
            self._recent = batch_recent.widened(self._recent, more, self._idx)

    def finalize(self) -> None:
        """After a right-padded prefill: roll each sequence's padding to its left."""
        if self._right_padding is not None:
            shifts, self._right_padding = self._right_padding, None
            batch_rows.roll(self, shifts)
            if self._recent is not None:
                self._recent = batch_recent.rolled(self._recent, self.recent, shifts, self._idx)

    # ---------------------------------------------------------------- state
    @property
    def state(self):
        self._handing_out()
        batch = (self.keys, self.values, self.offset, self.left_padding, self._idx)
        return batch + batch_rows.quantization_state(self)

    @state.setter
    def state(self, v):
        where = self._where("state")
        keys, values, offset, left_padding, idx = tuple(v)[:5]
        batch_rows.take_quantization(self, tuple(v)[5:], where)
        set_rows(
            self, host_ints(left_padding, "left_padding", where), host_ints(offset, "offset", where)
        )
        self._idx = as_int(idx, "_idx", where, minimum=0)
        self._right_padding = None
        self._adopt(keys, values, "state")
        if self._recent is not None:  # adopted rows were never held exactly
            self._recent.reset(self._idx)

    # ------------------------------------------------------------ the rest
    def trim(self, n: int) -> int:
        n = min(self._idx, as_int(n, "n", self._where("trim"), minimum=0))
        self._idx -= n
        set_rows(self, self._lp, self._off - n)
        if self._recent is not None and n:
            self._recent.trimmed(self._idx + n, self._idx)
        return n

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **kwargs):
        """``[B, 1, N, _idx + N]`` bool: causal (and windowed), padding hidden."""
        mask = create_causal_mask(N, self._idx, window_size=window_size)
        return left_padded(mask, self.left_padding)

    def filter(self, batch_indices) -> None:
        """Keep only the sequences ``batch_indices``; drop padding every one
        of them has (the buffer shrinks from the left)."""
        batch_rows.filter_rows(self, batch_indices)
        trim = int(self._lp.min()) if len(self._lp) else 0
        if self._recent is not None:
            take = np.asarray(batch_indices, dtype=np.int64).reshape(-1)
            self._recent = batch_recent.filtered(self._recent, take, self._idx, max(trim, 0))
        if trim > 0:
            if self.keys is not None:
                self.keys, self.values = (
                    self._store.map(t, lambda a: mx.contiguous(a[..., trim:, :]))
                    for t in (self.keys, self.values)
                )
            self._idx -= trim
            set_rows(self, self._lp - trim, self._off)

    def extend(self, other) -> None:
        """Append ``other``'s sequences (a batch cache, quantized like this
        one or unquantized, which is then quantized)."""
        if self._recent is None:
            batch_rows.extend(self, other, self._where("extend"))
            return
        sides = [  # (exact rows, end, sequences) of each side before they move
            (batch_recent.held(self._recent, self._idx), self._idx, self.batch_size),
            (_exact_rows(other, self.recent), other._idx, len(other.offset)),
        ]
        batch_rows.extend(self, other, self._where("extend"))
        self._recent = batch_recent.joined(self.recent, sides, self._idx)

    def extract(self, idx: int) -> QuantizedKVCache:
        """Sequence ``idx``'s tokens as a :class:`~mlxq.QuantizedKVCache`."""
        pad = int(self._lp[idx])
        rows = slice(idx, idx + 1)
        cache = QuantizedKVCache(**self.format.kwargs(), recent=self.recent)
        k, v = (
            self._store.map(t, lambda a: mx.contiguous(a[rows, :, pad : self._idx]))
            for t in (self.keys, self.values)
        )
        self._handing_out()  # the copy is lazy: no in-place write before it is made
        cache.restore(k, v, self._idx - pad)
        if self._recent is not None:
            own = batch_recent.sequence_rows(self._recent, idx, self._idx, pad)
            cache._recent = batch_recent.rebuilt(self.recent, own, self._idx - pad)
        return cache

    @classmethod
    def merge(cls, caches: Sequence) -> "BatchQuantizedKVCache":
        """One batch cache from single-sequence caches (mlxq's quantized
        ones; unquantized ones are quantized alike), left-padded to the
        longest."""
        where = f"mlxq.{cls.__name__}.merge"
        params = batch_rows.quantized_like(caches, where).kwargs()
        lengths = [batch_rows.tokens_held(c) for c in caches]
        longest = max(lengths, default=0)
        recent = max((getattr(c, "recent", 0) for c in caches), default=0)
        cache = cls([longest - n for n in lengths], **params, recent=recent)
        batch_rows.take_sequences(cache, caches, lengths)
        set_rows(cache, cache._lp, cache._off + cache._idx)
        if recent:
            sides = [(_exact_rows(c, recent), n, 1) for c, n in zip(caches, lengths)]
            cache._recent = batch_recent.joined(recent, sides, longest)
        return cache

    @classmethod
    def quantize(cls, batch, group_size=64, bits=4, **quantization) -> "BatchQuantizedKVCache":
        """mlx-lm's ``BatchKVCache`` ``batch``, quantized (its whole buffer)."""
        where = f"mlxq.{cls.__name__}.quantize"
        cache = cls(np.zeros(len(batch.offset), np.int64), group_size, bits, **quantization)
        batch_rows.take_batch(cache, batch, where)
        rp = getattr(batch, "_right_padding", None)
        cache._right_padding = None if rp is None else host_ints(rp, "right_padding", where)
        if cache._recent is not None:
            cache._recent = batch_recent.rebuilt(
                cache.recent, _exact_rows(batch, cache.recent), cache._idx
            )
        return cache


def _exact_rows(c, size: int):
    """The rows a cache holds exactly at its end (``batch_recent.Rows``):
    an mlxq cache's window, an unquantized cache's buffer, else none."""
    end = c._idx if hasattr(c, "_idx") else batch_rows.tokens_held(c)
    window = getattr(c, "_recent", None)
    if window is not None:
        return batch_recent.held(window, end)
    if c.keys is not None and not hasattr(c, "bits") and not hasattr(c, "max_size"):
        keys, values = c.keys, c.values
        return batch_recent.plain_rows(keys, values, end, size)
    return end, None, None
