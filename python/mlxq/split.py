"""The fetch of a quantized cache that keeps its recent tokens exact (see
mlxq.cache.recent): a leaf module, so attention and the caches share it."""

from typing import NamedTuple

import mlx.core as mx


class RecentSplit(NamedTuple):
    """Keys (or values) of one attention step, cut where the exact window
    starts: ``quantized`` holds the triple of positions ``[0, n)`` (as the
    cache hands triples out), ``exact`` the array ``[B, H, T, D]`` of
    positions ``[n, offset)``, in order. The step's queries are the last of
    those positions, so every quantized row precedes every query."""

    quantized: tuple
    exact: mx.array

    @property
    def quantized_length(self) -> int:
        return self.quantized[0].shape[2]


def is_split(x) -> bool:
    return isinstance(x, RecentSplit)


__all__ = ["RecentSplit", "is_split"]
