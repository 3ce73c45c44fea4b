"""Growing caches: ``KVCache`` and ``QuantizedKVCache``.

Both keep a buffer preallocated in steps of 256 tokens along the sequence and
append each update at ``offset`` through the ring primitives, in place; a full
buffer grows exactly as mlx-lm's does (cut to ``offset`` unless that is a
whole number of steps, then extended with zero steps), so buffers, fetches
and saved states match mlx-lm's bit for bit.
"""

from typing import Optional

from ..masks import create_attention_mask
from .base import BaseCache, QuantizedStorage


class _GrowingCache(BaseCache):
    def __init__(self):
        self.keys = None
        self.values = None
        self.offset = 0

    def update_and_fetch(self, keys, values):
        """Append ``keys``/``values`` ``[B, H, T, D]``; return all cached so far.

        The result is ``buffer[..., :offset, :]`` (a view of the buffer) for
        plain caches and the same slice of each component for quantized ones.
        """
        T = self._check_update(keys, values)
        prev = self.offset
        if self.keys is None or prev + T > self._store.length(self.keys):
            self._grow(keys, values, T)
        if self._owned:  # the decode path: write and fetch in one call
            self.keys, self.values, k, v = self._store.write_and_fetch(
                self.keys, self.values, keys, values, prev, prev + T
            )
            self.offset = prev + T
            return self._fetched(k, v)
        self.keys, self.values = self._store.write_kv(
            self.keys, self.values, keys, values, prev, False
        )
        self._owned = True  # donated or copied: ours alone now
        self.offset = prev + T
        return self.keys_and_values()

    def _grow(self, keys, values, T: int) -> None:
        store, prev = self._store, self.offset
        n = (T + self.step - 1) // self.step * self.step
        new_k, new_v = store.zeros(keys, n), store.zeros(values, n, values=True)
        if self.keys is None:
            self.keys, self.values = new_k, new_v
            return
        if prev % self.step:
            self.keys = store.rows(self.keys, stop=prev)
            self.values = store.rows(self.values, stop=prev)
        self.keys = store.concat([self.keys, new_k])
        self.values = store.concat([self.values, new_v])
        self._owned = True  # fresh buffers, held by nobody else

    def make_mask(self, N: int, *, return_array: bool = False, window_size=None):
        """None, ``"causal"`` or a bool array for an ``N``-token step (mlx-lm's rule)."""
        return create_attention_mask(N, self.offset, return_array, window_size)

    def temporal(self):
        """Keys and values oldest first: for a growing cache, the fetch itself."""
        return self.keys_and_values()

    def restore(self, keys, values, offset: int, ring_index=None):
        """Adopt persisted buffers (``offset`` tokens valid); returns ``self``."""
        if ring_index is not None and ring_index != offset:
            raise ValueError(
                f"[{self._where('restore')}] a growing cache has no ring: ring_index must be "
                f"None or equal to offset ({offset}), got {ring_index}."
            )
        self.offset = offset
        self._adopt(keys, values, "restore")
        return self


class KVCache(_GrowingCache):
    """mlx-lm's ``KVCache``: unquantized keys and values, grown 256 tokens at a time."""

    mlx_lm_name = "KVCache"

    def to_quantized(
        self,
        group_size: int = 64,
        bits: int = 4,
        kv_rotate: bool = False,
        v_group_size: Optional[int] = None,
        v_bits: Optional[int] = None,
    ) -> "QuantizedKVCache":
        """The same tokens in a :class:`QuantizedKVCache` (the whole buffer is
        quantized; rotated first with ``kv_rotate``, see mlxq.rotation; values
        with ``v_group_size`` / ``v_bits`` when given)."""
        cache = QuantizedKVCache(
            group_size=group_size,
            bits=bits,
            kv_rotate=kv_rotate,
            v_group_size=v_group_size,
            v_bits=v_bits,
        )
        cache.offset = self.offset
        if self.keys is not None:
            cache._check_update(self.keys, self.values)
            cache.keys = cache._store.encode(self.keys)
            cache.values = cache._store.encode(self.values, values=True)
            cache._owned = True  # fresh mx.quantize outputs, held by nobody else
        return cache


class QuantizedKVCache(QuantizedStorage, _GrowingCache):
    """mlx-lm's ``QuantizedKVCache``: keys and values quantized as they are written.

    Each update is quantized by the ring primitive itself (bit-identical to
    :func:`mx.quantize`) straight into the ``(packed, scales, biases)``
    buffers; fetches are triples that :func:`mlxq.sdpa` sends to the fused
    kernel. With ``kv_rotate=True`` rows are quantized in the Hadamard basis
    and fetches are :class:`~mlxq.rotation.RotatedTriple` (see mlxq.rotation).
    ``v_group_size`` / ``v_bits`` quantize the values apart from the keys
    (``bits=8, v_bits=4``: llama.cpp's q8_0-K / q4_0-V pairing).
    """

    mlx_lm_name = "QuantizedKVCache"
    _SCALARS = ("offset", "group_size", "bits")

    def __init__(
        self,
        group_size: int = 64,
        bits: int = 8,
        kv_rotate: bool = False,
        v_group_size: Optional[int] = None,
        v_bits: Optional[int] = None,
    ):
        super().__init__()
        self.group_size = group_size
        self.bits = bits
        self.kv_rotate = kv_rotate
        self.v_group_size = v_group_size
        self.v_bits = v_bits
        self._configure()

    def _configure(self) -> None:
        self._use_quantized_store()


__all__ = ["KVCache", "QuantizedKVCache"]
