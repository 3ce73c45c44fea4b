"""``ChunkedQuantizedKVCache``: mlx-lm's ``ChunkedKVCache`` (Llama 4's chunked
local attention) over a quantized buffer.

mlx-lm's bookkeeping, step for step: the buffer holds the tokens from
``start_position`` to ``offset``; before each model call the model asks
``maybe_trim_front()`` to drop the oldest tokens beyond ``chunk_size``
(``start_position`` moves up by as many); updates append at ``offset -
start_position`` and grow the buffer 256 tokens at a time as mlx-lm's
does; ``trim(n)`` forgets the last ``n`` tokens (at most those held). The
rows are quantized as they are written (the ring primitives, bit-identical
to :func:`mx.quantize`), so every fetch is ``mx.quantize`` of what mlx-lm's
``ChunkedKVCache`` fetches.

``state`` is ``(keys, values, offset, chunk_size, start_position,
group_size, bits)`` (and a format's extras): mlx-lm has no class that loads
it, so a prompt-cache file holding one loads only where
``ChunkedQuantizedKVCache`` is registered in ``mlx_lm.models.cache`` (see
:func:`mlxq.mlx_lm.enable`).
"""

from typing import Optional

import mlx.core as mx

from ..arguments import as_int
from . import quantized
from .kv import QuantizedKVCache


class ChunkedQuantizedKVCache(QuantizedKVCache):
    """mlx-lm's ``ChunkedKVCache(chunk_size)`` with quantized keys and values
    (``group_size``, ``bits`` and the format options of
    :class:`~mlxq.QuantizedKVCache`; no recent window)."""

    mlx_lm_name = "ChunkedQuantizedKVCache"
    _SCALARS = ("offset", "chunk_size", "start_position", "group_size", "bits")
    chunk_size = 0
    start_position = 0

    def __init__(
        self,
        chunk_size: int,
        group_size: int = 64,
        bits: int = 8,
        hadamard: bool = False,
        v_group_size: Optional[int] = None,
        v_bits: Optional[int] = None,
    ):
        super().__init__(group_size, bits, hadamard, v_group_size, v_bits)
        self.chunk_size = as_int(chunk_size, "chunk_size", self._where("__init__"), minimum=1)
        self.start_position = 0

    @classmethod
    def from_cache(
        cls,
        cache,
        group_size: int = 64,
        bits: int = 8,
        hadamard: bool = False,
        v_group_size: Optional[int] = None,
        v_bits: Optional[int] = None,
    ) -> "ChunkedQuantizedKVCache":
        """The tokens of mlx-lm's ``ChunkedKVCache`` ``cache``, quantized."""
        out = cls(cache.chunk_size, group_size, bits, hadamard, v_group_size, v_bits)
        out.offset, out.start_position = cache.offset, cache.start_position
        if cache.keys is not None:
            keys, values = cache.keys_and_values()
            quantized.encode_buffers(out, keys, values)
        return out

    def _used(self) -> int:  # rows of the buffer that hold tokens
        return self.offset - self.start_position

    def _check_positions(self, length: int, where: str) -> None:
        if not 0 <= self.start_position <= self.offset:
            raise ValueError(
                f"[{where}] start_position {self.start_position} is outside [0, offset "
                f"{self.offset}]."
            )
        if self._used() > length:
            raise ValueError(
                f"[{where}] offset - start_position = {self._used()} tokens do not fit the "
                f"buffer's {length} rows."
            )

    def maybe_trim_front(self) -> None:
        """Keep at most the newest ``chunk_size`` tokens (mlx-lm's rule)."""
        if self.keys is None:
            return
        valid = self._used()
        if valid > self.chunk_size:
            trim = valid - self.chunk_size
            self.start_position += trim
            rows = self._store.rows
            self.keys = rows(self.keys, trim, valid)
            self.values = rows(self.values, trim, valid)
            self._owned = False  # a view of the old buffer: the next write copies

    def size(self) -> int:
        return self.offset

    def trim(self, n: int) -> int:
        """Forget the last ``n`` tokens (at most those held); returns how many."""
        n = min(self._used(), as_int(n, "n", self._where("trim"), minimum=0))
        self.offset -= n
        return n

    def make_mask(self, N: int, *, return_array: bool = False, window_size=None):
        """Llama 4's chunked mask for an ``N``-token step: a bool array
        ``[N, offset + N - start_position]``, each row seeing the earlier
        tokens of its own chunk. ``return_array`` and ``window_size`` are
        accepted for the protocol; a chunked mask is always an array."""
        end = self.offset + N
        keys = mx.arange(self.start_position, end)
        rows = mx.arange(self.offset, end)[:, None]
        same_chunk = (keys // self.chunk_size) == (rows // self.chunk_size)
        return same_chunk & (keys <= rows)

    @classmethod
    def merge(cls, caches):
        raise ValueError(
            "[mlxq.ChunkedQuantizedKVCache.merge] chunked caches cannot be batched "
            "(mlx-lm's ChunkedKVCache cannot either): generate one sequence at a time."
        )


__all__ = ["ChunkedQuantizedKVCache"]
