"""How a quantized cache stores its rows, and the fetch that carries it.

:class:`KVFormat` is one frozen value: the keys' ``group_size`` and ``bits``
(in :func:`mx.quantize`'s order), the values' own when they differ, and
whether rows are stored in the Hadamard basis (see mlxq.hadamard), and
whether the cache is an MLA latent cache (quantized latent, exact RoPE
keys). A quantized cache's store owns it and writes it into the cache's
``state``.

A fetch of plain same-width rows stays the ``(packed, scales, biases)``
tuple that mlx-lm's own attention reads. Any other format is handed out as
a :class:`FormattedTriple`: a tuple that carries its format and refuses to
be unpacked or indexed outside mlxq (see mlxq.guard), because code that
reads it as plain rows would return plausible, wrong numbers.
"""

import dataclasses
from typing import Optional, Tuple

from ._ext import SUPPORTED_BITS as BITS
from ._ext import SUPPORTED_GROUP_SIZES as GROUP_SIZES
from .arguments import as_int
from .guard import MlxqOnly


def check_quantization(group_size, bits, where: str, prefix: str = "") -> None:
    """ValueError unless mlxq's kernels take (group_size, bits); ``prefix``
    ("v_") names the values' own."""
    if group_size not in GROUP_SIZES:
        raise ValueError(
            f"[{where}] {prefix}group_size must be one of {GROUP_SIZES}, got {group_size!r}."
        )
    if bits not in BITS:
        raise ValueError(f"[{where}] {prefix}bits must be one of {BITS}, got {bits!r}.")


@dataclasses.dataclass(frozen=True)
class KVFormat:
    """A quantized cache's storage format.

    Attributes:
        group_size (int): The keys' quantization group size.
        bits (int): The keys' bits per element.
        v_group_size (int): The values' group size (default: ``group_size``).
        v_bits (int): The values' bits (default: ``bits``; ``bits=8,
          v_bits=4`` is llama.cpp's q8_0-K / q4_0-V pairing).
        hadamard (bool): Rows quantized in the Hadamard basis (mlxq.hadamard).
        latent (bool): An MLA latent cache (DeepSeek-V3, Kimi K2 and their
          kin, which write ``update_and_fetch(kv_latent, k_pe)``): the first
          slot, the latent, is quantized; the second, the RoPE keys the
          model multiplies itself, stays exact (see mlxq.cache.latent).
    """

    group_size: int = 64
    bits: int = 4
    v_group_size: Optional[int] = None
    v_bits: Optional[int] = None
    hadamard: bool = False
    latent: bool = False

    def __post_init__(self):
        if self.v_group_size is None:
            object.__setattr__(self, "v_group_size", self.group_size)
        if self.v_bits is None:
            object.__setattr__(self, "v_bits", self.bits)
        # Read at every decode step's fetch (see fetch): kept, not a field.
        object.__setattr__(self, "_mlxq_only", bool(self.hadamard) or self.separate)

    def checked(self, where: str) -> "KVFormat":
        """``self``, or a ValueError naming the field mlxq's kernels do not take."""
        check_quantization(self.group_size, self.bits, where)
        check_quantization(self.v_group_size, self.v_bits, where, prefix="v_")
        for name in ("hadamard", "latent"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"[{where}] {name} must be a bool, got {getattr(self, name)!r}.")
        if self.latent and (self.hadamard or self.side(True) != self.side(False)):
            raise ValueError(
                f"[{where}] a latent cache quantizes only its latent, with group_size and "
                f"bits: it takes no hadamard, v_group_size or v_bits."
            )
        return self

    def side(self, values: bool = False) -> Tuple[int, int]:
        """``(group_size, bits)`` of the keys, or of the values."""
        return (self.v_group_size, self.v_bits) if values else (self.group_size, self.bits)

    @property
    def separate(self) -> bool:
        """Whether the values are quantized apart from the keys."""
        return self.side(True) != self.side(False)

    @property
    def mlxq_only(self) -> bool:
        """Whether only mlxq's attention reads rows of this format correctly."""
        return self._mlxq_only

    def kwargs(self) -> dict:
        """The format as a cache constructor's keywords (``latent`` only when
        set: ring caches take no such keyword)."""
        out = dataclasses.asdict(self)
        if not self.latent:
            del out["latent"]
        return out

    # ``state`` holds mlx-lm's entries, then these only where mlx-lm has
    # nothing to say: (1,) for a Hadamard cache of one quantization,
    # (hadamard, v_group_size, v_bits) for separate values, and
    # (hadamard, v_group_size, v_bits, 1) for a latent cache. A state without
    # them is mlx-lm's own.
    def extras(self) -> tuple:
        """The trailing ``state`` entries of this format."""
        if self.latent:
            return (int(self.hadamard), self.v_group_size, self.v_bits, 1)
        if self.separate:
            return (int(self.hadamard), self.v_group_size, self.v_bits)
        return (1,) if self.hadamard else ()

    def with_extras(self, extras: tuple, where: str) -> "KVFormat":
        """This format's keys with the values and basis a state's trailing
        entries give (see :meth:`extras`)."""
        if len(extras) not in (0, 1, 3, 4):
            raise ValueError(
                f"[{where}] a quantized state ends with (), (hadamard,), "
                f"(hadamard, v_group_size, v_bits) or (hadamard, v_group_size, v_bits, latent); "
                f"got {len(extras)} extra entries."
            )
        if not extras:
            return KVFormat(self.group_size, self.bits)
        hadamard = as_int(extras[0], "hadamard", where)
        allowed = (1,) if len(extras) == 1 else (0, 1)
        if hadamard not in allowed:
            raise ValueError(
                f"[{where}] a state's hadamard entry must be one of {allowed}, got {hadamard}."
            )
        values = (None, None)
        if len(extras) >= 3:
            values = (
                as_int(extras[1], "v_group_size", where),
                as_int(extras[2], "v_bits", where),
            )
        latent = False
        if len(extras) == 4:
            if as_int(extras[3], "latent", where) != 1:
                raise ValueError(f"[{where}] a state's latent entry must be 1, got {extras[3]}.")
            latent = True
        return KVFormat(self.group_size, self.bits, *values, bool(hadamard), latent)


