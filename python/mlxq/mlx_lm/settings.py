"""The options of :func:`mlxq.mlx_lm.enable`: one frozen value, replaced whole.

``enable()`` installs a new :class:`Settings` (the current one with the
options it was given), ``disable()`` installs the defaults, and every reader
goes through :func:`settings`. A ``BatchGenerator`` keeps the value in force
when it was built, so a later ``enable(...)`` does not change a running
batch.
"""

import dataclasses
import json
import os
from typing import Optional, Tuple

# The recipe (mlxq.kv_spec) applies unless kv_recent, k_bits or v_bits says otherwise.
from ..kv_spec import RECIPE_BITS, RECIPE_K_BITS, RECIPE_RECENT, KVSpec, parse_spec

# Tokens mlx-lm's make_prompt_cache keeps at the start of its max_kv_size rings.
MAX_KV_SIZE_KEEP = 4


@dataclasses.dataclass(frozen=True)
class Settings:
    """How the caches mlxq quantizes for mlx-lm's ``kv_bits`` store rows, and
    how decode runs."""

    kv_hadamard: bool = False  # rows quantized in the Hadamard basis
    v_group_size: Optional[int] = None  # the values' own quantization; None: the keys'
    v_bits: Optional[int] = None
    k_bits: Optional[int] = None  # the keys' own bits; None: the recipe's
    kv_recent: Optional[int] = None  # recent tokens also kept exact; None: the recipe
    compiled_decode: bool = False  # one-token steps through one mx.compile'd graph
    # (cache index, setting) of the caches quantized otherwise than kv_bits says
    kv_layers: Tuple[Tuple[int, KVSpec], ...] = ()

    def cache_options(self, group_size: int, bits: int, latent: bool = False) -> dict:
        """The keyword arguments of the quantized cache these settings give
        one quantized at ``group_size`` / ``bits`` (mlx-lm's ``kv_group_size``
        / ``kv_bits``): keys at ``k_bits`` where given, else the recipe's
        (RECIPE_K_BITS at RECIPE_BITS unless ``v_bits`` is given), else
        ``bits``; values at ``v_bits`` or ``bits``. An MLA latent cache
        quantizes its latent once, so the recipe's keys pass it by
        (``k_bits``, like ``v_bits``, reaches it and is refused)."""
        k_bits = self.k_bits
        if k_bits is None:
            recipe = not latent and self.v_bits is None and bits == RECIPE_BITS
            k_bits = RECIPE_K_BITS if recipe else bits
        v_bits = self.v_bits
        if v_bits is None and k_bits != bits:
            v_bits = bits
        return dict(
            group_size=group_size,
            bits=k_bits,
            hadamard=self.kv_hadamard,
            v_group_size=self.v_group_size,
            v_bits=v_bits,
        )

    def recent_for(self, bits: int) -> int:
        """The exact window a cache of ``bits`` keeps: ``kv_recent`` where
        given, else the recipe's (RECIPE_RECENT at RECIPE_BITS or fewer)."""
        if self.kv_recent is not None:
            return self.kv_recent
        return RECIPE_RECENT if bits <= RECIPE_BITS else 0

    def describe(
        self,
        bits: int,
        group_size: int,
        cli: bool = False,
        max_kv_size: Optional[int] = None,
    ) -> str:
        """The KV setting caches quantized at ``bits`` / ``group_size`` get,
        in words, naming the options that turn the recipe's parts off
        (``cli``: as mlxq-generate's and mlxq-server's flags, else as
        enable's keywords). ``max_kv_size``: the caches are mlx-lm's rings
        of that many tokens (keeping 4), which hold less of a window than
        asked."""

        def option(name: str, value: int) -> str:
            return f"--{name.replace('_', '-')} {value}" if cli else f"{name}={value}"

        o = self.cache_options(group_size, bits)
        k_bits, v_bits = o["bits"], o["v_bits"] or o["bits"]
        v_group = o["v_group_size"] or group_size
        out = f"{bits}-bit, group {group_size}"
        if (k_bits, group_size) != (v_bits, v_group):
            out = f"{k_bits}-bit K (group {group_size}), {v_bits}-bit V (group {v_group})"
            if self.k_bits is None and k_bits != bits:
                out += f" (the recipe's keys; {option('k_bits', bits)} turns them off)"
        if self.kv_hadamard:
            out += ", Hadamard basis"
        recent = self.recent_for(bits)
        if recent and max_kv_size is not None:
            from .caches import ring_window  # (caches imports this module)

            recent = ring_window(recent, max_kv_size, MAX_KV_SIZE_KEEP)
        if recent:
            out += f", the last {recent} tokens exact"
            if self.kv_recent is None:
                out += (
                    f" (the recipe for {RECIPE_BITS} bits or fewer; "
                    f"{option('kv_recent', 0)} turns it off)"
                )
        if self.kv_layers:
            out += f"; {len(self.kv_layers)} caches set apart by kv_layers"
        return out

    def for_cache(self, index: int, group_size: int, bits: int):
        """``(group_size, bits, settings)`` for the prompt cache's entry
        ``index``: its own ``kv_layers`` setting where it has one, else
        these."""
        spec = dict(self.kv_layers).get(index)
        if spec is None:
            return group_size, bits, self
        own = Settings.of_spec(spec, compiled_decode=self.compiled_decode)
        return spec.format.group_size, spec.format.bits, own

    @staticmethod
    def of_spec(spec: KVSpec, compiled_decode: bool = False) -> "Settings":
        """The settings a KV setting (``mlxq.kv_spec``) gives its caches
        (its bits and group size are the caller's ``kv_bits`` / group)."""
        f = spec.format
        return Settings(
            kv_hadamard=f.hadamard,
            v_group_size=f.v_group_size if f.separate else None,
            v_bits=f.v_bits if f.separate else None,
            k_bits=f.bits,  # a setting names its keys: no recipe
            kv_recent=spec.recent,
            compiled_decode=compiled_decode,
        )


