"""The quantization options mlxq's kernels support: bits per element and
group sizes of MLX's affine quantization (``mx.quantize``). One source, the
extension's ``csrc/quantization.h``."""

from ._ext import SUPPORTED_BITS as BITS
from ._ext import SUPPORTED_GROUP_SIZES as GROUP_SIZES
from .guard import MlxqOnly

__all__ = ["BITS", "GROUP_SIZES", "FormattedTriple", "triple_format"]


class FormattedTriple(MlxqOnly, tuple):
    """A ``(packed, scales, biases)`` triple that carries its own
    ``group_size`` and ``bits``: what a cache with separate K and V
    quantization hands out for its values, whose width the shapes alone
    cannot tell (the value head dim is not known). :func:`mlxq.quantized_sdpa`
    reads them when ``v_bits`` / ``v_group_size`` are not given. Only mlxq
    may unpack it (see mlxq.guard)."""

    WHAT = "values quantized apart from the keys"

    def __new__(cls, triple, group_size: int, bits: int):
        obj = super().__new__(cls, triple)
        obj.group_size, obj.bits = group_size, bits
        return obj


def triple_format(t):
    """``(group_size, bits)`` a triple carries, or ``(None, None)``."""
    return getattr(t, "group_size", None), getattr(t, "bits", None)
