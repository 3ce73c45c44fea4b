"""The batch side both batch caches share (batch.py, batch_rotating.py):
per-sequence ``left_padding`` and ``offset`` kept on the host, the
quantization in their ``state``, and the padding logic of ``prepare``,
``extend``, ``merge``, ``filter`` and ``to_quantized``.

The functions take the batch cache as their first argument. ``left_padding``
and ``offset`` live on the host (they follow from the calls alone) as int64
arrays ``_lp`` / ``_off`` and are handed out as int32 device arrays
(:class:`HostRows`), so bookkeeping never waits for the device and never
grows a lazy graph.
"""

from typing import Sequence

import mlx.core as mx
import numpy as np

from ..arguments import as_int
from ..kv_format import KVFormat
from . import quantized


def host_ints(v, name: str, where: str) -> np.ndarray:
    if isinstance(v, mx.array):
        v = np.array(v)
    v = np.asarray(v)
    if v.ndim != 1 or not (v.size == 0 or np.issubdtype(v.dtype, np.integer)):
        raise ValueError(f"[{where}] {name} must be a 1-D list of ints, got {v!r}.")
    return v.astype(np.int64)


def roll_rows(x: mx.array, shifts: np.ndarray) -> mx.array:
    """Each sequence ``b`` of ``x [B, H, S, *]`` rolled by ``shifts[b]`` rows
    along the sequence axis (towards the end)."""
    n = x.shape[2]
    shifts = mx.array(np.asarray(shifts, dtype=np.int32))
    rows = (mx.arange(n)[None, None, :, None] - shifts[:, None, None, None]) % n
    return mx.take_along_axis(x, rows, axis=2)


def is_batch(c) -> bool:
    """Whether ``c`` is one of mlxq's batch caches."""
    return getattr(c, "_batch_rows", False)


class HostRows:
    """A batch cache's ``left_padding`` or ``offset``: the host array
    ``_lp`` / ``_off``, read as an int32 device copy made once per value (a
    decode step reads each layer's offset for RoPE; the padding only when
    its mask is made), set from any 1-D ints."""

    def __init__(self, name: str, host: str):
        self.name, self.host, self.device = name, host, host + "_array"

    def __get__(self, cache, owner=None):
        if cache is None:
            return self
        a = cache.__dict__.get(self.device)
        if a is None:
            a = cache.__dict__[self.device] = mx.array(getattr(cache, self.host).astype(np.int32))
        return a

    def __set__(self, cache, v) -> None:
        v = host_ints(v, self.name, cache._where(self.name))
        lp, off = (v, cache._off) if self.host == "_lp" else (cache._lp, v)
        set_rows(cache, lp, off)


def init_rows(cache, left_padding) -> None:
    lp = host_ints(left_padding, "left_padding", cache._where("__init__"))
    if (lp < 0).any():
        raise ValueError(f"[{cache._where('__init__')}] left_padding must be >= 0, got {lp}.")
    set_rows(cache, lp, -lp)


def batch_side(cls):
    """Class decorator: the batch side both batch caches share. Host
    ``_lp`` / ``_off`` read as int32 ``left_padding`` (padding rows before
    each sequence) and ``offset`` (each sequence's RoPE position),
    ``batch_size``, ``prepare``, an empty ``meta_state`` (everything is in
    ``state``) and the row index check; ``is_batch`` tells them apart."""
    cls._batch_rows = True
    cls._lp = cls._off = np.zeros(0, np.int64)
    cls._idx = 0
    cls.left_padding = HostRows("left_padding", "_lp")
    cls.offset = HostRows("offset", "_off")
    cls.batch_size = property(lambda self: len(self._lp))
    cls.prepare = prepare
    cls.meta_state = NO_META_STATE
    cls._check_positions = check_positions
    return cls


def set_rows(cache, lp: np.ndarray, off: np.ndarray) -> None:
    """Set the host arrays; a changed one's device copy is made again when read."""
    if lp is not cache._lp:
        cache._lp, cache.__dict__["_lp_array"] = lp, None
    if off is not cache._off:
        cache._off, cache.__dict__["_off_array"] = off, None


def check_batch(cache, keys) -> None:
    if isinstance(keys, mx.array) and keys.ndim == 4 and keys.shape[0] != cache.batch_size:
        raise ValueError(
            f"[{cache._where('update_and_fetch')}] keys hold {keys.shape[0]} sequences; "
            f"the batch cache holds {cache.batch_size}."
        )


# ------------------------------------------------------- quantization


def quantized_like(caches: Sequence, where: str) -> KVFormat:
    """The format the quantized ones among ``caches`` share (a
    ValueError naming the first that differs)."""
    first = None
    for i, c in enumerate(caches):
        if not hasattr(c, "bits"):
            continue
        # mlx-lm's own quantized caches have no format: theirs is plain.
        f = getattr(c, "format", None) or KVFormat(c.group_size, c.bits)
        if first is None:
            first = (i, f)
        elif f != first[1]:
            raise ValueError(
                f"[{where}] cannot batch caches of different quantization: cache "
                f"{first[0]} is {first[1]}, cache {i} is {f}."
            )
    if first is None:
        raise ValueError(f"[{where}] none of the caches is quantized.")
    return first[1]


