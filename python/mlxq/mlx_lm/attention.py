"""mlx-lm's attention functions, with quantized K/V on mlxq's fused kernel."""

from collections import Counter
from typing import Dict

import mlx.core as mx

from ..attention import is_quantized, quantized_sdpa, recent_split_sdpa
from ..kv_format import FormattedTriple
from ..split import is_split
from .caches import device_supported
from .originals import original

_counts: Counter = Counter()

# The fused kernel the attention dispatch calls (tests swap in a reference).
kernel = quantized_sdpa


# --------------------------------------------------------------- attention
def _mlxq_attention(queries, keys, values, scale, mask, sinks, group_size, bits):
    """mlxq's kernel, or None when it does not take these inputs."""
    if not (is_quantized(keys) and is_quantized(values)):
        return None
    # Only mlxq can attend K/V in a format of its own (mlx-lm would
    # silently read them wrong): those never fall back.
    only_mlxq = isinstance(keys, FormattedTriple) or isinstance(values, FormattedTriple)
    if mask is not None and not isinstance(mask, (str, mx.array)):
        return _declined(only_mlxq, f"a mask of type {type(mask).__name__}")
    if not device_supported():
        return _declined(only_mlxq, f"no mlxq kernels on {mx.default_device()}")
    try:
        out = kernel(
            queries,
            keys,
            values,
            scale=scale,
            mask=mask,
            sinks=sinks,
            group_size=group_size,
            bits=bits,
        )
    except ValueError as e:  # a shape, dtype, bits or mask outside mlxq's kernels
        return _declined(only_mlxq, str(e))
    _counts["mlxq"] += 1
    return out


def _declined(only_mlxq: bool, why: str):
    """None (mlx-lm's function takes the call), except for K/V that only
    mlxq can attend (in the Hadamard basis, or values quantized apart from
    the keys): mlx-lm would silently read them wrong."""
    if only_mlxq:
        raise ValueError(
            f"[mlxq.mlx_lm] K/V in the Hadamard basis (hadamard) and values quantized apart "
            f"from the keys (v_bits) need mlxq's kernel: {why}"
        )
    return None


def scaled_dot_product_attention(queries, keys, values, cache, scale: float, mask, sinks=None):
    """mlx-lm's attention dispatch, with quantized K/V on mlxq's fused kernel.

    Quantized ``(packed, scales, biases)`` keys and values go to
    :func:`mlxq.quantized_sdpa`, with or without ``sinks``, with the bits and
    group size of ``cache`` (or inferred from the shapes when there is no
    cache, as in Gemma's KV-shared layers). Anything else goes to mlx-lm's
    original function.
    """
    if is_split(keys):  # a recent-window cache's fetch: only mlxq can attend it
        _counts["mlxq"] += 1
        return recent_split_sdpa(
            queries,
            keys,
            values,
            scale=scale,
            mask=mask,
            sinks=sinks,
            group_size=getattr(cache, "group_size", None),
            bits=getattr(cache, "bits", None),
        )
    if is_quantized(keys):
        group_size = getattr(cache, "group_size", None) if hasattr(cache, "bits") else None
        bits = getattr(cache, "bits", None) if group_size is not None else None
        out = _mlxq_attention(queries, keys, values, scale, mask, sinks, group_size, bits)
        if out is not None:
            return out
    _counts["mlx_lm"] += 1
    if isinstance(keys, mx.array) and hasattr(cache, "bits"):
        # An MLA latent cache's prefill fetch (mlxq.cache.latent): the model
        # projected the dequantized latent into plain per-head K/V.
        cache = None
    return original("scaled_dot_product_attention")(
        queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks
    )


def quantized_scaled_dot_product_attention(
    queries, q_keys, q_values, scale: float, mask, group_size: int = 64, bits: int = 8
):
    """mlx-lm's quantized attention composition, replaced by mlxq's fused kernel."""
    out = _mlxq_attention(queries, q_keys, q_values, scale, mask, None, group_size, bits)
    if out is not None:
        return out
    _counts["mlx_lm"] += 1
    return original("quantized_scaled_dot_product_attention")(
        queries, q_keys, q_values, scale, mask, group_size=group_size, bits=bits
    )


def counters() -> Dict[str, int]:
    """Attention calls since the last :func:`reset_counters`: ``"mlxq"`` (fused
    kernel) and ``"mlx_lm"`` (handed to mlx-lm's original function)."""
    return dict(_counts)


def reset_counters() -> None:
    _counts.clear()
