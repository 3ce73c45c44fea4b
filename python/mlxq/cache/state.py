"""A cache's ``state`` and ``meta_state``, as mlx-lm's prompt-cache files hold them.

``state`` is ``(keys, values, *scalars)`` in mlx-lm's order (the cache's
``_SCALARS``, for example ``(keys, values, offset)`` for ``KVCache``), then,
for a quantized cache in a format mlx-lm has no words for, the format's
trailing entries (KVFormat.extras). ``meta_state`` is the scalars and
extras as strings.
"""

from ..arguments import as_int
from ..kv_format import KVFormat


def state_of(cache) -> tuple:
    scalars = tuple(getattr(cache, n) for n in cache._SCALARS)
    return (cache.keys, cache.values) + scalars + cache._store.extras()


def take_state(cache, v) -> None:
    """Set ``cache`` from a state (the buffers validated and adopted)."""
    v, n = tuple(v), 2 + len(cache._SCALARS)
    where = cache._where("state")
    if len(v) < n:
        raise ValueError(
            f"[{where}] state must be (keys, values, {', '.join(cache._SCALARS)}), "
            f"got {len(v)} entries."
        )
    _take_scalars(cache, [as_int(x, name, where) for name, x in zip(cache._SCALARS, v[2:n])])
    _take_extras(cache, v[n:], where)
    cache._configure()
    cache._adopt(v[0], v[1], "state")


def meta_state_of(cache) -> tuple:
    scalars = tuple(getattr(cache, n) for n in cache._SCALARS)
    return tuple(str(x) for x in scalars + cache._store.extras())


def take_meta_state(cache, v) -> None:
    v, n = tuple(v), len(cache._SCALARS)
    where = cache._where("meta_state")
    if len(v) < n or not all(str(x).lstrip("-").isdigit() for x in v):
        raise ValueError(
            f"[{where}] meta_state must be ({', '.join(cache._SCALARS)}) as strings, got {v!r}."
        )
    _take_scalars(cache, [as_int(int(x), name, where) for name, x in zip(cache._SCALARS, v)])
    _take_extras(cache, tuple(int(x) for x in v[n:]), where)
    cache._configure()


def _take_scalars(cache, values) -> None:
    """Set the ``_SCALARS`` (a quantized cache's group_size and bits start its format)."""
    for name, x in zip(cache._SCALARS, values):
        if name in ("group_size", "bits"):
            keys = {"group_size": cache.format.group_size, "bits": cache.format.bits}
            cache.format = KVFormat(**{**keys, name: x})
        else:
            setattr(cache, name, x)


def _take_extras(cache, extras: tuple, where: str) -> None:
    """The trailing entries: a quantized cache's format."""
    if cache.format is not None:
        cache.format = cache.format.with_extras(extras, where)
    elif extras:
        raise ValueError(f"[{where}] an unquantized state has no entries after the scalars.")
