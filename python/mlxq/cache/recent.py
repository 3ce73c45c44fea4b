"""An exact window of the most recent tokens next to a quantized cache.

Measured on trained models (README, "Real weights"), most of 4-bit KV's
accuracy loss comes from the last ~100 tokens: the keys a query attends
most. A quantized cache with ``keep_recent=R`` therefore also keeps the last
``R`` tokens' keys and values as they came (a ring of ``R`` rows in the
input dtype) and attends in two exact parts whose softmax states merge by
log-sum-exp (:func:`mlxq.attention.merge_attention`):

* the quantized rows of every token before the window, through the fused
  kernel, and
* the window plus the step's own tokens, as plain attention.

Every token is still written to the quantized buffers (so ``state``, files
and a later ``keep_recent=0`` see the whole sequence); the window only
changes which copy attention reads. Its bytes are ``2 * R * D`` elements per
KV head, whatever the context length.
"""

from typing import Optional

import mlx.core as mx

from ..ring import ring_update


class RecentWindow:
    """The ring of a cache's last ``size`` tokens, exact.

    ``start`` is the first position the ring may serve: positions before it
    were never held (a cache restored from a state, or trimmed) and are read
    quantized.
    """

    def __init__(self, size: int):
        self.size = size
        self.keys: Optional[mx.array] = None
        self.values: Optional[mx.array] = None
        self.start = 0

    def reset(self, offset: int) -> None:
        """Nothing before ``offset`` is held exactly any more."""
        self.start = offset

    def first_exact(self, offset: int) -> int:
        """The first position a step appending at ``offset`` reads exactly."""
        return min(offset, max(offset - self.size, self.start, 0))

    def _span(self, ring: mx.array, lo: int, hi: int) -> mx.array:
        """Positions [lo, hi) from the ring, oldest first (hi - lo <= size)."""
        a, n = lo % self.size, hi - lo
        if a + n <= self.size:
            return ring[..., a : a + n, :]
        return mx.concatenate([ring[..., a:, :], ring[..., : a + n - self.size, :]], axis=2)

    def step(self, keys: mx.array, values: mx.array, offset: int):
        """The exact keys and values of a step appending ``keys``/``values``
        ``[B, H, T, D]`` at ``offset`` (the held window, then the step's
        rows), and the ring updated with the step's last rows. Returns
        ``(first exact position, keys, values)``."""
        lo = self.first_exact(offset)
        if lo < offset:
            k = mx.concatenate([self._span(self.keys, lo, offset), keys], axis=2)
            v = mx.concatenate([self._span(self.values, lo, offset), values], axis=2)
        else:
            k, v = keys, values
        self._write(keys, values, offset)
        return lo, k, v

    def _write(self, keys: mx.array, values: mx.array, offset: int) -> None:
        T = keys.shape[2]
        if (
            self.keys is None
            or self.keys.dtype != keys.dtype
            or self.keys.shape[:2] != keys.shape[:2]
        ):
            B, H, _, D = keys.shape
            self.keys = mx.zeros((B, H, self.size, D), keys.dtype)
            self.values = mx.zeros((B, H, self.size, values.shape[3]), values.dtype)
        m = min(T, self.size)
        pos = (offset + T - m) % self.size
        self.keys = ring_update(self.keys, keys[..., T - m :, :], pos)
        self.values = ring_update(self.values, values[..., T - m :, :], pos)

    def fill(self, keys: mx.array, values: mx.array, offset: int) -> None:
        """Hold the last tokens of plain ``keys``/``values`` ``[B, H, offset,
        D]`` (a cache being quantized): the window starts exact."""
        lo = max(0, offset - self.size)
        self.keys = self.values = None
        if offset > lo:
            self._write(keys[..., lo:offset, :], values[..., lo:offset, :], lo)
        self.start = 0

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.nbytes + self.values.nbytes


__all__ = ["RecentWindow"]
