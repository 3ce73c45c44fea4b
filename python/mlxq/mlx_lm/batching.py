"""Continuous batching with quantized KV: what :func:`mlxq.mlx_lm.enable`
adds to mlx-lm's ``BatchGenerator`` and ``batch_generate``.

mlx-lm 0.32 batches sequences by merging their single caches into batch
caches (``KVCache.merge`` -> ``BatchKVCache``), but it has no quantized
batch cache: ``BatchGenerator`` takes no ``kv_bits`` and a quantized cache
cannot be merged. While mlxq is enabled:

* ``BatchGenerator(model, ..., kv_bits=4, kv_group_size=64,
  quantized_kv_start=0)`` (and so ``batch_generate(..., kv_bits=4)``)
  quantizes every sequence's KV cache once the batch holds
  ``quantized_kv_start`` tokens. The default start is 0, unlike
  ``generate_step``'s 5000: batching is for many concurrent sequences,
  where KV memory matters from the first token.
* Quantized single caches merge into mlxq's ``BatchQuantizedKVCache`` /
  ``BatchRotatingQuantizedKVCache``; a batch that mixes quantized and
  unquantized caches is quantized as a whole.
* mlx-lm's ``BatchKVCache`` and ``BatchRotatingKVCache`` get
  ``to_quantized`` (the latter's raises without mlxq).
"""

import importlib
from typing import Any, List, Optional

from mlx_lm.models import cache as lm_cache

from ..cache import (
    BatchQuantizedKVCache,
    BatchRotatingQuantizedKVCache,
)
from ..cache.batch_rows import is_batch
from ..kv_format import BITS, GROUP_SIZES
from . import families
from .caches import quantize_caches, ring_window
from .settings import Settings, settings

# The module (the mlx_lm package's `generate` attribute is the function).
lm_generate = importlib.import_module("mlx_lm.generate")


def _is_quantized(cache) -> bool:
    return hasattr(cache, "bits")


def _batch_kind(cache):
    """mlxq's quantized batch class for an (unquantized) batch or single cache."""
    return BatchRotatingQuantizedKVCache if hasattr(cache, "max_size") else BatchQuantizedKVCache


def quantize_batch(cache, group_size: int, bits: int, options: Settings):
    """An (unquantized) batch cache in mlxq's quantized batch cache, stored as
    ``options`` say (rotation, value quantization), an MLA latent cache
    where its role says so (families.py)."""
    kind = _batch_kind(cache)
    latent = families.role_of(cache) == families.LATENT
    if latent:
        extra = {"latent": True}
    else:
        recent = options.recent_for(bits)
        if kind is BatchRotatingQuantizedKVCache:
            recent = ring_window(recent, cache.max_size)
        extra = {"recent": recent}
    return kind.quantize(cache, **options.cache_options(group_size, bits, latent), **extra)


def batch_to_quantized(self, group_size: int = 64, bits: int = 4):
    """``to_quantized`` for mlx-lm's ``BatchKVCache`` / ``BatchRotatingKVCache``:
    the same batch in mlxq's quantized batch cache, with the settings in force
    (:func:`mlxq.mlx_lm.enable`)."""
    return quantize_batch(self, group_size, bits, settings())


def _quantize_like(cache, like):
    """``cache`` (unquantized, batch) quantized as ``like`` (a quantized batch)."""
    return _batch_kind(cache).quantize(cache, **like.format.kwargs())


def merge_caches(caches: List[List[Any]]) -> List[Any]:
    """mlx-lm's ``_merge_caches``: each layer's single caches into one batch
    cache. A layer where any cache is quantized becomes mlxq's quantized
    batch cache (the unquantized ones quantized alike); others are mlx-lm's."""
    merged = []
    for i in range(len(caches[0]) if caches else 0):
        layer = [c[i] for c in caches]
        if any(hasattr(c, "chunk_size") for c in layer):  # mlx-lm's or mlxq's chunked cache
            raise ValueError(
                f"[mlxq.mlx_lm.BatchGenerator] layer {i} keeps a chunked-attention cache "
                f"({type(layer[0]).__name__}), which cannot be batched: generate one "
                "sequence at a time."
            )
        if any(_is_quantized(c) for c in layer):
            out = _batch_kind(layer[0]).merge(layer)
        elif hasattr(layer[0], "merge"):
            out = layer[0].merge(layer)
        else:
            raise ValueError(f"{type(layer[0])} does not yet support batching with history")
        role = families.role_of(layer[0])
        if role != families.QUANTIZE:  # the batch keeps its sequences' role
            setattr(out, families.ROLE, role)
        merged.append(out)
    return merged


