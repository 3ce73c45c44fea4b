"""Fetches that only mlxq's attention reads correctly, and refuse other readers.

A quantized cache hands out its K/V for attention. Plain same-width rows are
a plain ``(packed, scales, biases)`` tuple, which mlx-lm's own attention reads
as well as mlxq's. Three kinds are not: rows in the Hadamard basis
(``hadamard``), values quantized apart from the keys (``v_bits``), and the
exact recent window beside the quantized rows (``recent``). mlx-lm's
attention would read the first two as plain rows and return plausible,
wrong numbers. So these fetches are tuples that refuse to be unpacked or
indexed by code outside the ``mlxq`` package: such a read raises a
``ValueError`` naming the way out. Attribute access reads them from
anywhere; MLX's C++ (``mx.eval``, ``mx.compile``) reads them through the
Python code that called it, so mlxq's own calls do.
"""

import sys


def _read_by_mlxq() -> bool:
    # Frames: 0 this function, 1 __iter__ / __getitem__, 2 the reader.
    name = sys._getframe(2).f_globals.get("__name__", "")
    return name == "mlxq" or name.startswith("mlxq.")


def _refuse(fetch) -> None:
    raise ValueError(
        f"[mlxq] this KV fetch holds {fetch.WHAT}, which only mlxq's attention reads "
        "correctly: call mlxq.mlx_lm.enable() before running an mlx-lm model on mlxq's "
        "caches, or attend the fetch with mlxq.sdpa (code that handles the format itself "
        "reads the entries with mlxq.guard.parts)."
    )


def parts(fetch) -> tuple:
    """The entries of a fetch as a plain tuple, for code that knows its
    format (tests, tools): ``(packed, scales, biases)`` of a triple,
    ``(quantized, exact, visible, columns, rows)`` of a recent
    split. Anything else comes back as ``tuple(fetch)``."""
    return tuple(tuple.__iter__(fetch)) if isinstance(fetch, MlxqOnly) else tuple(fetch)


def first(t):
    """The first entry of a fetch or of any sequence, for mlxq's own reads
    on every step: a tuple's without the frame check."""
    return tuple.__getitem__(t, 0) if isinstance(t, tuple) else t[0]


def entries(t):
    """The entries of a fetch or of any sequence, for mlxq's own reads on
    every step: a tuple's without the frame check."""
    return tuple.__iter__(t) if isinstance(t, tuple) else iter(t)


class MlxqOnly:
    """Mixin for tuple subclasses that only mlxq may unpack or index."""

    __slots__ = ()
    WHAT = "rows in a format of mlxq's"

    def __iter__(self):
        if not _read_by_mlxq():
            _refuse(self)
        return tuple.__iter__(self)

    def __getitem__(self, index):
        if not _read_by_mlxq():
            _refuse(self)
        return tuple.__getitem__(self, index)


__all__ = ["MlxqOnly", "entries", "first", "parts"]
