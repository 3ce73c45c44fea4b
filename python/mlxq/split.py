"""The fetch of a quantized cache that keeps its recent tokens exact (see
mlxq.cache.recent): a leaf module, so attention and the caches share it."""

from typing import NamedTuple, Optional

import mlx.core as mx
import numpy as np

from .guard import MlxqOnly, entries, first
from .kv_format import FormattedTriple


class _RecentSplitFields(NamedTuple):
    quantized: tuple
    exact: mx.array
    visible: Optional[mx.array] = None
    columns: Optional[np.ndarray] = None
    rows: Optional[int] = None


class RingColumns:
    """The mask columns of a ring's decode step's exact rows, made when a
    mask asks for them (:attr:`RecentSplit.exact_columns`): row ``i`` is
    column ``keep + (shift + order[i]) % span``. A decode step's mask is
    mostly None, and the numpy arithmetic is host time on every step of
    every sliding-window layer."""

    __slots__ = ("keep", "span", "shift", "order")

    def __init__(self, keep: int, span: int, shift: int, order: np.ndarray):
        self.keep, self.span, self.shift, self.order = keep, span, shift, order

    def __array__(self, dtype=None, copy=None):
        columns = self.keep + (self.shift + self.order) % self.span
        return columns if dtype is None else columns.astype(dtype)


class RecentSplit(MlxqOnly, _RecentSplitFields):
    """Keys (or values) of one attention step in two parts: ``quantized``,
    a triple of ``n`` rows as the cache hands triples out, and ``exact``, an
    array ``[B, H, T, D]`` of the window's rows.

    The step's mask covers ``n + T`` columns. By default the quantized rows
    are columns ``[0, n)`` and the exact rows follow in order, every
    quantized row preceding every query. A decode step may instead hand out
    its buffers as laid out in their rings:

    * ``visible``: a bool array ``[n]``, False where a quantized row is a
      window token (a sliding-window ring holds every token once); attention
      skips those rows there.
    * ``columns``: for each exact row, its column in the step's mask (numpy
      int64 ``[T]``, or a :class:`RingColumns` that makes them;
      :attr:`exact_columns` reads either); then the quantized part covers
      all ``n`` columns.

    A cache may also hand over longer buffers as ``quantized`` with
    ``rows`` = ``n``: the part is their rows ``[0, n)``
    (:attr:`quantized_rows`), which the op takes as views at eval, so the
    cache's write makes no fetch views. A step of rows in order hands over
    at least ``n + T`` rows (the window's tokens and its own are quantized
    too): attention over the dequantized rows then dequantizes them at once
    and writes the exact rows over the last ``T``.

    Only mlxq may unpack or index it (see mlxq.guard); the fields read as
    attributes.
    """

    __slots__ = ()
    WHAT = "an exact window of recent tokens beside quantized rows (recent)"

    @property
    def quantized_length(self) -> int:
        if self.rows is not None:
            return self.rows
        return first(self.quantized).shape[2]  # every attention call reads it

    @property
    def quantized_rows(self) -> tuple:
        """The quantized part itself: ``quantized``, or views of its rows
        ``[0, rows)`` when it holds whole buffers (in the same tuple type:
        a cache's :class:`~mlxq.kv_format.FormattedTriple` stays one)."""
        t = self.quantized
        if self.rows is None:
            return t
        cut = [a[..., : self.rows, :] for a in entries(t)]
        if isinstance(t, FormattedTriple):
            return FormattedTriple(cut, t.format, t.values)
        return tuple(cut) if isinstance(t, tuple) else cut

    @property
    def exact_columns(self) -> Optional[np.ndarray]:
        """``columns`` as a numpy array (None when the rows are in order)."""
        return None if self.columns is None else np.asarray(self.columns)

    @property
    def mask_columns(self) -> int:
        """How many columns the step's mask covers."""
        n = self.quantized_length
        return n if self.visible is not None else n + self.exact.shape[2]


def is_split(x) -> bool:
    return isinstance(x, RecentSplit)


__all__ = ["RecentSplit", "RingColumns", "is_split"]
