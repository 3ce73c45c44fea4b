"""KV settings named as text: ``4``, ``4g32``, ``8/4``, ``4+hadamard``,
``4+recent128``, ``8g64/4g32+hadamard+recent64``, ``recipe`` (mlxq-fidelity's
``--kv``, ``mlxq.mlx_lm.enable(kv_layers=...)``).

``K[gG][/V[gG]]`` gives the keys' bits and group size (group 64 when not
given) and, after ``/``, the values' own; ``+hadamard`` stores rows in the
Hadamard basis (mlxq.hadamard); ``+recentR`` keeps the last R tokens exact
(mlxq.cache.recent). ``recipe`` names what ``kv_bits=4`` gets under
``mlxq.mlx_lm.enable()`` with nothing else set: ``8/4+recent128``.
"""

import dataclasses
import re
from typing import Optional

from .kv_format import KVFormat

_SPEC = re.compile(
    r"^(?P<bits>\d+)(?:g(?P<group>\d+))?"
    r"(?:/(?P<v_bits>\d+)(?:g(?P<v_group>\d+))?)?"
    r"(?P<options>(?:\+(?:hadamard|recent\d+))*)$"
)
GRAMMAR = "K[gG][/V[gG]][+hadamard][+recentR] or recipe, e.g. 4, 4g32, 8/4, 4+hadamard, 4+recent128"

# The recipe: caches of at most RECIPE_BITS bits keep their last RECIPE_RECENT
# tokens exact, and caches of RECIPE_BITS bits store their keys at
# RECIPE_K_BITS (docs/results/accuracy.md: 4-bit values within 1% of
# unquantized perplexity on the packaged models, and long-context retrieval
# equal to bf16's, which 4-bit keys miss; K8/V4 has a fused kernel on every
# backend). mlxq.mlx_lm.settings applies it unless the user says otherwise.
RECIPE_BITS = 4
RECIPE_RECENT = 128
RECIPE_K_BITS = 8
RECIPE = "recipe"


@dataclasses.dataclass(frozen=True)
class KVSpec:
    """One KV setting: a quantized format and an exact recent window."""

    format: KVFormat
    recent: int = 0

    @property
    def label(self) -> str:
        f = self.format
        out = f"{f.bits}" + ("" if f.group_size == 64 else f"g{f.group_size}")
        if f.separate:
            out += f"/{f.v_bits}" + ("" if f.v_group_size == 64 else f"g{f.v_group_size}")
        if f.hadamard:
            out += "+hadamard"
        if self.recent:
            out += f"+recent{self.recent}"
        return out

    def cache_kwargs(self) -> dict:
        """The keywords of a cache's ``to_quantized``."""
        return dict(self.format.kwargs(), recent=self.recent)


def parse_spec(text: str) -> KVSpec:
    """A :class:`KVSpec` from its name (see the module docstring); ValueError
    naming the text and the grammar otherwise."""
    if text.strip() == RECIPE:
        text = f"{RECIPE_K_BITS}/{RECIPE_BITS}+recent{RECIPE_RECENT}"
    m = _SPEC.match(text.strip())
    if m is None:
        raise ValueError(f"[mlxq.kv_spec] KV setting {text!r} is not {GRAMMAR}.")
    options = [o for o in m["options"].split("+") if o]
    recent = [int(o[len("recent") :]) for o in options if o.startswith("recent")]
    if len(recent) > 1 or options.count("hadamard") > 1:
        raise ValueError(f"[mlxq.kv_spec] KV setting {text!r} repeats an option.")
    group = int(m["group"] or 64)
    v_bits: Optional[int] = int(m["v_bits"]) if m["v_bits"] else None
    v_group: Optional[int] = int(m["v_group"]) if m["v_group"] else (group if v_bits else None)
    fmt = KVFormat(group, int(m["bits"]), v_group, v_bits, "hadamard" in options)
    return KVSpec(fmt.checked("mlxq.kv_spec"), recent[0] if recent else 0)
