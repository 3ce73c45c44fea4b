"""Per-model cache roles: which of an mlx-lm model's caches ``kv_bits`` quantizes.

Most models' attention caches are quantized as they come. Some models use a
cache in a way a quantized cache cannot serve, so each family below says,
per cache, what ``kv_bits`` does under :func:`mlxq.mlx_lm.enable`:

* ``quantize`` (the default): into mlxq's quantized caches;
* ``exact``: left as it is, unquantized (an indexer whose keys the model
  reads itself; afm7's last layer, whose keys the KV-reuse layers read);
* ``latent``: an MLA latent cache (``update_and_fetch(kv_latent, k_pe)``):
  quantized with ``latent=True`` (the latent rows quantized, the RoPE keys
  exact);
* refused: the model computes attention itself in a way mlxq's kernel does
  not, so ``kv_bits`` raises a ``ValueError`` before any work.

A family is the mlx-lm module that defines the model's decoder layers
(``type(model.layers[i]).__module__``), which names the attention code
itself also in wrapper models (kimi_vl and kimi_k25 run deepseek_v3's
layers, glm_moe_dsa deepseek_v32's, mistral3 those of its text model).
Roles are written onto the cache objects (``_mlxq_role``) by
:func:`tag_roles`, which the cache-making paths call; ``quantize_caches``
reads them.
"""

import dataclasses
import inspect
from typing import Optional, Tuple

QUANTIZE, EXACT, LATENT = "quantize", "exact", "latent"
ROLE = "_mlxq_role"  # the attribute tag_roles sets on each cache


@dataclasses.dataclass(frozen=True)
class Family:
    """What ``kv_bits`` does with one family's caches."""

    layer: str = QUANTIZE  # each top-level attention cache
    members: Tuple[str, ...] = ()  # a CacheList's members, by position (others: QUANTIZE)
    last: Optional[str] = None  # the last top-level cache, when it differs
    refused: Optional[str] = None  # why kv_bits cannot be served

    def roles(self) -> Tuple[str, ...]:
        """Every role the family gives a cache."""
        return (self.layer, *self.members) + ((self.last,) if self.last else ())


_LATENT = Family(layer=LATENT)

FAMILIES = {
    # MLA: the cache holds the compressed latent and the RoPE keys k_pe.
    "deepseek_v3": _LATENT,
    "glm4_moe_lite": _LATENT,
    "kimi_k3": _LATENT,
    "kimi_linear": _LATENT,
    "mistral4": _LATENT,
    "bailing_hybrid": _LATENT,
    "bailing_moe_v3": _LATENT,
    "longcat_flash": Family(members=(LATENT, LATENT)),  # two MLA sublayers per layer
    # DeepSeek sparse attention: MLA, and the indexer's keys, which it scores itself.
    "deepseek_v32": Family(members=(LATENT, EXACT)),
    # Attention, and the sparse layers' block indexer, whose keys it scores itself.
    "minimax_m3_vl": Family(members=(QUANTIZE, EXACT)),
    # The KV-reuse layers attend the last layer's keys and values themselves.
    "afm7": Family(last=EXACT),
    # Attention computed by the model itself.
    "gemma2": Family(
        refused="computes softcapped attention itself (attn_logit_softcapping); "
        "mlxq's kernel has no softcap"
    ),
    "stablelm": Family(
        refused="casts its cached keys to float32 itself before attention, which a "
        "quantized (packed, scales, biases) fetch cannot take"
    ),
    "phixtral": Family(
        refused="casts the attention output to its cached values' dtype itself, which "
        "a quantized (packed, scales, biases) fetch does not have"
    ),
    "plamo": Family(
        refused="repeats its cached keys and values with mx.tile itself, which a "
        "quantized (packed, scales, biases) fetch cannot take"
    ),
    "plamo2": Family(
        refused="calls mx.fast.scaled_dot_product_attention itself, which takes no "
        "quantized keys and values"
    ),
    "phi3small": Family(
        refused="computes its block-sparse attention layers itself (queries @ keys), "
        "which a quantized (packed, scales, biases) fetch cannot take"
    ),
}


def _short(module: str) -> str:
    return module.rsplit(".", 1)[-1]


def family_name(model) -> Optional[str]:
    """The family of ``model`` in :data:`FAMILIES`, or None (every cache quantized)."""
    names = []
    try:
        layers = model.layers
    except (AttributeError, TypeError):  # no layers: the model class names it
        layers = ()
    for layer in layers if isinstance(layers, (list, tuple)) else ():
        name = _short(type(layer).__module__)
        if name not in names:
            names.append(name)
    names.append(_short(type(model).__module__))
    return next((n for n in names if n in FAMILIES), None)


def family(model) -> Family:
    name = family_name(model)
    return FAMILIES[name] if name is not None else Family()


def label_of(model, name: str) -> str:
    """The model type, and the family whose layers it runs where they differ."""
    model_type = getattr(model, "model_type", None)
    if isinstance(model_type, str) and model_type and model_type != name:
        return f"{model_type} ({name}'s layers)"
    return name


def latent_supported() -> bool:
    """Whether mlxq's caches take ``latent=True`` (MLA latent caches)."""
    from ..cache import KVCache

    return "latent" in inspect.signature(KVCache.to_quantized).parameters


def check(model, kv_bits, where: str) -> None:
    """ValueError, before any work, if ``kv_bits`` cannot be served for ``model``."""
    if kv_bits is None:
        return
    name = family_name(model)
    if name is None:
        return
    fam = FAMILIES[name]
    label = label_of(model, name)
    if fam.refused is not None:
        raise ValueError(f"[{where}] {label} {fam.refused}: run it without kv_bits.")
    if LATENT in fam.roles() and not latent_supported():
        raise ValueError(
            f"[{where}] {label} keeps an MLA latent cache (the latent and the RoPE keys), "
            "and this mlxq has no latent quantized cache: run it without kv_bits."
        )


def _is_list(cache) -> bool:
    return isinstance(getattr(cache, "caches", None), (list, tuple))


def tag_roles(model, prompt_cache) -> None:
    """Write each cache's role (``_mlxq_role``) onto the caches of ``model``'s
    ``prompt_cache``: CacheList members by position, top-level caches by
    the family's ``layer`` / ``last`` roles. State caches take a role too
    (unused: only attention caches are quantized)."""
    fam = family(model)
    n = len(prompt_cache)
    for i, c in enumerate(prompt_cache):
        if c is None:
            continue
        if _is_list(c):
            for j, m in enumerate(c.caches):
                role = fam.members[j] if j < len(fam.members) else QUANTIZE
                _set_role(m, role)
        else:
            role = fam.last if (i == n - 1 and fam.last is not None) else fam.layer
            _set_role(c, role)


def _set_role(cache, role: str) -> None:
    try:
        setattr(cache, ROLE, role)
    except AttributeError:  # a cache class with __slots__: the default role
        pass


def role_of(cache) -> str:
    return getattr(cache, ROLE, QUANTIZE)


__all__ = [
    "EXACT",
    "FAMILIES",
    "Family",
    "LATENT",
    "QUANTIZE",
    "ROLE",
    "check",
    "family",
    "family_name",
    "latent_supported",
    "role_of",
    "tag_roles",
]
