"""The cache protocol that mlx-lm's models and prompt-cache files expect.

A cache's ``state`` is ``(keys, values, *scalars)`` in mlx-lm's order (for
example ``(keys, values, offset)`` for ``KVCache``), so mlx-lm's
``save_prompt_cache``/``load_prompt_cache`` and ours exchange files freely.
``meta_state`` is the same scalars as strings.
"""

from typing import Optional, Tuple

import mlx.core as mx

from ..arguments import as_int, dtype_name, renamed
from ..hadamard import check_head_dim
from ..kv_format import KVFormat
from ._store import Plain, Quantized
from .decode_step import DecodePlan, check_adopt, key_class

_TRUE = mx.array(True)


class BaseCache:
    """Shared by every mlxq cache: state, validation, fetch, share.

    Subclasses set ``_SCALARS`` (the names after keys and values in
    ``state``), ``_configure()`` (build ``self._store`` and check
    parameters) and the update/trim/mask rules.
    """

    step = 256
    _SCALARS: Tuple[str, ...] = ("offset",)
    # The class name written to prompt-cache files (mlx-lm resolves it).
    mlx_lm_name: str = ""

    keys = None
    values = None
    offset = 0
    _store = Plain()
    # Whether the cache made its buffers itself and is their only holder, so
    # writes may update them in place whatever else shares their memory (see
    # cache/_store.py). False for buffers adopted from outside.
    _owned = False
    # (shapes, dtypes) of the last update _check_update passed, while the
    # buffers stay ours (see _check_update).
    _checked = None
    # True for a cache that nobody outside one mlxq-driven loop sees (the
    # caches mlxq.mlx_lm's generate_step makes for mlx-lm): that loop reads
    # ``state`` only to evaluate it, so reading it keeps the buffers ours and
    # the next write stays in place (a copy of the whole cache per prefill
    # chunk otherwise). Copies of such a cache are not private.
    _private = False

    def _where(self, method: str) -> str:
        return f"mlxq.{type(self).__name__}.{method}"

    def _configure(self) -> None:
        """Build ``self._store`` from the parameters and check them."""

    # ------------------------------------------------------------------ state
    @property
    def state(self):
        # Handed out, the buffers are no longer the cache's alone: the next
        # write updates them in place only if MLX says nobody else holds them
        # (else it copies first), so a kept state never changes under its
        # holder. A private cache (see _private) keeps them.
        self._handing_out()
        scalars = tuple(getattr(self, n) for n in self._SCALARS)
        return (self.keys, self.values) + scalars + self._extras()

    def _handing_out(self) -> None:
        """The buffers (or lazy views of them) go out: the next write updates
        them in place only if MLX says it may donate them."""
        if not self._private:
            self._owned = False

    @state.setter
    def state(self, v):
        names = ("keys", "values") + self._SCALARS
        v = tuple(v)
        if len(v) < len(names):
            raise ValueError(
                f"[{self._where('state')}] state must be ({', '.join(names)}), "
                f"got {len(v)} entries."
            )
        where = self._where("state")
        scalars = {n: as_int(x, n, where) for n, x in zip(self._SCALARS, v[2 : len(names)])}
        self._set_scalars(scalars, v[len(names) :], where)
        self._configure()
        self._adopt(v[0], v[1], "state")

    def _set_scalars(self, scalars: dict, extras: tuple, where: str) -> None:
        """Take ``state``'s scalars (by name) and its trailing entries
        (none, but for a quantized cache's format)."""
        if extras:
            raise ValueError(
                f"[{where}] state must be (keys, values, {', '.join(self._SCALARS)}), "
                f"got {len(extras)} more entries."
            )
        for name, x in scalars.items():
            setattr(self, name, x)

    def _extras(self) -> tuple:
        """The trailing entries of ``state`` and ``meta_state``."""
        return ()

    @property
    def meta_state(self):
        return tuple(str(getattr(self, n)) for n in self._SCALARS) + tuple(
            str(x) for x in self._extras()
        )

    @meta_state.setter
    def meta_state(self, v):
        v, n = tuple(v), len(self._SCALARS)
        where = self._where("meta_state")
        if len(v) < n or not all(str(x).lstrip("-").isdigit() for x in v):
            raise ValueError(
                f"[{where}] meta_state must be ({', '.join(self._SCALARS)}) as strings, got {v!r}."
            )
        scalars = {name: as_int(int(x), name, where) for name, x in zip(self._SCALARS, v)}
        self._set_scalars(scalars, tuple(int(x) for x in v[n:]), where)
        self._configure()

    def __copy__(self):
        # The copy shares the buffers (as does MLX's own array deepcopy), so
        # neither cache owns them any more: each one's next write copies
        # unless MLX finds the other has let go.
        other = type(self).__new__(type(self))
        other.__dict__.update(self.__dict__)
        self._owned = other._owned = False
        self._private = other._private = False
        return other

    def __deepcopy__(self, memo):
        other = self.__copy__()
        memo[id(self)] = other
        return other

    @classmethod
    def from_state(cls, state):
        """A cache holding ``state`` (as ``state`` returns it), built without ``__init__``."""
        obj = cls.__new__(cls)
        obj.state = state
        return obj

    def _adopt(self, keys, values, method: str) -> None:
        """Validate and take over stored keys/values (state, restore)."""
        where = self._where(method)
        if keys is None and values is None:
            self.keys = self.values = None
            self._check_positions(0, where)
            return
        if keys is None or values is None:
            raise ValueError(f"[{where}] keys and values must both be given or both be None.")
        keys = self._store.check(keys, "keys", where)
        values = self._store.check(values, "values", where)
        k0, v0 = (keys[0], values[0]) if self._store.quantized else (keys, values)
        if k0.shape[:3] != v0.shape[:3]:
            raise ValueError(
                f"[{where}] keys and values must agree on [B, H, S]: "
                f"{tuple(k0.shape[:3])} vs {tuple(v0.shape[:3])}."
            )
        self._check_positions(k0.shape[2], where)
        self.keys, self.values = keys, values
        self._owned = False

    def _check_positions(self, length: int, where: str) -> None:
        """Check offset (and ring index) against a buffer of ``length`` rows."""
        if self.offset < 0 or self.offset > length:
            raise ValueError(
                f"[{where}] offset {self.offset} is outside [0, {length}] "
                f"(the buffer holds {length} rows)."
            )

    # ---------------------------------------------------------------- updates
    def _check_update(self, keys, values) -> int:
        """Validate an update; returns its number of tokens T. (Cheap when valid:
        it runs on every decoded token.)"""
        # The decode path: buffers this cache made itself from updates of the
        # same shapes and dtypes as one already checked fit.
        sig = (
            (keys.shape, values.shape, keys.dtype, values.dtype)
            if isinstance(keys, mx.array) and isinstance(values, mx.array)
            else None
        )
        if self._owned and sig is not None and sig == self._checked and keys.ndim == 4:
            return keys.shape[2]
        if not (
            isinstance(keys, mx.array)
            and isinstance(values, mx.array)
            and keys.ndim == 4
            and values.ndim == 4
            and keys.shape[:3] == values.shape[:3]
            and keys.shape[2] >= 1
        ):
            self._reject_shapes(keys, values)
        store = self._store
        for name, x, buf in (("keys", keys, self.keys), ("values", values, self.values)):
            side = name == "values"
            if store.quantized and (
                x.shape[3] % store.side(side)[0] or not mx.issubdtype(x.dtype, mx.floating)
            ):
                self._reject_quantization(name, x)
            if buf is not None:
                b0 = buf[0] if store.quantized else buf
                if (b0.shape[0], b0.shape[1], store.head_dim(buf, side), store.dtype(buf)) != (
                    x.shape[0],
                    x.shape[1],
                    x.shape[3],
                    x.dtype,
                ):
                    self._reject_misfit(name, x, buf)
        self._checked = sig
        return keys.shape[2]

    def _reject_shapes(self, keys, values):
        where = self._where("update_and_fetch")
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

    def _reject_quantization(self, name, x):
        where = self._where("update_and_fetch")
        if not mx.issubdtype(x.dtype, mx.floating):
            raise ValueError(
                f"[{where}] {name} must be floating point to quantize, got {dtype_name(x.dtype)}."
            )
        raise ValueError(
            f"[{where}] {name} head dim {x.shape[3]} is not a multiple of "
            f"group_size {self._store.side(name == 'values')[0]}."
        )

    def _reject_misfit(self, name, x, buf):
        store = self._store
        b0 = buf[0] if store.quantized else buf
        raise ValueError(
            f"[{self._where('update_and_fetch')}] {name} of shape {tuple(x.shape)} and dtype "
            f"{dtype_name(x.dtype)} do not fit the cache's [B={b0.shape[0]}, H={b0.shape[1]}, *, "
            f"D={store.head_dim(buf, name == 'values')}] {dtype_name(store.dtype(buf))} buffer."
        )

    def _used(self) -> int:
        """Rows of the buffer that hold tokens: ``offset`` (a batch cache's
        ``_idx``, its offsets being per sequence)."""
        return self.offset

    def keys_and_values(self):
        """The cached keys and values: the buffer up to ``offset`` (a view, no copy)."""
        if self.keys is None:
            raise ValueError(f"[{self._where('keys_and_values')}] the cache is empty.")
        used = self._used()
        if used < self._store.length(self.keys):
            return self._fetched(
                self._store.rows(self.keys, stop=used),
                self._store.rows(self.values, stop=used),
            )
        return self._fetched(self.keys, self.values)

    def _fetched(self, keys, values):
        """Keys and values as the cache hands them out (see _store.fetched)."""
        return self._store.fetched(keys), self._store.fetched(values, values=True)

    def update_and_share(self, keys, values):
        """``update_and_fetch``, returned as a :class:`~mlxq.SharedKV` for sharer layers."""
        from .shared import SharedKV

        fetched_k, fetched_v = self.update_and_fetch(keys, values)
        return SharedKV.from_cache(self, fetched_k, fetched_v)

    def _grow_ring(self, keys, values, written: int) -> None:
        """A ring's growth before a one-token write (mlx-lm's rule): while it
        is shorter than ``max_size`` and full (``written`` tokens), 256 more
        zero rows (up to ``max_size``), and the write goes at ``written``."""
        store = self._store
        length = 0 if self.keys is None else store.length(self.keys)
        if self.keys is not None and (written < length or length >= self.max_size):
            return
        n = min(self.step, self.max_size - written)
        new_k, new_v = store.zeros(keys, n), store.zeros(values, n, values=True)
        if self.keys is None:
            self.keys, self.values = new_k, new_v
        else:
            self.keys = store.concat([self.keys, new_k])
            self.values = store.concat([self.values, new_v])
        self._owned = True  # fresh buffers, held by nobody else
        self._idx = written

    # -------------------------------------------------------- compiled decode
    # The plan prepare_decode returned and adopt_decode has not taken yet.
    _pending_decode: Optional[DecodePlan] = None

    def prepare_decode(self) -> DecodePlan:
        """The host half of a compiled one-token step (see
        mlxq/cache/decode_step.py): the buffer sized for the step and ours
        to write in place; returns the step's plan."""
        refusal = self.decode_refusal()
        if refusal is not None:
            raise ValueError(f"[{self._where('prepare_decode')}] {refusal}")
        return self._prepare_step()

    def _prepare_step(self) -> DecodePlan:
        """prepare_decode once decode_refusal has said yes (the compiled
        step's driver asks that first, for every cache)."""
        plan = self._decode_slot()
        if not self._owned:  # handed out: the graph writes in place, so copy first
            copy = lambda a: mx.where(_TRUE, a, a)  # noqa: E731  (new memory unless a is ours alone)
            self.keys = self._store.map(self.keys, copy)
            self.values = self._store.map(self.values, copy)
            self._owned = True
        self._pending_decode = plan
        return plan

    def decode_refusal(self) -> Optional[str]:
        """Why this cache cannot take a compiled step now, or None."""
        if type(self)._decode_slot is BaseCache._decode_slot:
            return f"{type(self).__name__} has no compiled decode step."
        if self.keys is None:
            return "the cache is empty: a compiled step continues a prefill."
        if getattr(self, "_recent", None) is not None:
            return (
                "a cache with a recent window decodes eagerly (its exact window is not part "
                "of the compiled step)."
            )
        return None

    def _decode_slot(self) -> DecodePlan:
        """Bookkeeping before a compiled step; returns its plan."""
        raise ValueError(f"[{self._where('prepare_decode')}] this cache has no compiled step.")

    def adopt_decode(self, plan: DecodePlan, keys, values) -> None:
        """Take the compiled step's written buffers (shaped as the cache's)
        and count the token."""
        check_adopt(self, plan, keys, values, self._where("adopt_decode"))
        self._adopt_step(plan, keys, values)

    def _adopt_step(self, plan: DecodePlan, keys, values) -> None:
        """adopt_decode without the checks (the compiled step's own outputs)."""
        self.keys, self.values = keys, values
        self._owned = True  # the graph wrote our buffers in place
        self._pending_decode = None
        self._decoded(plan)

    def _decoded(self, plan: DecodePlan) -> None:
        """Bookkeeping after an adopted step: the token counted (a ring's
        index moves too)."""
        self.offset += 1

    def _blank(self, like, n: int, values: bool = False):
        """``n`` empty rows for an update shaped like ``like``: zero words,
        as mlx-lm's caches grow."""
        return self._store.zeros(like, n, values)

    def _resize_rows(self, keep: int, capacity: int) -> None:
        """Fresh buffers of ``capacity`` rows: the first ``keep`` rows, then
        empty ones (``_blank``)."""
        store = self._store

        def resized(t, values):
            B, H = (t[0] if store.quantized else t).shape[:2]
            like = mx.zeros((B, H, 0, store.head_dim(t, values)), store.dtype(t))
            blank = self._blank(like, capacity - keep, values)
            return store.concat([store.rows(t, stop=keep), blank])

        self.keys, self.values = resized(self.keys, False), resized(self.values, True)
        self._owned = True

    def _grow_for_decode(self, prev: int, limit: Optional[int] = None) -> int:
        """A growing buffer sized for a compiled step writing row ``prev``:
        ``prev + 1`` rows in whole key classes (at most ``limit``), the
        rows before ``prev`` kept; returns the capacity."""
        want = key_class(prev + 1) if limit is None else min(key_class(prev + 1), limit)
        if self._store.length(self.keys) != want:
            self._resize_rows(prev, want)
        return want

    # ------------------------------------------------------------- accounting
    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return self._store.nbytes(self.keys) + self._store.nbytes(self.values)

    # ----------------------------------------------------------------- trims
    def _check_trim(self, n) -> int:
        return as_int(n, "n", self._where("trim"), minimum=0)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Forget the last ``n`` tokens (at most ``offset``); returns how many."""
        n = min(self.offset, self._check_trim(n))
        self.offset -= n
        return n


def quantization_options(
    where: str,
    hadamard: Optional[bool],
    recent: Optional[int] = None,
    kv_rotate: Optional[bool] = None,
    keep_recent: Optional[int] = None,
) -> Tuple[bool, int]:
    """``(hadamard, recent)`` of a constructor, taking the deprecated names
    ``kv_rotate`` and ``keep_recent`` too."""
    # The warnings point at the constructor's caller.
    hadamard = renamed(hadamard, kv_rotate, "hadamard", "kv_rotate", where, False, stacklevel=4)
    recent = renamed(recent, keep_recent, "recent", "keep_recent", where, 0, stacklevel=4)
    return (False if hadamard is None else hadamard), (0 if recent is None else recent)


class QuantizedStorage:
    """Mixin for the caches that hold quantized triples in one
    :class:`~mlxq.kv_format.KVFormat` (``format``). mlx-lm's attention reads
    ``group_size`` and ``bits`` (the keys') from the cache.

    ``state`` and ``meta_state`` are mlx-lm's, plus the format's trailing
    entries only where mlx-lm has nothing to say (KVFormat.extras). A state
    without them is mlx-lm's (and earlier mlxq files'); mlx-lm's own classes
    cannot load the extended ones.
    """

    format = KVFormat()

    @property
    def group_size(self) -> int:
        return self.format.group_size

    @property
    def bits(self) -> int:
        return self.format.bits

    @property
    def v_group_size(self) -> int:
        return self.format.v_group_size

    @property
    def v_bits(self) -> int:
        return self.format.v_bits

    @property
    def hadamard(self) -> bool:
        return self.format.hadamard

    @property
    def kv_rotate(self) -> bool:
        """Deprecated name of :attr:`hadamard`."""
        return self.format.hadamard

    def _encode_buffers(self, keys, values) -> None:
        """Take unquantized ``keys``/``values`` buffers, quantized whole
        (``to_quantized``): fresh ``mx.quantize`` outputs, held by nobody else."""
        self._check_update(keys, values)
        self.keys = self._store.encode(keys)
        self.values = self._store.encode(values, values=True)
        self._owned = True

    def _use_quantized_store(self) -> None:
        self._store = Quantized(self.format.checked(self._where("__init__")))

    def _check_update(self, keys, values) -> int:
        if self.format.hadamard and self._checked is None:
            for x in (keys, values):
                check_head_dim(x.shape[-1], self._where("update_and_fetch"))
        return super()._check_update(keys, values)

    def _extras(self) -> tuple:
        return self.format.extras()

    def _set_scalars(self, scalars: dict, extras: tuple, where: str) -> None:
        key = KVFormat(scalars.pop("group_size"), scalars.pop("bits"))
        self.format = key.with_extras(extras, where)
        BaseCache._set_scalars(self, scalars, (), where)

    def to_quantized(
        self,
        group_size: int = 64,
        bits: int = 4,
        hadamard: bool = False,
        v_group_size: Optional[int] = None,
        v_bits: Optional[int] = None,
        *,
        kv_rotate: Optional[bool] = None,
    ):
        """Already quantized: ``self`` when the format matches."""
        where = self._where("to_quantized")
        hadamard, _ = quantization_options(where, hadamard, kv_rotate=kv_rotate)
        want = KVFormat(group_size, bits, v_group_size, v_bits, hadamard)
        if want != self.format:
            raise ValueError(
                f"[{where}] the cache is quantized as {self.format}; cannot requantize to {want}."
            )
        return self