def layers_from(value, where: str) -> Tuple[Tuple[int, KVSpec], ...]:
    """``kv_layers`` as Settings holds them, from a mapping of cache index to
    setting (a KV setting string such as ``"8"`` or ``"8/4+hadamard"``, bits
    as an int, or a KVSpec) or the path of a JSON file holding
    ``{"kv_layers": {index: setting}}``; ValueError naming the entry."""
    if isinstance(value, (str, os.PathLike)):
        try:
            with open(value, encoding="utf-8") as f:
                value = json.load(f)["kv_layers"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(
                f'[{where}] kv_layers file {str(value)!r} is not JSON with a "kv_layers" '
                f"mapping: {e}"
            ) from None
    if not isinstance(value, dict):
        raise ValueError(
            f"[{where}] kv_layers must map cache indices to KV settings (or name a JSON file), "
            f"got {type(value).__name__}."
        )
    out = {}
    for key, spec in value.items():
        try:
            index = int(key)
        except (TypeError, ValueError):
            index = -1
        if isinstance(key, bool) or index < 0:
            raise ValueError(f"[{where}] kv_layers key {key!r} is not a cache index (an int >= 0).")
        if isinstance(spec, bool) or not isinstance(spec, (int, str, KVSpec)):
            raise ValueError(
                f"[{where}] kv_layers[{key!r}] must be a KV setting such as '8' or '8/4', "
                f"got {spec!r}."
            )
        out[index] = spec if isinstance(spec, KVSpec) else parse_spec(str(spec))
    return tuple(sorted(out.items()))


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


__all__ = [
    "DEFAULT",
    "RECIPE_BITS",
    "RECIPE_K_BITS",
    "RECIPE_RECENT",
    "Settings",
    "install",
    "settings",
]
