"""KV sharing: a donor layer's fetched keys and values, handed to sharer layers.

Models such as Gemma 3n/4 compute K/V in their first layers only; later
layers attend over a donor layer's cache instead of keeping one. A
:class:`SharedKV` carries what those layers need: the donor's fetch (plain
arrays or quantized triples), its offset (the RoPE position of the step) and,
for triples, the bits and group size, so a sharer calls the right kernel
without knowing the donor's cache type.
"""

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from ..attention import is_quantized, sdpa
from ..kv_format import KVFormat, check_quantization, format_of
from ._store import Quantized


@dataclass(frozen=True)
class SharedKV:
    """Fetched K/V of a donor layer.

    Attributes:
        keys: ``[B, H, N, Dk]`` array, or its ``(packed, scales, biases)`` triple.
        values: ``[B, H, N, Dv]`` array, or its triple.
        offset (int): Tokens the donor had seen after the update (the step's
          RoPE offset is ``offset - T`` for a ``T``-token step).
        group_size (int, optional): Quantization group size (triples only).
        bits (int, optional): Quantization bits (triples only).
        v_group_size, v_bits (int, optional): The values' own, when a donor
          quantizes them apart from the keys (default: what the values
          triple carries, else ``group_size`` / ``bits``).
    """

    keys: object
    values: object
    offset: int
    group_size: Optional[int] = None
    bits: Optional[int] = None
    v_group_size: Optional[int] = None
    v_bits: Optional[int] = None

    def __post_init__(self):
        where = "mlxq.SharedKV"
        if is_quantized(self.keys) != is_quantized(self.values):
            raise ValueError(f"[{where}] keys and values must both be arrays or both be triples.")
        if isinstance(self.offset, bool) or not isinstance(self.offset, int) or self.offset < 0:
            raise ValueError(f"[{where}] offset must be an int >= 0, got {self.offset!r}.")
        if self.quantized:
            if self.group_size is None or self.bits is None:
                raise ValueError(f"[{where}] quantized keys/values need group_size and bits.")
            check_quantization(self.group_size, self.bits, where)
            # A donor's fetch in a format only mlxq reads carries it.
            carried = format_of(self.values) or format_of(self.keys)
            if carried is not None:
                group, bits = carried.side(values=True)
                if self.v_group_size is None:
                    object.__setattr__(self, "v_group_size", group)
                if self.v_bits is None:
                    object.__setattr__(self, "v_bits", bits)
            hadamard = carried is not None and carried.hadamard
            fmt = KVFormat(self.group_size, self.bits, self.v_group_size, self.v_bits, hadamard)
            fmt.checked(where)
            object.__setattr__(self, "v_group_size", fmt.v_group_size)
            object.__setattr__(self, "v_bits", fmt.v_bits)
            store = Quantized(fmt)
            object.__setattr__(self, "keys", store.fetched(store.check(self.keys, "keys", where)))
            object.__setattr__(
                self, "values", store.fetched(store.check(self.values, "values", where), True)
            )
            k, v = self.keys[0], self.values[0]
        else:
            if any(
                x is not None for x in (self.group_size, self.bits, self.v_group_size, self.v_bits)
            ):
                raise ValueError(f"[{where}] group_size/bits are only for quantized keys/values.")
            k, v = self.keys, self.values
            for name, x in (("keys", k), ("values", v)):
                if not isinstance(x, mx.array) or x.ndim != 4:
                    raise ValueError(f"[{where}] {name} must be a 4-D array [B, H, N, D].")
        if k.shape[:3] != v.shape[:3]:
            raise ValueError(
                f"[{where}] keys and values must agree on [B, H, N]: "
                f"{tuple(k.shape[:3])} vs {tuple(v.shape[:3])}."
            )

    @property
    def quantized(self) -> bool:
        return is_quantized(self.keys)

    @classmethod
    def from_cache(cls, cache, keys=None, values=None) -> "SharedKV":
        """Wrap a donor cache's fetch (by default ``cache.keys_and_values()``).

        Works with any cache that has ``offset`` (and ``group_size``/``bits``
        when it returns triples), mlx-lm's included.
        """
        if keys is None and values is None:
            keys, values = cache.keys_and_values()
        if is_quantized(keys):
            return cls(keys, values, cache.offset, cache.group_size, cache.bits)
        return cls(keys, values, cache.offset)

    def attend(self, queries: mx.array, *, scale: float, mask=None, sinks=None) -> mx.array:
        """Attention of a sharer layer's ``queries`` over the shared K/V."""
        return sdpa(
            queries,
            self.keys,
            self.values,
            scale=scale,
            mask=mask,
            sinks=sinks,
            group_size=self.group_size,
            bits=self.bits,
            v_group_size=self.v_group_size,
            v_bits=self.v_bits,
        )
