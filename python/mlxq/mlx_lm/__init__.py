"""Use mlxq as mlx-lm's quantized-KV backend: one call, reversible.

>>> import mlxq.mlx_lm
>>> mlxq.mlx_lm.enable()                 # or: with mlxq.mlx_lm.enabled(): ...
>>> mlx_lm.generate(model, tokenizer, prompt, kv_bits=4, quantized_kv_start=0)
>>> mlxq.mlx_lm.disable()

While enabled, mlx-lm (0.32) runs with:

* **attention** — ``mlx_lm.models.base.scaled_dot_product_attention`` and
  ``quantized_scaled_dot_product_attention`` (and the same names already
  imported into loaded ``mlx_lm.*`` modules, model modules included) send
  quantized ``(packed, scales, biases)`` keys/values to mlxq's fused kernel,
  with attention sinks (gpt-oss) and with no cache at all (Gemma's KV-shared
  layers hand over a donor's quantized tuples). Plain K/V still go to
  ``mx.fast.scaled_dot_product_attention`` through mlx-lm's own function.
* **KV quantization** — ``maybe_quantize_kv_cache`` (what ``generate_step``
  calls with ``kv_bits``) turns mlx-lm's ``KVCache`` into mlxq's
  ``QuantizedKVCache`` and ``RotatingKVCache`` into mlxq's
  ``RotatingQuantizedKVCache``, so sliding-window models (Gemma 3/4,
  gpt-oss, ``max_kv_size``) can quantize; their updates quantize in place.
* **cache creation** — ``make_prompt_cache(model, max_kv_size=None, *,
  kv_bits=None, kv_group_size=64)`` takes ``kv_bits`` to return quantized
  caches from the first token (without it, exactly mlx-lm's caches), and
  ``generate_step`` (so ``generate``/``stream_generate``) with ``kv_bits``
  applies the ``quantized_kv_start`` rule before the first prefill chunk
  too: with ``quantized_kv_start=0`` the cache is quantized from the first
  token.
* **prompt-cache files** — ``RotatingQuantizedKVCache`` is registered in
  ``mlx_lm.models.cache``, so mlx-lm's ``load_prompt_cache`` loads files that
  hold one.

Everything mlxq does not handle goes to the original functions unchanged: no
``kv_bits``, bits/group sizes or head dims outside mlxq's kernels, cache
classes other than mlx-lm's ``KVCache``/``RotatingKVCache`` (batch, chunked,
SSM caches...), and devices that mlxq has no kernels for. :func:`disable`
puts back every attribute it changed, by identity.
"""

from .attention import (
    counters,
    quantized_scaled_dot_product_attention,
    reset_counters,
    scaled_dot_product_attention,
)
from .generation import generate_step, make_prompt_cache, mark_private, maybe_quantize_kv_cache
from .patches import (
    MLX_LM_RANGE,
    check_mlx_lm_version,
    disable,
    enable,
    enabled,
    is_enabled,
)
from .settings import Settings, settings

__all__ = [
    "MLX_LM_RANGE",
    "Settings",
    "check_mlx_lm_version",
    "counters",
    "disable",
    "enable",
    "enabled",
    "generate_step",
    "is_enabled",
    "make_prompt_cache",
    "mark_private",
    "maybe_quantize_kv_cache",
    "quantized_scaled_dot_product_attention",
    "reset_counters",
    "scaled_dot_product_attention",
    "settings",
]
