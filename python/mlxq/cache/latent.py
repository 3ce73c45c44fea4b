"""What an MLA latent cache hands the model.

DeepSeek-V3-style attention (MLA; Kimi K2, GLM-4 MoE Lite, Mistral 4,
LongCat-Flash and others in mlx-lm) caches one latent row per token
(``kv_lora_rank`` wide, shared by every head) and the RoPE keys, writing
``cache.update_and_fetch(kv_latent, k_pe)``. The model multiplies the RoPE
keys itself (``q_pe @ k_pe^T``, the additive mask of the attention call), so
they stay exact; the latent is quantized (``KVFormat.latent``). Then:

* **Decode** (one new row): the model attends the latent directly, as one
  KV head of ``kv_lora_rank`` dims shared by all query heads, with the RoPE
  scores as the mask. The fetch is the quantized latent, which mlxq's fused
  kernel reads.
* **Prefill** (several rows): the model projects the latent into per-head
  keys and values itself, so it needs the latent as an array. The fetch is
  the latent dequantized, a transient copy of one layer that lives while
  the layer runs (the cache keeps only the quantized rows).
"""

import mlx.core as mx


def latent_fetch(cache, fetch, new_rows: int):
    """``fetch`` (quantized latent, exact RoPE keys) as the model reads it
    after writing ``new_rows`` rows."""
    latent, rope_keys = fetch
    if new_rows == 1:
        return fetch
    group_size, bits = cache.format.side()
    return mx.dequantize(*latent, group_size=group_size, bits=bits), rope_keys
