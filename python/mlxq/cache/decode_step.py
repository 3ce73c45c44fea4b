"""A cache's one-token step, split for a compiled decode graph (mlxq.compiled).

Eager decode does a step's bookkeeping and its write in one
``update_and_fetch``; a graph that ``mx.compile`` replays for every token
cannot hold the bookkeeping (growth, trims and ring indices are host
decisions that change shapes) and must not bake in the position. So a step
is three calls:

* ``plan = cache.prepare_decode()`` (host, outside the graph): grows or
  trims the buffer to the capacity the step needs, wraps the ring index,
  and returns a :class:`DecodePlan`: its kind, the write row, the RoPE
  offset and the capacity.
* Inside the graph, a :class:`DecodeView` stands in for the cache: the model
  reads its ``offset`` (an int32 array), its ``make_mask`` and its
  ``update_and_fetch``, which writes the token at the array position in
  place (``quantized_kv_update`` / ``ring_update``) and fetches the whole
  buffer.
* ``cache.adopt_decode(plan, keys, values)`` (host): the graph's updated
  buffers become the cache's, and the offset and ring index advance.

A growing buffer is fetched whole, its unwritten rows hidden by a bool mask;
its capacity is the written rows rounded up to 256 (the growth step, and the
key class the kernels split by, see csrc/row_tiling.h), so the fused kernel
cuts the keys as for the exact fetch and the result is bit-identical to
eager decode. A graph is traced once per (kind, capacity): every 256 tokens
while a buffer grows, never once a ring is full.
"""

from typing import NamedTuple, Optional, Tuple

import mlx.core as mx

_TRUE = mx.array(True)

# Rows a growing buffer's capacity is rounded up to (the caches' growth step
# and the kernels' key class: see csrc/row_tiling.h).
KEY_CLASS = 256


