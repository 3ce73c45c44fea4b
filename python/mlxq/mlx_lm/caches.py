"""mlx-lm's caches turned into mlxq's: what ``kv_bits`` does while mlxq is
enabled (mlxq.mlx_lm's ``maybe_quantize_kv_cache``, and the batch generator's
own quantization with the settings it was built with)."""

from typing import Any, Dict

import mlx.core as mx

from ..attention import quantized_sdpa
from ..cache import ChunkedQuantizedKVCache, KVCache, RotatingKVCache, RotatingQuantizedKVCache
from ..kv_format import BITS, GROUP_SIZES
from .families import EXACT, LATENT, ROLE, role_of
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


def to_mlxq_quantized(cache, group_size: int, bits: int, options: Settings, latent: bool = False):
    """mlxq's quantized version of one of mlx-lm's caches, or None if not ours to do.

    With ``latent`` (an MLA latent cache, see families.py) mlxq is the only
    way: no None, a ValueError when mlxq cannot take it."""
    try:
        ours = as_mlxq(cache)
        if ours is None:
            if latent:
                raise ValueError(
                    f"[mlxq.mlx_lm] an MLA latent cache of type {type(cache).__name__} "
                    "has no mlxq quantized version: run the model without kv_bits."
                )
            return None
        # An MLA latent cache keeps no window (its RoPE keys are exact): the
        # recipe passes it by; an explicit kv_recent reaches it and is refused.
        recent = (options.kv_recent or 0) if latent else options.recent_for(bits)
        if isinstance(ours, RotatingKVCache):
            recent = ring_window(recent, ours.max_size, ours.keep)
        extra = {"latent": True} if latent else {}
        return ours.to_quantized(
            recent=recent, **options.cache_options(group_size, bits, latent), **extra
        )
    except ValueError:  # e.g. a head dim that is not a multiple of group_size
        if latent:
            raise
        return None


def ring_window(recent: int, max_size: int, keep: int = 0) -> int:
    """The most of a ``recent`` window a sliding window's ring (single, or a
    batch's, which keeps no tokens) holds: ``max_size - keep - 1``."""
    return max(0, min(recent, max_size - keep - 1))


def _chunked(cache, group_size: int, bits: int, options: Settings):
    """mlx-lm's ``ChunkedKVCache`` in mlxq's ``ChunkedQuantizedKVCache`` (no
    window: the recipe passes it by, an explicit kv_recent is refused)."""
    if options.kv_recent:
        raise ValueError(
            f"[mlxq.mlx_lm] chunked-attention caches (ChunkedKVCache) keep no recent window, "
            f"and kv_recent={options.kv_recent} is set: enable() with kv_recent=0."
        )
    return ChunkedQuantizedKVCache.from_cache(cache, **options.cache_options(group_size, bits))


def _is_list(cache) -> bool:
    return isinstance(getattr(cache, "caches", None), (list, tuple))


def _quantized(c, start: int, group_size: int, bits: int, options: Settings, ours: bool):
    """What ``c`` becomes under the ``quantized_kv_start`` rule (``c`` itself
    if it stays): a CacheList's members are quantized in place, by role."""
    new = _replacement(c, start, group_size, bits, options, ours)
    if new is not c:
        _carry(c, new)
    return new


def _replacement(c, start: int, group_size: int, bits: int, options: Settings, ours: bool):
    from mlx_lm.models import cache as lm_cache

    role = role_of(c)
    if role == EXACT:
        return c
    if _is_list(c):
        members = tuple(_quantized(m, start, group_size, bits, options, ours) for m in c.caches)
        if any(a is not b for a, b in zip(members, c.caches)):
            c.caches = members
        return c
    if isinstance(c, lm_cache.ChunkedKVCache):
        if c.offset < start:
            return c
        if not ours:
            raise ValueError(
                f"[mlxq.mlx_lm] a chunked-attention cache (ChunkedKVCache) quantizes only on "
                f"mlxq's caches: kv_bits in {BITS}, kv_group_size in {GROUP_SIZES}, a device "
                f"with mlxq kernels; got kv_bits={bits}, kv_group_size={group_size} on "
                f"{mx.default_device()}."
            )
        return _chunked(c, group_size, bits, options)
    if not (hasattr(c, "to_quantized") and c.offset >= start):
        return c
    if ours and hasattr(c, "bits"):  # already quantized: kept, as mlx-lm keeps its own
        return c
    if role == LATENT:
        if not ours:
            raise ValueError(
                f"[mlxq.mlx_lm] an MLA latent cache quantizes only on mlxq's caches: kv_bits "
                f"in {BITS}, kv_group_size in {GROUP_SIZES}, a device with mlxq kernels; got "
                f"kv_bits={bits}, kv_group_size={group_size} on {mx.default_device()}."
            )
        return to_mlxq_quantized(c, group_size, bits, options, latent=True)
    quantized = to_mlxq_quantized(c, group_size, bits, options) if ours else None
    return quantized if quantized is not None else c.to_quantized(group_size=group_size, bits=bits)


def quantize_caches(prompt_cache, quantized_kv_start, kv_group_size, kv_bits, options: Settings):
    """mlx-lm's ``quantized_kv_start`` rule over ``prompt_cache`` (in place),
    into mlxq's quantized caches with ``options``.

    Each cache goes by its role (families.py; ``quantize`` unless tagged):
    ``exact`` caches stay as they are, ``latent`` ones (MLA) are quantized
    with ``latent=True``, only by mlxq. A ``CacheList``'s attention members
    are quantized in place (its state caches stay), and mlx-lm's
    ``ChunkedKVCache`` becomes mlxq's ``ChunkedQuantizedKVCache``. Where
    mlxq cannot serve (bits, group size, device), plain caches are
    quantized as mlx-lm does, and chunked and latent ones raise."""
    if kv_bits is None:
        return
    check_layers(options, len(prompt_cache))
    for i, c in enumerate(prompt_cache):
        group_size, bits, own = options.for_cache(i, kv_group_size, kv_bits)
        ours = bits in BITS and group_size in GROUP_SIZES and device_supported()
        prompt_cache[i] = _quantized(c, quantized_kv_start, group_size, bits, own, ours)


def check_layers(options: Settings, caches: int) -> None:
    """ValueError if ``kv_layers`` names a cache index the prompt cache lacks."""
    beyond = [i for i, _ in options.kv_layers if i >= caches]
    if beyond:
        raise ValueError(
            f"[mlxq.mlx_lm] kv_layers names cache {beyond[0]}, but this model's prompt cache "
            f"has {caches} (indices 0 to {caches - 1}): see enable(kv_layers=...)."
        )


def _carry(old, new) -> None:
    """What a cache's replacement keeps of it: its role, and ``_private``
    (it replaces ``old`` in the same loop)."""
    role = getattr(old, ROLE, None)
    if role is not None:
        setattr(new, ROLE, role)
    if getattr(old, "_private", False):
        new._private = True
