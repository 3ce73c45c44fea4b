"""Rotated K/V: quantized in a Walsh-Hadamard basis, attended unchanged.

Keys with a few large channels (outliers) quantize badly: one group's scale
is set by its largest element. An orthonormal Walsh-Hadamard transform ``H``
spreads every channel over all of them, so after ``k -> H k`` the groups are
even and 4-bit codes lose much less. Attention is unchanged in exact
arithmetic: ``(H q) . (H k) = q . k``, and with values stored as ``H v`` the
output comes back as ``H^T (P (H V)) = P V``. ``H`` (scaled by ``1/sqrt(D)``)
is symmetric and its own inverse, and :func:`mx.hadamard_transform` applies
it in ``O(D log D)``.

A cache built with ``kv_rotate=True`` stores ``quantize(H k)`` and
``quantize(H v)`` and hands out its triples as :class:`RotatedTriple`, which
:func:`mlxq.quantized_sdpa` recognises: it rotates the queries for rotated
keys and the output back for rotated values. The cache is never dequantized.
"""

from typing import Tuple

import mlx.core as mx

from .guard import MlxqOnly
from .quantization import FormattedTriple


class RotatedTriple(MlxqOnly, tuple):
    """A ``(packed, scales, biases)`` triple of rows stored in the Hadamard
    basis (``mx.quantize(hadamard(x))``): a tuple that says so, and that only
    mlxq may unpack (see mlxq.guard)."""

    __slots__ = ()
    WHAT = "rows quantized in the Hadamard basis (kv_rotate)"


def is_rotated(x) -> bool:
    return isinstance(x, RotatedTriple)


class RotatedFormattedTriple(FormattedTriple, RotatedTriple):
    """Rotated, with its own quantization (see :class:`~mlxq.quantization.FormattedTriple`)."""

    WHAT = "values quantized apart from the keys, in the Hadamard basis (kv_rotate)"


def mark(t: Tuple[mx.array, mx.array, mx.array]):
    """``t`` marked as rotated (keeping the format it carries, if any)."""
    if isinstance(t, RotatedTriple):
        return t
    if isinstance(t, FormattedTriple):
        return RotatedFormattedTriple(t, t.group_size, t.bits)
    return RotatedTriple(t)


def check_head_dim(D: int, where: str) -> None:
    """Raises ValueError unless D is a power of two (from 2 to 8192).

    mx.hadamard_transform also takes 12, 20 or 28 times a power of two, but
    those matrices are not symmetric, so the transform would not be its own
    inverse; the head dims mlxq's kernels cover are powers of two anyway.
    """
    if not (2 <= D <= 8192 and D & (D - 1) == 0):
        raise ValueError(f"[{where}] kv_rotate needs a head dim that is a power of two, got {D}.")


def rotate(x: mx.array, stream=None) -> mx.array:
    """``H x`` along the last axis (orthonormal; applying it twice is the identity)."""
    return mx.hadamard_transform(x, stream=stream)
