"""mlx-lm's cache creation, KV quantization and ``generate_step``, on mlxq's caches."""

from typing import Optional

from ..cache.base import BaseCache
from . import families
from .caches import as_mlxq, quantize_caches
from .originals import original
from .settings import settings


def maybe_quantize_kv_cache(prompt_cache, quantized_kv_start, kv_group_size, kv_bits):
    """mlx-lm's ``maybe_quantize_kv_cache``, quantizing into mlxq's caches.

    Same rule as mlx-lm (a cache is quantized once its ``offset`` reaches
    ``quantized_kv_start``), but mlx-lm's ``KVCache`` becomes mlxq's
    ``QuantizedKVCache`` and ``RotatingKVCache`` mlxq's
    ``RotatingQuantizedKVCache`` (mlx-lm raises for the latter), as the
    settings in force say (:func:`mlxq.mlx_lm.settings`). Other caches are
    left to mlx-lm.
    """
    quantize_caches(prompt_cache, quantized_kv_start, kv_group_size, kv_bits, settings())


def make_prompt_cache(
    model,
    max_kv_size: Optional[int] = None,
    *,
    kv_bits: Optional[int] = None,
    kv_group_size: int = 64,
):
    """mlx-lm's ``make_prompt_cache``, optionally quantized from the first token.

    Without ``kv_bits`` these are mlx-lm's caches. With it, every ``KVCache``
    and ``RotatingKVCache`` the model asks for is created as mlxq's
    ``QuantizedKVCache`` / ``RotatingQuantizedKVCache`` (empty), so prefill
    runs on the fused kernel and the cache never holds unquantized K/V;
    ``CacheList`` members and ``ChunkedKVCache`` too, as the model's family
    says (mlxq.mlx_lm.families: some caches stay exact, MLA latent caches
    are quantized as such, and models that compute attention themselves
    raise ``ValueError`` here). Either way each cache carries its role.
    """
    families.check(model, kv_bits, "mlxq.mlx_lm.make_prompt_cache")
    cache = original("make_prompt_cache")(model, max_kv_size=max_kv_size)
    families.tag_roles(model, cache)
    if kv_bits is not None:
        maybe_quantize_kv_cache(cache, 0, kv_group_size, kv_bits)
    return cache


def mark_private(prompt_cache) -> None:
    """Marks mlxq's caches in ``prompt_cache`` as seen by one generation loop
    only: mlx-lm reads their state after each prefill chunk just to evaluate
    it, so their writes may stay in place (see ``BaseCache._private``). For
    caches nobody else holds, such as the ones a loop makes for itself."""
    for c in prompt_cache:
        if isinstance(c, BaseCache):
            c._private = True
        elif isinstance(getattr(c, "caches", None), (list, tuple)):  # a CacheList
            mark_private(c.caches)


def generate_step(
    prompt,
    model,
    *args,
    prompt_cache=None,
    max_kv_size=None,
    kv_bits=None,
    kv_group_size=64,
    quantized_kv_start=None,
    **kwargs,
):
    """mlx-lm's ``generate_step``, with the cache quantized before the first chunk.

    mlx-lm applies its ``quantized_kv_start`` rule only after each model call,
    so even with ``quantized_kv_start=0`` its first prefill chunk (2048
    tokens) runs on a bf16 cache that is then converted. When mlx-lm makes the
    cache (no ``prompt_cache`` given) and ``kv_bits`` is set, the same rule is
    applied once more before the first chunk: with ``quantized_kv_start=0``
    every KV cache is quantized from the first token, so prefill runs on
    quantized K/V and never holds a bf16 copy of the prompt's cache. A
    ``prompt_cache`` given takes the roles of ``model``'s family
    (mlxq.mlx_lm.families), and a model whose attention mlxq cannot serve
    with ``kv_bits`` raises ``ValueError`` before the first model call.
    """
    from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START

    families.check(model, kv_bits, "mlxq.mlx_lm.generate_step")
    if kv_bits is not None and prompt_cache is not None:
        families.tag_roles(model, prompt_cache)

    if quantized_kv_start is None:
        quantized_kv_start = DEFAULT_QUANTIZED_KV_START
    compiled_decode = settings().compiled_decode
    made = prompt_cache is None and (kv_bits is not None or compiled_decode)
    if made:
        prompt_cache = make_prompt_cache(model, max_kv_size=max_kv_size)
        if kv_bits is not None:
            maybe_quantize_kv_cache(prompt_cache, quantized_kv_start, kv_group_size, kv_bits)
    if compiled_decode:
        model = compiled_model(model, prompt_cache)
    if made:
        mark_private(prompt_cache)
    return original("generate_step")(
        prompt,
        model,
        *args,
        prompt_cache=prompt_cache,
        max_kv_size=max_kv_size,
        kv_bits=kv_bits,
        kv_group_size=kv_group_size,
        quantized_kv_start=quantized_kv_start,
        **kwargs,
    )


def compiled_model(model, prompt_cache):
    """``model`` with its one-token steps compiled (mlxq.compiled), and
    mlx-lm's plain caches in ``prompt_cache`` swapped for mlxq's (the same
    tokens and arithmetic, with the compiled step's protocol)."""
    from ..compiled import CompiledModel

    if isinstance(model, CompiledModel):
        return model
    for i, c in enumerate(prompt_cache):
        ours = as_mlxq(c)
        if ours is not None:
            prompt_cache[i] = ours
    return CompiledModel(model)
