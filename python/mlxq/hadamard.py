"""K/V quantized in a Walsh-Hadamard basis, attended unchanged.

Keys with a few large channels (outliers) quantize badly: one group's scale
is set by its largest element. An orthonormal Walsh-Hadamard transform ``H``
spreads every channel over all of them, so after ``k -> H k`` the groups are
even and 4-bit codes lose much less. Attention is unchanged in exact
arithmetic: ``(H q) . (H k) = q . k``, and with values stored as ``H v`` the
output comes back as ``H^T (P (H V)) = P V``. ``H`` (scaled by ``1/sqrt(D)``)
is symmetric and its own inverse, and :func:`mx.hadamard_transform` applies
it in ``O(D log D)``.

A cache built with ``hadamard=True`` stores ``quantize(H k)`` and
``quantize(H v)`` and hands out :class:`~mlxq.kv_format.FormattedTriple`
fetches whose format says so: :func:`mlxq.sdpa` rotates the queries for
such keys and the output back for such values. The cache is never
dequantized.
"""

import mlx.core as mx

from .kv_format import FormattedTriple, KVFormat


def check_head_dim(D: int, where: str) -> None:
    """Raises ValueError unless D is a power of two (from 2 to 8192).

    mx.hadamard_transform also takes 12, 20 or 28 times a power of two, but
    those matrices are not symmetric, so the transform would not be its own
    inverse; the head dims mlxq's kernels cover are powers of two anyway.
    """
    if not (2 <= D <= 8192 and D & (D - 1) == 0):
        raise ValueError(f"[{where}] hadamard needs a head dim that is a power of two, got {D}.")


def transform(x: mx.array, stream=None) -> mx.array:
    """``H x`` along the last axis (orthonormal; applying it twice is the identity)."""
    return mx.hadamard_transform(x, stream=stream)


def quantize(x: mx.array, group_size: int = 64, bits: int = 4) -> FormattedTriple:
    """``x`` quantized in the Hadamard basis, as a fetch :func:`mlxq.sdpa`
    attends as ``x`` (keys or values alike: the format is the same)."""
    check_head_dim(x.shape[-1], "mlxq.hadamard.quantize")
    triple = mx.quantize(transform(x), group_size=group_size, bits=bits)
    return FormattedTriple(triple, KVFormat(group_size, bits, hadamard=True))
