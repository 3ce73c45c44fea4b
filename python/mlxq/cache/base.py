"""The cache protocol that mlx-lm's models and prompt-cache files expect
(``state`` in mlx-lm's layout, see state.py), shared by every mlxq cache."""

import copy
from typing import Optional, Tuple

from ..arguments import as_int
from ..kv_format import KVFormat
from . import checks, decode_step, state
from ._store import FormatField, Plain


class BaseCache:
    """Shared by every mlxq cache: state, buffer ownership, fetch, trim.

    Subclasses set ``_SCALARS`` (the names after keys and values in
    ``state``), ``_configure()`` and the update, trim and mask rules. A
    quantized cache holds its KVFormat in ``format``; an exact recent
    window (mlxq.cache.recent) is the member ``_recent``."""

    step = 256
    _SCALARS: Tuple[str, ...] = ("offset",)
    mlx_lm_name: str = ""  # the class name written to prompt-cache files

    keys = values = None
    offset = 0
    _store = Plain()
    format: Optional[KVFormat] = None  # a quantized cache's (see kv_format.py)
    # The format's fields (mlx-lm reads group_size and bits); absent when plain.
    group_size, bits, v_group_size, v_bits, hadamard = map(FormatField, FormatField.NAMES)
    kv_rotate = FormatField("hadamard")  # the deprecated name of hadamard
    _recent = None  # the exact recent window (RecentWindow), if any
    # Whether the cache made its buffers and is their only holder, so writes
    # update them in place (see _store.py); False once adopted or handed out.
    _owned = False
    _checked = None  # (shapes, dtypes) of the last update checks passed
    # A cache only one mlxq-driven loop sees (generate_step's own), which reads
    # ``state`` only to evaluate it: reading it keeps the buffers ours.
    _private = False
    _pending_decode = None  # the plan prepare_decode returned, not yet adopted

    def _where(self, method: str) -> str:
        return f"mlxq.{type(self).__name__}.{method}"

    def _configure(self) -> None:  # check the parameters, build _store (and _recent)
        pass

    # ------------------------------------------------------- state (state.py)
    @property
    def state(self):
        self._handing_out()
        return state.state_of(self)

    @state.setter
    def state(self, v):
        state.take_state(self, v)

    @property
    def meta_state(self):
        return state.meta_state_of(self)

    @meta_state.setter
    def meta_state(self, v):
        state.take_meta_state(self, v)

    def __copy__(self):
        # Buffers (and the recent ring) shared, as MLX's array deepcopy does:
        # each cache's next write copies unless MLX finds the other let go.
        other = type(self).__new__(type(self))
        other.__dict__.update(self.__dict__)
        self._owned = other._owned = self._private = other._private = False
        other._recent = copy.copy(self._recent)
        return other

    def __deepcopy__(self, memo):
        memo[id(self)] = other = self.__copy__()
        return other

    @classmethod
    def from_state(cls, state):
        """A cache holding ``state``, built without ``__init__`` (as mlx-lm loads files)."""
        obj = cls.__new__(cls)
        obj.state = state
        return obj

    def _handing_out(self) -> None:
        """The buffers go out: the next write is in place only where MLX may donate."""
        if not self._private:
            self._owned = False

    def _adopt(self, keys, values, method: str) -> None:
        """Validate and take over stored keys/values (state, restore)."""
        self.keys, self.values = checks.adopted(self, keys, values, self._where(method))
        self._owned = False
        if self._recent is not None:  # adopted rows were never held exactly
            self._recent.reset(self.offset)

    def _check_positions(self, length: int, where: str) -> None:
        """Check offset (and ring index) against a buffer of ``length`` rows."""
        checks.offset_within(self, length, where)

    def _used(self) -> int:  # rows of the buffer that hold tokens (a batch's: _idx)
        return self.offset

    def keys_and_values(self):  # the buffer up to offset (a view, no copy)
        if self.keys is None:
            raise ValueError(f"[{self._where('keys_and_values')}] the cache is empty.")
        used, rows = self._used(), self._store.rows
        if used < self._store.length(self.keys):
            return self._fetched(rows(self.keys, stop=used), rows(self.values, stop=used))
        return self._fetched(self.keys, self.values)

    def _fetched(self, keys, values):  # as the cache hands them out (_store.fetched)
        return self._store.fetched(keys), self._store.fetched(values, values=True)

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        n = self._recent.nbytes if self._recent is not None else 0
        return n + sum(self._store.nbytes(t) for t in (self.keys, self.values) if t is not None)

    def is_trimmable(self) -> bool:
        return True

    def update_and_share(self, keys, values):
        """``update_and_fetch``, as a :class:`~mlxq.SharedKV` for sharer layers."""
        from .shared import SharedKV

        return SharedKV.from_cache(self, *self.update_and_fetch(keys, values))

    def trim(self, n: int) -> int:
        """Forget the last ``n`` tokens (at most ``offset``); returns how many."""
        old = self.offset
        n = min(old, as_int(n, "n", self._where("trim"), minimum=0))
        self.offset -= n
        if self._recent is not None and n:
            self._recent.trimmed(old, self.offset)
        return n

    # The compiled one-token step's host halves (decode_step.py).
    def prepare_decode(self):  # the buffer sized and the cache's own; returns the plan
        return decode_step.prepare(self)

    def adopt_decode(self, plan, keys, values) -> None:  # the step's buffers; count it
        decode_step.adopt(self, plan, keys, values)