def stored(cache, t, values: bool = False):
    """``t`` (a triple of this quantization, or unquantized rows to encode)."""
    if isinstance(t, mx.array):
        return cache._store.encode(t, values)
    return cache._store.check(t, "values" if values else "keys", cache._where("merge"))


def check_fits(cache, others: Sequence, where: str) -> None:
    """ValueError unless every cache in ``others`` holds K/V of this
    cache's heads, head dims and dtype."""
    shapes = []
    for c in (cache, *others):
        if c.keys is None:
            continue
        k, v = c.keys, c.values
        plain = isinstance(k, mx.array)
        hk = k.shape[3] if plain else cache._store.head_dim(k)
        hv = v.shape[3] if plain else cache._store.head_dim(v, values=True)
        kk = k if plain else k[0]
        shapes.append(
            (kk.shape[1], hk, hv, str(k.dtype if plain else k[1].dtype).rsplit(".", 1)[-1])
        )
    for s in shapes[1:]:
        if s != shapes[0]:
            raise ValueError(
                f"[{where}] cannot batch caches with different (kv heads, key head dim, "
                f"value head dim, dtype): {shapes[0]} vs {s}."
            )


# ------------------------------------------------------ merge, quantize


def take_sequences(cache, caches: Sequence, lengths: Sequence[int]) -> None:
    """Fill this new batch with the newest ``lengths[b]`` tokens of each
    single cache, left-padded to the longest (``merge``)."""
    check_fits(cache, caches, cache._where("merge"))
    longest = max(lengths, default=0)
    if longest == 0:
        return
    parts = [
        None
        if c.keys is None
        else tuple(stored(cache, t, i == 1) for i, t in enumerate(oldest_first(c)))
        for c in caches
    ]
    store, ref = cache._store, next(p for p in parts if p is not None)
    stacked = []
    for side in (0, 1):
        rows = []
        for p, n in zip(parts, lengths):
            t = store.rows(ref[side], stop=0) if p is None else p[side]
            t = store.rows(t, start=store.length(t) - n)  # the newest n (a ring may hold more)
            rows.append(store.pad_rows(t, longest - n, 0, side == 1))
        stacked.append(store.concat_batch(rows))
    cache.keys, cache.values = stacked
    # Not ours alone: a one-sequence concatenate (or an unpadded slice)
    # is the single cache's own buffer, so the first write copies
    # unless MLX finds that cache let go.
    cache._owned = False
    cache._idx = longest


def take_batch(cache, batch, where: str) -> None:
    """mlx-lm's batch cache ``batch``: its padding, offsets and ``_idx``,
    and its whole buffer quantized (``to_quantized``)."""
    set_rows(
        cache,
        host_ints(batch.left_padding, "left_padding", where),
        host_ints(batch.offset, "offset", where),
    )
    cache._idx = batch._idx
    if batch.keys is not None:
        quantized.encode_buffers(cache, batch.keys, batch.values)


# ------------------------------------------------------------- padding


def prepare(cache, *, left_padding=None, lengths=None, right_padding=None) -> None:
    """Before a prefill: more left padding (only while empty), or the
    right padding of the prompts about to be written (rolled to the
    left by :meth:`finalize`)."""
    where = cache._where("prepare")
    if left_padding is not None:
        if cache.keys is not None:
            raise ValueError(f"[{where}] left padding can only be added to an empty cache.")
        more = host_ints(left_padding, "left_padding", where)
        set_rows(cache, cache._lp + more, cache._off - more)
    if right_padding is not None and max(right_padding) > 0:
        cache._take_right_padding(
            host_ints(lengths, "lengths", where),
            host_ints(right_padding, "right_padding", where),
        )


def roll(cache, shifts: np.ndarray) -> None:
    """Roll each sequence right by ``shifts`` rows: padding that was on
    its right moves to its left."""
    rolled = [
        cache._store.map(t, lambda a: roll_rows(a, shifts)) for t in (cache.keys, cache.values)
    ]
    cache.keys, cache.values = rolled
    cache._owned = True  # gathered: a fresh buffer
    set_rows(cache, cache._lp + shifts, cache._off - shifts)


def right_aligned(cache, c, idx: int, length: int):
    """``c``'s keys/values and left padding, shifted to end at row ``idx``
    of a ``length``-row buffer (``extend``; ``cache`` is not empty)."""
    left = idx - c._idx
    store = cache._store
    parts = []
    for t, values in ((c.keys, False), (c.values, True)):
        t = empty_rows(cache, c.batch_size, values) if t is None else t
        right = length - store.length(t) - left
        if right < 0:
            t = store.rows(t, stop=store.length(t) + right)
            right = 0
        parts.append(store.pad_rows(t, left, right, values))
    return parts[0], parts[1], c._lp + left, c._off


