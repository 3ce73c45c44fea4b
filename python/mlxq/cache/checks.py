"""The checks of what a cache takes in: updates, and buffers it adopts.

Each raises a ValueError that names the cache's method and the input. The
update check runs on every decoded token, so its passing path is one
comparison with the last update it checked.
"""

import mlx.core as mx

from ..arguments import dtype_name
from ..hadamard import check_head_dim


def update(cache, keys, values) -> int:
    """Validate an update of ``cache``; returns its number of tokens T."""
    sig = (
        (keys.shape, values.shape, keys.dtype, values.dtype)
        if isinstance(keys, mx.array) and isinstance(values, mx.array)
        else None
    )
    # The decode path: buffers the cache made itself from updates of the
    # same shapes and dtypes as one already checked.
    if cache._owned and sig is not None and sig == cache._checked and keys.ndim == 4:
        return keys.shape[2]
    where = cache._where("update_and_fetch")
    if not (
        isinstance(keys, mx.array)
        and isinstance(values, mx.array)
        and keys.ndim == 4
        and values.ndim == 4
        and keys.shape[:3] == values.shape[:3]
        and keys.shape[2] >= 1
    ):
        _reject_shapes(keys, values, where)
    store = cache._store
    if store.quantized and store.format.hadamard and cache._checked is None:
        for x in (keys, values):
            check_head_dim(x.shape[-1], where)
    for name, x, buf in (("keys", keys, cache.keys), ("values", values, cache.values)):
        side = name == "values"
        if store.quantized and not (side and store.format.latent):  # latent: exact RoPE keys
            _check_quantizable(name, x, store.side(side)[0], where)
        if buf is not None:
            b0 = buf if isinstance(buf, mx.array) else buf[0]
            fits = (b0.shape[0], b0.shape[1], store.head_dim(buf, side), store.dtype(buf))
            if fits != (x.shape[0], x.shape[1], x.shape[3], x.dtype):
                raise ValueError(
                    f"[{where}] {name} of shape {tuple(x.shape)} and dtype "
                    f"{dtype_name(x.dtype)} do not fit the cache's [B={fits[0]}, H={fits[1]}, *, "
                    f"D={fits[2]}] {dtype_name(fits[3])} buffer."
                )
    cache._checked = sig
    return keys.shape[2]


def _reject_shapes(keys, values, where: str):
    for name, x in (("keys", keys), ("values", values)):
        if not isinstance(x, mx.array) or x.ndim != 4:
            got = tuple(x.shape) if isinstance(x, mx.array) else type(x).__name__
            raise ValueError(f"[{where}] {name} must be a 4-D array [B, H, T, D], got {got}.")
    if keys.shape[:3] != values.shape[:3]:
        raise ValueError(
            f"[{where}] keys {tuple(keys.shape)} and values {tuple(values.shape)} "
            "must agree on [B, H, T]."
        )
    raise ValueError(f"[{where}] an update needs at least one token, got T = 0.")


def _check_quantizable(name: str, x, group_size: int, where: str) -> None:
    if not mx.issubdtype(x.dtype, mx.floating):
        raise ValueError(
            f"[{where}] {name} must be floating point to quantize, got {dtype_name(x.dtype)}."
        )
    if x.shape[3] % group_size:
        raise ValueError(
            f"[{where}] {name} head dim {x.shape[3]} is not a multiple of group_size {group_size}."
        )


def adopted(cache, keys, values, where: str):
    """``(keys, values)`` validated as stored buffers of ``cache`` (state,
    restore), with the cache's positions checked against their rows."""
    if keys is None and values is None:
        cache._check_positions(0, where)
        return None, None
    if keys is None or values is None:
        raise ValueError(f"[{where}] keys and values must both be given or both be None.")
    store = cache._store
    keys, values = store.check(keys, "keys", where), store.check(values, "values", where)
    k0, v0 = (t if isinstance(t, mx.array) else t[0] for t in (keys, values))
    if k0.shape[:3] != v0.shape[:3]:
        raise ValueError(
            f"[{where}] keys and values must agree on [B, H, S]: "
            f"{tuple(k0.shape[:3])} vs {tuple(v0.shape[:3])}."
        )
    cache._check_positions(k0.shape[2], where)
    return keys, values


def offset_within(cache, length: int, where: str) -> None:
    """ValueError unless ``0 <= offset <= length`` (the buffer's rows)."""
    if cache.offset < 0 or cache.offset > length:
        raise ValueError(
            f"[{where}] offset {cache.offset} is outside [0, {length}] "
            f"(the buffer holds {length} rows)."
        )