def key_class(n: int) -> int:
    """``n`` rounded up to whole key classes (at least one)."""
    return max(1, -(-n // KEY_CLASS)) * KEY_CLASS


class DecodePlan(NamedTuple):
    """One cache's part of a compiled decode step (see the module docstring).

    Attributes:
        kind (str): ``"grow"``: the buffer is fetched whole with the rows
          after ``pos`` masked; ``"ring"``: a full ring, fetched whole as it
          lies (mlx-lm's ring order); ``"batch"``: a growing batch cache,
          its padding masked too; ``"batch_ring"``: a batch of rings, its
          mask (mlx-lm's) made on the host.
        pos (int): The row the token is written to.
        offset (int or tuple): Tokens before this one (the RoPE position);
          per sequence for a batch.
        capacity (int): Rows of the buffer.
        ring_shift (int): For a full ring: mlx-lm's window-mask roll (the
          ring index before the step, plus one); 0 otherwise.
        left_padding (tuple): A batch's padding rows per sequence; for a
          batch ring, the key of its step mask (see remember_mask).
    """

    kind: str
    pos: int
    offset: object
    capacity: int
    ring_shift: int
    left_padding: tuple = ()

    def inputs(self) -> tuple:
        """The step's values the graph takes as arrays (ints as int32), in
        the order a :class:`DecodeView` takes them."""
        if self.kind == "batch_ring":  # its mask, made on the host
            return (self.pos, self.offset, _MASKS[self.left_padding])
        third = self.left_padding if self.kind == "batch" else self.ring_shift
        return (self.pos, self.offset, third)


# The host-made masks of batch rings' steps, by key (a plan stays hashable
# and small; caches in one state share one). Only the latest few are kept.
_MASKS = {}


def remember_mask(key: tuple, make) -> tuple:
    """``key`` (the state a batch ring's step mask follows from), with the
    mask ``make()`` builds kept for it (built once per state)."""
    if key not in _MASKS:
        if len(_MASKS) >= 16:
            _MASKS.pop(next(iter(_MASKS)))
        _MASKS[key] = make()
    return key


def buffer_shapes(store, keys, values) -> Tuple[Tuple[int, ...], ...]:
    parts = (tuple(keys) + tuple(values)) if store.quantized else (keys, values)
    return tuple(tuple(a.shape) for a in parts)


class DecodeView:
    """A cache inside the compiled decode graph: what the model calls.

    ``offset`` is the step's RoPE position as an int32 array, and the
    quantized ones carry ``bits`` / ``group_size`` as the cache does, so the
    model's code runs unchanged. After the model call, ``keys`` / ``values``
    are the written buffers (the graph's outputs).
    """

    def __init__(self, static, plan: DecodePlan, keys, values, pos, offset, ring_shift):
        self._store, quantization, self._max_size = static
        self._plan = plan
        self.keys, self.values = keys, values
        self._pos = pos
        self._ring_shift = ring_shift
        self.offset = offset
        self.writes = 0
        self.masks = 0
        if quantization is not None:
            self.group_size, self.bits = quantization

    @staticmethod
    def static_of(cache) -> tuple:
        """What a view needs of its cache besides the buffers (the graph keeps
        it, not the cache): (store, (group_size, bits) or None, max_size)."""
        quantization = (cache.group_size, cache.bits) if cache._store.quantized else None
        return cache._store, quantization, getattr(cache, "max_size", None)

    @staticmethod
    def signature_of(cache, plan: DecodePlan) -> tuple:
        """What a graph built for ``cache``'s step depends on besides its
        inputs' shapes: the plan's kind and capacity, the storage format."""
        return (plan.kind, plan.capacity, getattr(cache, "max_size", None)) + cache._store.key

    def update_and_fetch(self, keys, values):
        if keys.shape[2] != 1 or self.writes:
            raise ValueError(
                "[mlxq.DecodeView.update_and_fetch] a compiled decode step writes one "
                f"token once per cache, got {keys.shape[2]} tokens (write {self.writes + 1})."
            )
        self.writes += 1
        self.keys, self.values = self._store.write_kv(
            self.keys, self.values, keys, values, self._pos, True
        )
        self.offset = self.offset + 1
        store = self._store
        return store.fetched(self.keys), store.fetched(self.values, values=True)

    def make_mask(self, N: int, *, return_array: bool = False, window_size=None):
        """The step's bool mask over the whole buffer, with the values of the
        eager cache's mask on its rows (mlx-lm's rules; see masks.py)."""
        if N != 1:
            raise ValueError(f"[mlxq.DecodeView.make_mask] a decode step has one token, got {N}.")
        self.masks += 1
        plan = self._plan
        if plan.kind == "batch_ring":  # mlx-lm's mask, made on the host
            if window_size not in (None, self._max_size):
                raise ValueError(
                    f"[mlxq.DecodeView.make_mask] a batch ring's compiled step takes its "
                    f"window ({self._max_size}), got {window_size}."
                )
            return self._ring_shift
        columns = _columns(plan.capacity)
        if plan.kind != "ring":
            visible = columns <= self._pos
            if window_size is not None:
                visible = visible & (columns > self._pos - window_size)
            if plan.kind == "batch":  # [B, 1, 1, C]: each sequence's padding hidden
                padding = self._ring_shift[:, None]
                visible = (visible & (columns >= padding))[:, None, None, :]
            return visible
        if window_size is None or self._max_size <= window_size:
            return None
        # mlx-lm's RotatingKVCache.make_mask: the window over the ring, rolled
        # to the ring index (mx.roll by an array amount, as remainder).
        n = plan.capacity
        return mx.remainder(columns - self._ring_shift, n) >= n - window_size


_COLUMN_CACHE = {}


def _columns(n: int) -> mx.array:
    """``arange(n)`` as ``[1, n]`` int32, made once per ``n`` (a constant of
    the graphs that capture it)."""
    c = _COLUMN_CACHE.get(n)
    if c is None:
        c = mx.arange(n, dtype=mx.int32)[None]
        mx.eval(c)
        _COLUMN_CACHE[n] = c
    return c


def check_adopt(cache, plan: Optional[DecodePlan], keys, values, where: str) -> None:
    """ValueError unless ``plan`` is the cache's pending one and the buffers
    have the shapes of the ones the step read (the cache's own)."""
    if plan is None or cache._pending_decode is not plan:
        raise ValueError(
            f"[{where}] adopt_decode needs the plan the cache's last prepare_decode "
            "returned (each plan adopts once)."
        )
    store = cache._store
    keys, values = store.check(keys, "keys", where), store.check(values, "values", where)
    got = buffer_shapes(store, keys, values)
    want = buffer_shapes(store, cache.keys, cache.values)
    if got != want:
        raise ValueError(f"[{where}] the step's buffers have shapes {got}; the cache's are {want}.")


# ------------------------------------------------------- the cache's half
# Each cache with a compiled step has two hooks: ``_decode_slot()``, the
# bookkeeping of its eager one-token update without the write (returns the
# plan), and ``_decoded(plan)``, the token counted once the graph has run.


WINDOW_REFUSAL = (
    "a cache with a recent window decodes eagerly (its exact window is not part of the "
    "compiled step)"
)


def refusal(cache) -> Optional[str]:
    """Why ``cache`` cannot take a compiled step now, or None."""
    if not hasattr(cache, "_decode_slot"):
        return f"{type(cache).__name__} has no compiled decode step."
    if cache.keys is None:
        return "the cache is empty: a compiled step continues a prefill."
    if cache._recent is not None:
        return WINDOW_REFUSAL
    if cache._store.quantized and cache._store.format.latent:
        return "an MLA latent cache decodes eagerly (its RoPE keys are not quantized)."
    return None


def prepare(cache) -> DecodePlan:
    """``cache.prepare_decode()``: the buffer sized for the step and the
    cache's alone to write in place; returns the step's plan."""
    why = refusal(cache)
    if why is not None:
        raise ValueError(f"[{cache._where('prepare_decode')}] {why}")
    return prepare_step(cache)


def prepare_step(cache) -> DecodePlan:
    """:func:`prepare` once :func:`refusal` has said yes (the compiled
    step's driver asks that first, for every cache)."""
    plan = cache._decode_slot()
    if not cache._owned:  # handed out: the graph writes in place, so copy first
        copy = lambda a: mx.where(_TRUE, a, a)  # noqa: E731  (new memory unless a is ours alone)
        cache.keys = cache._store.map(cache.keys, copy)
        cache.values = cache._store.map(cache.values, copy)
        cache._owned = True
    cache._pending_decode = plan
    return plan


def adopt(cache, plan: DecodePlan, keys, values) -> None:
    """``cache.adopt_decode(plan, keys, values)``: the compiled step's
    written buffers (shaped as the cache's) become the cache's."""
    check_adopt(cache, plan, keys, values, cache._where("adopt_decode"))
    adopt_step(cache, plan, keys, values)


def adopt_step(cache, plan: DecodePlan, keys, values) -> None:
    """:func:`adopt` without the checks (the compiled step's own outputs)."""
    cache.keys, cache.values = keys, values
    cache._owned = True  # the graph wrote the cache's buffers in place
    cache._pending_decode = None
    cache._decoded(plan)


def grow_for(cache, prev: int, limit: Optional[int] = None, blank=None) -> int:
    """A growing buffer sized for a compiled step writing row ``prev``:
    ``prev + 1`` rows in whole key classes (at most ``limit``), the rows
    before ``prev`` kept and the rest ``blank(like, n, values)`` rows (by
    default zero words); returns the capacity."""
    store = cache._store
    blank = blank or store.zeros
    want = key_class(prev + 1) if limit is None else min(key_class(prev + 1), limit)
    if store.length(cache.keys) == want:
        return want

    def resized(t, values):
        B, H = (t[0] if store.quantized else t).shape[:2]
        like = mx.zeros((B, H, 0, store.head_dim(t, values)), store.dtype(t))
        return store.concat([store.rows(t, stop=prev), blank(like, want - prev, values)])

    cache.keys, cache.values = resized(cache.keys, False), resized(cache.values, True)
    cache._owned = True
    return want
