"""The recent window of a left-padded batch (``BatchQuantizedKVCache(recent=R)``).

Every sequence of a left-padded batch ends at buffer row ``_idx``, so one
:class:`~mlxq.cache.recent.RecentWindow` over buffer rows holds the last
``R`` tokens of every sequence at once; padding rows that fall inside it
are hidden by the batch mask, as in the quantized buffer. Its ``start`` is
shared: positions before it are read quantized for every sequence.

The batch operations that move rows rebuild the window from its rows in
order (:func:`held`), moved as the buffer's rows move:

* ``prepare`` with right padding widens it by the longest padding, so that
  after ``finalize`` rolls each sequence right by its padding the last
  ``R`` tokens of every sequence are still held (:func:`rolled`);
* ``filter`` keeps the chosen sequences and drops leading rows;
* ``extend`` and ``merge`` right-align the sides' rows, taking exact rows
  from each side's window, or from its buffer when that is unquantized; a
  side with neither starts the joined window at ``_idx`` (nothing earlier
  is held exactly for it);
* ``extract`` gives one sequence's rows to a single cache's window.
"""

from typing import Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from .batch_rows import roll_rows
from .recent import RecentWindow

Rows = Tuple[int, Optional[mx.array], Optional[mx.array]]  # (first position, keys, values)


def held(window: Optional[RecentWindow], end: int) -> Rows:
    """The exact rows ``window`` holds for positions ``[lo, end)``, oldest
    first, with ``lo``; ``(end, None, None)`` when it holds none."""
    if window is None or window.keys is None:
        return end, None, None
    lo = max(window.start, end - window.slots, 0)
    if lo >= end:
        return end, None, None
    return lo, window.span(window.keys, lo, end), window.span(window.values, lo, end)


def rebuilt(size: int, rows: Rows, end: int) -> RecentWindow:
    """A window of ``size`` holding ``rows`` (their last at ``end - 1``);
    positions before the rows are not held."""
    lo, k, v = rows
    window = RecentWindow(size)
    if k is None or k.shape[2] == 0:
        window.reset(end)
        return window
    window.fill(k, v, end)
    window.start = max(window.start, lo)
    return window


def widened(window: RecentWindow, more: int, end: int) -> RecentWindow:
    """The same rows in a window ``more`` tokens longer (a prefill's right padding)."""
    return rebuilt(window.size + more, held(window, end), end)


def rolled(window: RecentWindow, size: int, shifts: np.ndarray, end: int) -> RecentWindow:
    """After ``finalize`` rolled sequence ``b`` right by ``shifts[b]`` rows:
    the window of ``size`` over the rolled rows. A row whose source lies
    before what was held (a short prefill) starts the window later."""
    lo, k, v = held(window, end)
    if k is None:
        return rebuilt(size, (end, None, None), end)
    k, v = roll_rows(k, shifts), roll_rows(v, shifts)
    # Held from position 0, a row rolled in from before it is padding.
    return rebuilt(size, (lo + int(np.max(shifts, initial=0)) if lo > 0 else 0, k, v), end)


def filtered(window: RecentWindow, take: np.ndarray, end: int, trim: int) -> RecentWindow:
    """Sequences ``take`` kept, ``trim`` leading rows dropped."""
    lo, k, v = held(window, end)
    if len(take) == 0:
        k = v = None
    if k is not None:
        idx = mx.array(take.astype(np.int32))
        k, v = mx.take(k, idx, axis=0), mx.take(v, idx, axis=0)
    return rebuilt(window.size, (max(lo - trim, 0), k, v), end - trim)


def plain_rows(keys: mx.array, values: mx.array, end: int, size: int) -> Rows:
    """Rows ``[end - size - 1, end)`` of unquantized buffers (all exact)."""
    lo = max(end - size - 1, 0)
    return lo, keys[..., lo:end, :], values[..., lo:end, :]


def newest_rows(keys: mx.array, values: mx.array, end: int) -> Rows:
    """Unquantized rows in order, the last at position ``end - 1``: as
    many as they hold."""
    return end - keys.shape[2], keys, values


def joined(size: int, sides: Sequence[Tuple[Rows, int, int]], end: int) -> RecentWindow:
    """One window over sides stacked along the batch (``extend``,
    ``merge``), each ``(rows, side_end, sequences)``: a batch's or a single
    sequence's exact rows in its own positions, right-aligned at ``end``
    (the rows before ``end - side_end`` become its padding). Padding inside
    the window reads zeros, which the mask hides; real tokens a side holds
    no exact row for start the window after them."""
    first = max(end - size - 1, 0)
    width = end - first
    live = [(r, e, B) for r, e, B in sides if B > 0]
    ref = next((r for r, _, _ in live if r[1] is not None), None)
    if ref is None or width == 0:
        return rebuilt(size, (end, None, None), end)
    start, ks, vs = first, [], []
    for (lo, k, v), side_end, B in live:
        shift = end - side_end
        exact_from = max(lo + shift if k is not None else end, first)
        if (k is None and side_end > 0) or (k is not None and lo > 0):
            start = max(start, exact_from)  # real tokens there are not held exactly
        keep = min(end - exact_from, width)
        rows = []
        for like, t in ((ref[1], k), (ref[2], v)):
            zeros = mx.zeros((B, like.shape[1], width - keep, like.shape[3]), like.dtype)
            rows.append(zeros if keep == 0 else mx.concatenate([zeros, t[..., -keep:, :]], axis=2))
        ks.append(rows[0])
        vs.append(rows[1])
    k, v = mx.concatenate(ks, axis=0), mx.concatenate(vs, axis=0)
    return rebuilt(size, (start, k, v), end)


def sequence_rows(window: RecentWindow, b: int, end: int, pad: int) -> Rows:
    """Sequence ``b``'s exact rows in its own positions (``pad`` rows of
    padding before it)."""
    lo, k, v = held(window, end)
    if k is None:
        return end - pad, None, None
    first = max(lo, pad)
    k = k[b : b + 1, :, first - lo :, :]
    v = v[b : b + 1, :, first - lo :, :]
    return first - pad, k, v


__all__ = [
    "held",
    "rebuilt",
    "widened",
    "rolled",
    "filtered",
    "plain_rows",
    "newest_rows",
    "joined",
    "sequence_rows",
]
