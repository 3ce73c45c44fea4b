"""mlxq: fused quantized-KV attention and ring-buffer KV caches for MLX.

The public API:

* :func:`sdpa` — attention over plain or quantized K/V (the one call a model needs).
* :func:`quantized_sdpa` — the fused kernel over ``mx.quantize`` triples.
* :mod:`mlxq.reference` — plain-MLX-op compositions, the oracle for tests.
"""

from ._version_check import check_mlx_version as _check_mlx_version

_check_mlx_version()

from . import reference  # noqa: E402
from .attention import quantized_sdpa, sdpa  # noqa: E402
from .ring import quantized_ring_update, ring_update  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "sdpa",
    "quantized_sdpa",
    "ring_update",
    "quantized_ring_update",
    "reference",
    "__version__",
]

from . import masks  # noqa: E402
from .cache import (  # noqa: E402
    BatchQuantizedKVCache,
    BatchRotatingQuantizedKVCache,
    ChunkedQuantizedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    RotatingQuantizedKVCache,
    SharedKV,
)
from .masks import bidirectional_mask, create_attention_mask, create_causal_mask  # noqa: E402
from .prompt_cache import load_prompt_cache, save_prompt_cache  # noqa: E402

__all__ += [
    "BatchQuantizedKVCache",
    "BatchRotatingQuantizedKVCache",
    "ChunkedQuantizedKVCache",
    "KVCache",
    "QuantizedKVCache",
    "RotatingKVCache",
    "RotatingQuantizedKVCache",
    "SharedKV",
    "masks",
    "create_causal_mask",
    "create_attention_mask",
    "bidirectional_mask",
    "save_prompt_cache",
    "load_prompt_cache",
]


def __getattr__(name):
    # `mlxq.mlx_lm` (the mlx-lm integration) imports mlx-lm, which mlxq itself
    # does not need: load it on first use.
    if name == "mlx_lm":
        import importlib

        return importlib.import_module(".mlx_lm", __name__)
    raise AttributeError(f"module 'mlxq' has no attribute {name!r}")
