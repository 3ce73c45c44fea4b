"""The quantization options mlxq's kernels support: bits per element and
group sizes of MLX's affine quantization (``mx.quantize``). One source, the
extension's ``csrc/quantization.h``."""

from ._ext import SUPPORTED_BITS as BITS
from ._ext import SUPPORTED_GROUP_SIZES as GROUP_SIZES

__all__ = ["BITS", "GROUP_SIZES"]
