"""What the quantized caches share: their format's constructor arguments
(with the deprecated names), ``to_quantized`` of a cache that already is,
and a whole unquantized buffer taken in quantized."""

from typing import Optional, Tuple

from ..arguments import renamed
from ..kv_format import KVFormat
from . import checks
from ._store import Latent, Quantized


def options(
    where: str,
    hadamard: Optional[bool],
    recent: Optional[int] = None,
    kv_rotate: Optional[bool] = None,
    keep_recent: Optional[int] = None,
) -> Tuple[bool, int]:
    """``(hadamard, recent)`` of a constructor, taking the deprecated names
    ``kv_rotate`` and ``keep_recent`` too (the warnings point at its caller)."""
    hadamard = renamed(hadamard, kv_rotate, "hadamard", "kv_rotate", where, False, stacklevel=4)
    recent = renamed(recent, keep_recent, "recent", "keep_recent", where, 0, stacklevel=4)
    return (False if hadamard is None else hadamard), (0 if recent is None else recent)


def store(cache) -> Quantized:
    """The storage of ``cache.format``, checked (ValueError naming the field)."""
    format = cache.format.checked(cache._where("__init__"))
    return Latent(format) if format.latent else Quantized(format)


def already_quantized(
    cache,
    group_size: int = 64,
    bits: int = 4,
    hadamard: bool = False,
    v_group_size: Optional[int] = None,
    v_bits: Optional[int] = None,
    *,
    kv_rotate: Optional[bool] = None,
    latent: Optional[bool] = None,
):
    """``to_quantized`` of a quantized cache: itself, if the format matches
    (``latent=None``: whatever the cache is)."""
    where = cache._where("to_quantized")
    hadamard, _ = options(where, hadamard, kv_rotate=kv_rotate)
    latent = cache.format.latent if latent is None else latent
    want = KVFormat(group_size, bits, v_group_size, v_bits, hadamard, latent)
    if want != cache.format:
        raise ValueError(
            f"[{where}] the cache is quantized as {cache.format}; cannot requantize to {want}."
        )
    return cache


def encode_buffers(cache, keys, values) -> None:
    """``cache`` takes unquantized ``keys``/``values`` buffers, quantized
    whole (``to_quantized``): fresh ``mx.quantize`` outputs, its own."""
    checks.update(cache, keys, values)
    cache.keys = cache._store.encode(keys)
    cache.values = cache._store.encode(values, values=True)
    cache._owned = True
