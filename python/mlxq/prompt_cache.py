"""Prompt-cache files in mlx-lm's format (safetensors).

The layout is mlx-lm's ``save_prompt_cache``: the arrays are every layer's
``state`` flattened with ``mlx.utils.tree_flatten`` (``"<layer>.<entry>"``,
triples one level deeper); non-array entries are stored as small arrays and
listed in the metadata as ``(key, "scalar" | "string" | "none")``; the
metadata holds ``[user metadata, class names, ["", *scalar entries]]``,
flattened the same way.

Class names are mlx-lm's (``KVCache``, ``QuantizedKVCache``,
``RotatingKVCache``), so mlx-lm's ``load_prompt_cache`` loads our files and
:func:`load_prompt_cache` loads mlx-lm's into mlxq's classes. Only
``RotatingQuantizedKVCache`` has no mlx-lm class: mlx-lm cannot load a file
holding one.
"""

from typing import Any, Dict, List, Optional

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from .cache import (
    BatchQuantizedKVCache,
    BatchRotatingQuantizedKVCache,
    ChunkedQuantizedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    RotatingQuantizedKVCache,
)

# Class names in files -> the mlxq class that loads them.
CACHE_CLASSES = {
    cls.mlx_lm_name: cls
    for cls in (
        KVCache,
        QuantizedKVCache,
        RotatingKVCache,
        RotatingQuantizedKVCache,
        BatchQuantizedKVCache,
        BatchRotatingQuantizedKVCache,
        ChunkedQuantizedKVCache,
    )
}


def _encode(key: str, value, scalars: list) -> mx.array:
    """An entry of a state as an array; non-arrays are recorded in ``scalars``."""
    if isinstance(value, mx.array):
        return value
    if isinstance(value, (bool, int, float)):
        scalars.append((key, "scalar"))
        return mx.array(value)
    if isinstance(value, str):
        scalars.append((key, "string"))
        return mx.array([ord(c) for c in value])
    if value is None:
        scalars.append((key, "none"))
        return mx.array([])
    raise ValueError(
        f"[mlxq.save_prompt_cache] state entry {key} is not serializable: {type(value).__name__}."
    )


def _decode(array: mx.array, kind: str):
    if kind == "scalar":
        return array.item()
    if kind == "string":
        return "".join(chr(c) for c in array.tolist())
    if kind == "none":
        return None
    raise ValueError(f"[mlxq.load_prompt_cache] unknown scalar kind {kind!r} in the file.")


def save_prompt_cache(file_name: str, cache: List[Any], metadata: Optional[Dict[str, str]] = None):
    """Save a model's caches (one per layer) to a ``.safetensors`` file.

    Args:
        file_name (str): The file to write.
        cache (list): The caches: mlxq's, or any object with mlx-lm's
          ``state`` protocol (saved under its class name).
        metadata (dict of str, optional): Saved along, returned by
          :func:`load_prompt_cache` with ``return_metadata=True``.
    """
    scalars = [""]  # never empty, or flattening would drop it
    flat = tree_flatten([c.state for c in cache])
    arrays = {key: _encode(key, value, scalars) for key, value in flat}
    classes = [getattr(c, "mlx_lm_name", "") or type(c).__name__ for c in cache]
    info = dict(tree_flatten([dict(metadata or {}), classes, scalars]))
    mx.save_safetensors(file_name, arrays, info)


def _cache_class(name: str):
    if name in CACHE_CLASSES:
        return CACHE_CLASSES[name]
    try:  # another mlx-lm cache (ArraysCache, ChunkedKVCache, ...)
        from mlx_lm.models import cache as mlx_lm_cache

        return getattr(mlx_lm_cache, name)
    except (ImportError, AttributeError):
        raise ValueError(
            f"[mlxq.load_prompt_cache] unknown cache class {name!r}: neither mlxq nor "
            "mlx_lm.models.cache defines it."
        ) from None


def _load_cache(name: str, state):
    if name == "CacheList":
        # mlx-lm's CacheList rebuilds its members by mlx-lm's class names,
        # which would give an mlxq member's state to mlx-lm's class.
        from mlx_lm.models.cache import CacheList

        return CacheList(*[_load_cache(member, s) for s, member in state])
    return _cache_class(name).from_state(state)


def load_prompt_cache(file_name: str, return_metadata: bool = False):
    """Load caches saved by :func:`save_prompt_cache` or by mlx-lm.

    mlx-lm's ``KVCache``, ``QuantizedKVCache`` and ``RotatingKVCache`` load as
    the mlxq classes of the same name, in a ``CacheList`` too; other mlx-lm
    classes load as mlx-lm's.

    Returns:
        list, or (list, dict) when ``return_metadata`` is set.
    """
    arrays, info = mx.load(file_name, return_metadata=True)
    try:
        metadata, classes, scalars = tree_unflatten(list(info.items()))
    except (TypeError, ValueError):
        raise ValueError(
            f"[mlxq.load_prompt_cache] {file_name} is not a prompt-cache file "
            "(its metadata is not [metadata, classes, scalars])."
        ) from None
    for key, kind in scalars[1:]:
        arrays[key] = _decode(arrays[key], kind)
    states = tree_unflatten(list(arrays.items())) if arrays else []
    if len(states) != len(classes):
        raise ValueError(
            f"[mlxq.load_prompt_cache] {file_name} lists {len(classes)} caches but holds "
            f"state for {len(states)}."
        )
    caches = [_load_cache(name, state) for name, state in zip(classes, states)]
    return (caches, metadata) if return_metadata else caches
