"""mlx-lm's caches turned into mlxq's: what ``kv_bits`` does while mlxq is
enabled (mlxq.mlx_lm's ``maybe_quantize_kv_cache``, and the batch generator's
own quantization with the settings it was built with)."""

from typing import Any, Dict

import mlx.core as mx

from ..attention import quantized_sdpa
from ..cache import KVCache, RotatingKVCache, RotatingQuantizedKVCache
from ..kv_format import BITS, GROUP_SIZES
from .settings import Settings

_device_support: Dict[Any, bool] = {}


def device_supported() -> bool:
    """Whether mlxq's kernels run on the default device (probed once per device)."""
    device = mx.default_device()
    key = (device.type, getattr(device, "index", 0))
    if key not in _device_support:
        if device.type == mx.cpu:
            _device_support[key] = True
        else:
            try:
                q = mx.zeros((1, 1, 1, 64))
                kv = tuple(mx.quantize(mx.zeros((1, 1, 1, 64)), group_size=64, bits=4))
                out = quantized_sdpa(q, kv, kv, scale=1.0)
                cache = RotatingQuantizedKVCache(4, 0, 64, 4)
                mx.eval(out, cache.update_and_fetch(q, q))
                _device_support[key] = True
            except (RuntimeError, ValueError):
                _device_support[key] = False
    return _device_support[key]


def as_mlxq(cache):
    """mlxq's unquantized cache with the tokens of one of mlx-lm's plain
    caches (sharing its buffers), ``cache`` itself if it is mlxq's, else None."""
    from mlx_lm.models import cache as lm_cache

    kind = type(cache)
    if kind is lm_cache.KVCache:
        return KVCache().restore(cache.keys, cache.values, cache.offset)
    if kind is lm_cache.RotatingKVCache:
        return RotatingKVCache(cache.max_size, cache.keep).restore(
            cache.keys, cache.values, cache.offset, cache._idx
        )
    return cache if kind in (KVCache, RotatingKVCache) else None


def to_mlxq_quantized(cache, group_size: int, bits: int, options: Settings):
    """mlxq's quantized version of one of mlx-lm's caches, or None if not ours to do."""
    try:
        ours = as_mlxq(cache)
        if ours is None:
            return None
        recent = options.kv_recent
        if isinstance(ours, RotatingKVCache):  # a sliding window's ring holds at most this
            recent = min(recent, ours.max_size - ours.keep - 1)
        return ours.to_quantized(
            recent=recent,
            group_size=group_size,
            bits=bits,
            **options.cache_options(),
        )
    except ValueError:  # e.g. a head dim that is not a multiple of group_size
        return None


def quantize_caches(prompt_cache, quantized_kv_start, kv_group_size, kv_bits, options: Settings):
    """mlx-lm's ``quantized_kv_start`` rule over ``prompt_cache`` (in place),
    into mlxq's quantized caches with ``options``. Where mlxq cannot serve
    (bits, group size, device), the rule quantizes as mlx-lm does."""
    if kv_bits is None:
        return
    ours = kv_bits in BITS and kv_group_size in GROUP_SIZES and device_supported()
    for i, c in enumerate(prompt_cache):
        if not (hasattr(c, "to_quantized") and c.offset >= quantized_kv_start):
            continue
        if ours and hasattr(c, "bits"):  # already quantized: kept, as mlx-lm keeps its own
            continue
        quantized = to_mlxq_quantized(c, kv_group_size, kv_bits, options) if ours else None
        if quantized is not None and getattr(c, "_private", False):
            quantized._private = True  # it replaces c in the same loop
        prompt_cache[i] = (
            quantized
            if quantized is not None
            else c.to_quantized(group_size=kv_group_size, bits=kv_bits)
        )
