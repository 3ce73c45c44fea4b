"""The options of :func:`mlxq.mlx_lm.enable`: one frozen value, replaced whole.

``enable()`` installs a new :class:`Settings` (the current one with the
options it was given), ``disable()`` installs the defaults, and every reader
goes through :func:`settings`. A ``BatchGenerator`` keeps the value in force
when it was built, so a later ``enable(...)`` does not change a running
batch.
"""

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class Settings:
    """How the caches mlxq quantizes for mlx-lm's ``kv_bits`` store rows, and
    how decode runs."""

    kv_hadamard: bool = False  # rows quantized in the Hadamard basis
    v_group_size: Optional[int] = None  # the values' own quantization; None: the keys'
    v_bits: Optional[int] = None
    kv_recent: int = 0  # recent tokens also kept exact
    compiled_decode: bool = False  # one-token steps through one mx.compile'd graph

    def cache_options(self) -> dict:
        """The quantized caches' keyword arguments these settings give."""
        return dict(hadamard=self.kv_hadamard, v_group_size=self.v_group_size, v_bits=self.v_bits)


DEFAULT = Settings()
_current = DEFAULT


def settings() -> Settings:
    """The settings in force."""
    return _current


def install(value: Settings) -> None:
    """Replace the settings in force (mlxq.mlx_lm.enable / disable)."""
    global _current
    if not isinstance(value, Settings):
        raise ValueError(f"[mlxq.mlx_lm.settings] expected a Settings, got {value!r}.")
    _current = value


__all__ = ["DEFAULT", "Settings", "install", "settings"]