def extend_cache(cache_a: List[Any], cache_b: List[Any]) -> List[Any]:
    """mlx-lm's ``_extend_cache``: batch ``cache_b`` joins ``cache_a``, layer
    by layer; where only one side is quantized the other is quantized alike."""
    if not cache_a:
        return cache_b
    if not cache_b:
        return cache_a
    for i, (a, b) in enumerate(zip(cache_a, cache_b)):
        if is_batch(b) and not is_batch(a) and not _is_quantized(a):
            a = cache_a[i] = _quantize_like(a, b)
        a.extend(b)
    return cache_a


class BatchGenerator(lm_generate.BatchGenerator):
    """mlx-lm's ``BatchGenerator`` with quantized KV caches.

    Args (besides mlx-lm's):
        kv_bits (int, optional): Bits per K/V element (see
          ``mlxq.quantization.BITS``); None: unquantized, exactly mlx-lm.
        kv_group_size (int): Quantization group size (32, 64 or 128).
        quantized_kv_start (int): Quantize a batch once it holds this many
          tokens (its ``size()``). Default 0: from the first token.
    """

    def __init__(
        self,
        model,
        *,
        kv_bits: Optional[int] = None,
        kv_group_size: int = 64,
        quantized_kv_start: int = 0,
        **kwargs,
    ):
        where = "mlxq.mlx_lm.BatchGenerator"
        self._old_wired_limit = None  # what mlx-lm's __del__ reads, should we raise
        if kv_bits is not None and kv_bits not in BITS:
            raise ValueError(f"[{where}] kv_bits must be one of {BITS} or None, got {kv_bits!r}.")
        if kv_bits is not None and kv_group_size not in GROUP_SIZES:
            raise ValueError(
                f"[{where}] kv_group_size must be one of {GROUP_SIZES}, got {kv_group_size!r}."
            )
        if isinstance(quantized_kv_start, bool) or not isinstance(quantized_kv_start, int):
            raise ValueError(
                f"[{where}] quantized_kv_start must be an int, got {quantized_kv_start!r}."
            )
        self.kv_bits = kv_bits
        self.kv_group_size = kv_group_size
        self.quantized_kv_start = quantized_kv_start
        # The settings in force now: a later enable(...) leaves this batch as it is.
        self.settings = settings()
        families.check(model, kv_bits, where)  # before any work
        self._family_model = model  # the model whose family tags the caches
        if self.settings.compiled_decode:  # the batch's one-token steps compiled (mlxq.compiled)
            from ..compiled import CompiledModel

            model = CompiledModel(model)
        super().__init__(model, **kwargs)

    def _quantize_singles(self, cache: List[Any]) -> List[Any]:
        families.tag_roles(self._family_model, cache)
        quantize_caches(
            cache, self.quantized_kv_start, self.kv_group_size, self.kv_bits, self.settings
        )
        return cache

    def insert_segments(self, segments, max_tokens=None, caches=None, *args, **kwargs):
        if self.kv_bits is not None:
            # New lists: the caller's own are left as they are.
            caches = [
                self._quantize_singles(
                    list(c)
                    if c is not None
                    else lm_generate.make_prompt_cache(self.model, self.max_kv_size)
                )
                for c in (caches or [None] * len(segments))
            ]
        return super().insert_segments(segments, max_tokens, caches, *args, **kwargs)

    def _quantize_batches(self) -> None:
        """The ``quantized_kv_start`` rule on the running batches."""
        for batch in (self._prompt_batch, self._generation_batch):
            layers = batch.prompt_cache
            for i, c in enumerate(layers):
                if (
                    not _is_quantized(c)
                    and families.role_of(c) in (families.QUANTIZE, families.LATENT)
                    and hasattr(c, "left_padding")
                    and not c.empty()
                    and c.size() >= self.quantized_kv_start
                ):
                    own = self.settings.for_cache(i, self.kv_group_size, self.kv_bits)
                    layers[i] = quantize_batch(c, *own)

    def _next(self):
        responses = super()._next()
        if self.kv_bits is not None:
            self._quantize_batches()
        return responses


# (module, name, replacement) for mlxq.mlx_lm.enable().
PATCHED = (
    ("mlx_lm.generate", "BatchGenerator", BatchGenerator),
    ("mlx_lm.generate", "_merge_caches", merge_caches),
    ("mlx_lm.generate", "_extend_cache", extend_cache),
)

# (class, "to_quantized") for mlxq.mlx_lm.enable().
TO_QUANTIZED = (lm_cache.BatchKVCache, lm_cache.BatchRotatingKVCache)
