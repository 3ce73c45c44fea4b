"""An exact window of the most recent tokens next to a quantized cache.

Measured on trained models (docs/results/accuracy.md), most of 4-bit KV's
accuracy loss comes from the last ~100 tokens: the keys a query attends
most. A quantized cache with ``recent=R`` therefore also keeps the last
``R`` tokens' keys and values as they came (a ring of ``R + 1`` rows in the
input dtype) and attends in two exact parts whose softmax states merge by
log-sum-exp (at decode, one op: on CUDA the decode kernel's own blocks,
on the CPU :func:`mlxq.attention.recent_attention`; otherwise
:func:`mlxq.attention.merge_attention`):

* the quantized rows of every token before the window, through the fused
  kernel, and
* the window plus the step's own tokens, as plain attention.

Every token is still written to the quantized buffers (so ``state``, files
and a later ``recent=0`` see the whole sequence); the window only
changes which copy attention reads. Its bytes are ``2 * (R + 1) * D``
elements per KV head, whatever the context length.
"""

import functools
from typing import Optional

import mlx.core as mx
import numpy as np

from .. import _ext


class RecentWindow:
    """The ring of a cache's last ``size`` tokens, exact.

    The ring has ``size + 1`` slots, so that a one-token step writes its
    token first and then attends the whole ring as laid out (the ``size``
    held tokens and itself): no reordering per step. The slot a step
    overwrites is one the previous step read: the write goes in place once
    an evaluation has taken that step (see :meth:`decode_rings`), and a
    ring an unevaluated earlier step still holds (a lazily evaluated loop
    of one-token steps) is copied first. A growing quantized cache writes
    the ring in its own write op (one node per layer).
    ``start`` is the first position the ring may serve: positions before it
    were never held (a cache restored from a state, or trimmed) and are read
    quantized.
    """

    def __init__(self, size: int):
        self.size = size
        self.slots = size + 1
        self.keys: Optional[mx.array] = None
        self.values: Optional[mx.array] = None
        self.start = 0
        # The rings are this window's alone: its own writes made them, and
        # nothing but a step's attention (see decode_rings) has read them.
        self._owned = False

    def __copy__(self):
        # The rings shared (a cache's copy): each side's next write copies.
        other = type(self).__new__(type(self))
        other.__dict__.update(self.__dict__)
        self._owned = other._owned = False
        return other

    def reset(self, offset: int) -> None:
        """Nothing before ``offset`` is held exactly any more."""
        self.start = offset

    def first_exact(self, offset: int) -> int:
        """The first position a step appending at ``offset`` reads exactly."""
        return min(offset, max(offset - self.size, self.start, 0))

    def span(self, ring: mx.array, lo: int, hi: int) -> mx.array:
        """Positions [lo, hi) from the ring, oldest first (hi - lo <= slots):
        views, so the ring's next write copies."""
        self._owned = False
        a, n = lo % self.slots, hi - lo
        if a + n <= self.slots:
            return ring[..., a : a + n, :]
        return mx.concatenate([ring[..., a:, :], ring[..., : a + n - self.slots, :]], axis=2)

    def _fits(self, keys: mx.array) -> bool:
        return (
            self.keys is not None
            and self.keys.dtype == keys.dtype
            and self.keys.shape[:2] == keys.shape[:2]
        )

    def step(self, keys: mx.array, values: mx.array, offset: int):
        """The exact keys and values of a step appending ``keys``/``values``
        ``[B, H, T, D]`` at ``offset``, and the ring updated with the step's
        last rows. Returns ``(lo, keys, values, order)``: the step reads
        positions ``[lo, offset + T)`` exactly; ``order`` is None when the
        rows are those positions in order, else (a one-token step with a
        full window: the ring itself) each row's index in that range."""
        rings = self.decode_rings(keys, offset)
        if rings is not None:
            self._write(keys, values, offset, owned=rings[2])
            return self.decoded(self.keys, self.values, offset)
        lo = self.first_exact(offset)
        if not self._fits(keys):  # a new ring: nothing before the step is held
            self._write(keys, values, offset)
            return offset, keys, values, None
        # One host call (csrc/ring_update.h): the span's views, the joined
        # rows and the two ring writes, which copy (the spans read the rings).
        T = keys.shape[2]
        pos = (offset + T - min(T, self.slots)) % self.slots
        k, v, self.keys, self.values = _ext.window_step(
            self.keys, self.values, keys, values, start=lo % self.slots, span=offset - lo, pos=pos
        )
        self._owned = True
        return lo, k, v, None

    def decode_rings(self, keys: mx.array, offset: int):
        """For a one-token step at ``offset`` with the window full (a decode
        step): ``(keys ring, values ring, owned)`` for one write to update
        at slot ``offset % slots``, else None. ``owned``: the write may go
        in place whatever MLX's donation rule says. The slot holds the
        token the previous step read, and once an evaluation has taken
        that step's graph (generate_step's pipeline) it runs first on the
        stream; MLX's GPU backends keep an in-flight graph's inputs alive,
        so donation alone would copy both rings every step. In a lazily
        evaluated loop the previous step still reads the slot, and the
        write copies."""
        # The window is full when it starts `size` positions back (the
        # step's own token is the ring's last slot): first_exact's rule.
        lo = offset - self.size
        if lo < 0 or lo < self.start or keys.shape[2] != 1 or not self._fits(keys):
            return None
        return self.keys, self.values, self._owned and _ext._scheduled(self.keys)

    def decoded(self, ring_k: mx.array, ring_v: mx.array, offset: int):
        """:meth:`step`'s result for the decode step at ``offset`` once
        ``ring_k`` / ``ring_v`` hold its token (see :meth:`decode_rings`)."""
        self.keys, self.values = ring_k, ring_v
        self._owned = True  # written in place, donated or copied: ours alone
        lo = offset - self.size
        return lo, ring_k, ring_v, self._order(lo % self.slots)

    def _order(self, shift: int) -> np.ndarray:
        """Each ring slot's index in a full window starting at slot ``shift``."""
        if self.slots > _TABLED_SLOTS:
            return (np.arange(self.slots) - shift) % self.slots
        return _ring_orders(self.slots)[shift]

    def _write(self, keys: mx.array, values: mx.array, offset: int, owned: bool = False) -> None:
        T = keys.shape[2]
        if not self._fits(keys):
            B, H, _, D = keys.shape
            self.keys = mx.zeros((B, H, self.slots, D), keys.dtype)
            self.values = mx.zeros((B, H, self.slots, values.shape[3]), values.dtype)
            self.start = offset  # a new ring: nothing before this step is held
        m = min(T, self.slots)
        if m < T:  # only the last rows fit
            keys, values = keys[..., T - m :, :], values[..., T - m :, :]
        pos = (offset + T - m) % self.slots
        self.keys = _ext.ring_update(self.keys, keys, pos, owned=owned)
        self.values = _ext.ring_update(self.values, values, pos, owned=owned)
        self._owned = True  # written in place, donated or copied: ours alone

    def trimmed(self, old: int, offset: int) -> None:
        """The cache went back from ``old`` tokens to ``offset``: the ring
        holds at least [old - size, old), so what of it lies below the new
        offset stays readable; below that, only new writes will be."""
        self.start = min(max(self.start, old - self.size), offset)

    def fill(self, keys: mx.array, values: mx.array, offset: int) -> None:
        """Hold the newest of plain rows ``keys``/``values`` ``[B, H, S, D]``,
        oldest first, the last at position ``offset - 1`` (a cache being
        quantized): the window starts exact."""
        m = min(self.slots, keys.shape[2], offset)
        self.keys = self.values = None
        if m:
            self._write(keys[..., -m:, :], values[..., -m:, :], offset - m)
        self.start = offset - min(m, self.size)

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.nbytes + self.values.nbytes


# Rings up to this many slots share a table of their orders (2 MB at most).
_TABLED_SLOTS = 512


@functools.lru_cache(maxsize=8)
def _ring_orders(slots: int) -> np.ndarray:
    """Row ``shift``: each slot's index in a full ring of ``slots`` whose
    oldest token is at slot ``shift``. Made once per ring size and shared by
    every layer, so that no decode step builds one (a step's host time)."""
    orders = (np.arange(slots)[None, :] - np.arange(slots)[:, None]) % slots
    orders.flags.writeable = False
    return orders


def window_for(current: Optional[RecentWindow], size: int, offset: int):
    """A cache's recent window of ``size`` tokens: ``current`` if it has
    that size, else a new one (serving from ``offset``), or None for 0."""
    if not size:
        return None
    if current is not None and current.size == size:
        return current
    window = RecentWindow(size)
    window.reset(offset)
    return window


__all__ = ["RecentWindow", "window_for"]