def empty_rows(cache, B: int, values: bool):
    """No rows, in this batch's layout, for ``B`` sequences (an empty
    cache joining a non-empty one)."""
    ref = cache.values if values else cache.keys
    H, D = ref[0].shape[1], cache._store.head_dim(ref, values)
    # Zero-row buffers, not encoded (a rotation refuses empty arrays).
    return cache._store.zeros(mx.zeros((B, H, 0, D), cache._store.dtype(ref)), 0, values)


def extend(cache, other, where: str) -> None:
    """Both caches right-aligned at the longer's ``_idx``, then stacked."""
    if not is_batch(other):
        other = type(cache).quantize(other, **cache.format.kwargs())
    elif other.format != cache.format:
        raise ValueError(
            f"[{where}] cannot extend a cache quantized as {cache.format} "
            f"with one quantized as {other.format}."
        )
    if cache.keys is None and other.keys is None:
        set_rows(
            cache, np.concatenate([cache._lp, other._lp]), np.concatenate([cache._off, other._off])
        )
        return
    check_fits(cache, [other], where)
    host = cache if cache.keys is not None else other
    store = cache._store
    idx = max(cache._idx, other._idx)
    length = max(store.length(c.keys) for c in (cache, other) if c.keys is not None)
    ours = right_aligned(host, cache, idx, length)
    theirs = right_aligned(host, other, idx, length)
    cache.keys, cache.values = (store.concat_batch([ours[i], theirs[i]]) for i in (0, 1))
    cache._owned = True
    set_rows(cache, np.concatenate([ours[2], theirs[2]]), np.concatenate([ours[3], theirs[3]]))
    cache._idx = idx


# ---------------------------------------------------------------- state
# ``state`` is mlx-lm's batch state followed by the format (group_size,
# bits, then KVFormat.extras), so that ``from_state(state)`` alone, as
# mlx-lm restores caches, rebuilds it.


def quantization_state(cache) -> tuple:
    return (cache.group_size, cache.bits) + cache.format.extras()


def take_quantization(cache, tail: tuple, where: str) -> None:
    if len(tail) < 2:
        raise ValueError(
            f"[{where}] a quantized batch state ends with (group_size, bits[, hadamard"
            f"[, v_group_size, v_bits]]); got {len(tail)} entries after the batch's."
        )
    key = KVFormat(as_int(tail[0], "group_size", where), as_int(tail[1], "bits", where))
    cache.format = key.with_extras(tuple(tail[2:]), where)
    cache._configure()


def check_positions(cache, length: int, where: str) -> None:
    if not 0 <= cache._idx <= length:
        raise ValueError(f"[{where}] _idx {cache._idx} is outside [0, {length}].")


def filter_rows(cache, batch_indices) -> None:
    """Keep the sequences ``batch_indices`` (in that order)."""
    take = np.asarray(batch_indices, dtype=np.int64).reshape(-1)
    if cache.keys is not None:
        idx = mx.array(take.astype(np.int32))
        cache.keys, cache.values = (
            cache._store.map(t, lambda a: mx.take(a, idx, axis=0))
            for t in (cache.keys, cache.values)
        )
        cache._owned = True
    set_rows(cache, cache._lp[take], cache._off[take])


def tokens_held(c) -> int:
    """How many tokens a single cache holds: ``size()``, except for mlx-lm's
    ``QuantizedKVCache``, whose ``size()`` is its base class's 0."""
    return c.size() if hasattr(c, "max_size") or not hasattr(c, "bits") else c.offset


def oldest_first(c):
    """A single cache's keys and values, oldest token first (mlxq's caches,
    or mlx-lm's ``KVCache``/``QuantizedKVCache``/``RotatingKVCache``), as
    plain arrays/tuples."""
    if hasattr(c, "temporal"):
        k, v = c.temporal()
    elif hasattr(c, "_temporal_order"):  # mlx-lm's RotatingKVCache
        k, v = c._temporal_order(c.keys), c._temporal_order(c.values)
    else:  # mlx-lm's KVCache / QuantizedKVCache: rows [0, offset)
        k, v = c.keys_and_values()
    return tuple(t if isinstance(t, mx.array) else tuple(t) for t in (k, v))


def _no_meta_state(cache):
    return ()


def _take_no_meta_state(cache, v) -> None:
    if tuple(v):
        raise ValueError(
            f"[{cache._where('meta_state')}] a batch cache keeps everything in state; "
            f"got meta_state {tuple(v)!r}."
        )


# A batch cache's meta_state: empty, everything is in its state.
NO_META_STATE = property(_no_meta_state, _take_no_meta_state)