class FormattedTriple(MlxqOnly, tuple):
    """A ``(packed, scales, biases)`` triple of keys or values (``values``)
    stored in ``format``, one that only mlxq reads correctly: rows in the
    Hadamard basis, or values quantized apart from the keys (whose width the
    shapes alone cannot tell). :func:`mlxq.sdpa` reads the format from it;
    only mlxq may unpack it (see mlxq.guard)."""

    def __new__(cls, triple, format: KVFormat, values: bool = False):
        obj = super().__new__(cls, triple)
        obj.format, obj.values = format, values
        return obj

    @property
    def WHAT(self) -> str:
        if self.format.hadamard:
            return "rows quantized in the Hadamard basis (hadamard)"
        return "values quantized apart from the keys (v_bits / v_group_size)"

    @property
    def group_size(self) -> int:
        return self.format.side(self.values)[0]

    @property
    def bits(self) -> int:
        return self.format.side(self.values)[1]


def fetch(triple, format: KVFormat, values: bool = False):
    """``triple`` as a cache hands it out: a plain tuple in a format anyone
    reads, else a :class:`FormattedTriple`."""
    if format.mlxq_only:
        return FormattedTriple(triple, format, values)
    return tuple(triple)


def format_of(t) -> Optional[KVFormat]:
    """The format a fetch carries, or None (a plain triple)."""
    return t.format if isinstance(t, FormattedTriple) else None


def is_hadamard(t) -> bool:
    """Whether a fetch holds rows in the Hadamard basis."""
    return isinstance(t, FormattedTriple) and t.format.hadamard


__all__ = [
    "BITS",
    "GROUP_SIZES",
    "FormattedTriple",
    "KVFormat",
    "check_quantization",
    "fetch",
    "format_of",
    "is_hadamard",
]
