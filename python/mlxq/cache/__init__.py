"""KV caches with mlx-lm's protocol, updated in place through the ring primitives.

* :class:`KVCache`, :class:`QuantizedKVCache` — grow 256 tokens at a time.
* :class:`RotatingKVCache`, :class:`RotatingQuantizedKVCache` — sliding-window rings.
* :class:`BatchQuantizedKVCache`, :class:`BatchRotatingQuantizedKVCache` —
  mlx-lm's batch caches (continuous batching), quantized.
* :class:`ChunkedQuantizedKVCache` — mlx-lm's chunked local attention
  (Llama 4), quantized.
* :class:`SharedKV` — a donor layer's fetch handed to KV-sharing layers.
"""

from .base import BaseCache
from .batch import BatchQuantizedKVCache
from .batch_rotating import BatchRotatingQuantizedKVCache
from .chunked import ChunkedQuantizedKVCache
from .kv import KVCache, QuantizedKVCache
from .rotating import RotatingKVCache, RotatingQuantizedKVCache
from .shared import SharedKV

__all__ = [
    "BaseCache",
    "BatchQuantizedKVCache",
    "BatchRotatingQuantizedKVCache",
    "ChunkedQuantizedKVCache",
    "KVCache",
    "QuantizedKVCache",
    "RotatingKVCache",
    "RotatingQuantizedKVCache",
    "SharedKV",
]
