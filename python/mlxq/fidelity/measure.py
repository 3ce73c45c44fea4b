"""Teacher-forced comparison of KV settings against the unquantized model.

The text is fed in chunks (``chunk`` tokens, so that most attention reads
cached history, as a generation does) through one unquantized prompt cache
(mlx-lm's own) and one per setting, in lockstep: each chunk's reference
log-probabilities are computed once and compared at every position with
each setting's, so nothing of vocabulary size is kept between chunks.
"""

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from ..kv_spec import KVSpec

REFERENCE = "unquantized"


@dataclasses.dataclass
class Run:
    """One setting's prompt cache and per-position measurements."""

    cache: list
    nll: List[np.ndarray] = dataclasses.field(default_factory=list)
    kl: List[np.ndarray] = dataclasses.field(default_factory=list)
    flips: List[np.ndarray] = dataclasses.field(default_factory=list)

    def summary(self, reference: Optional["Run"]) -> dict:
        nll = np.concatenate(self.nll)
        out = {"perplexity": float(np.exp(nll.mean())), "quantized_caches": quantized(self.cache)}
        if reference is not None:
            kl = np.concatenate(self.kl)
            ref_ppl = float(np.exp(np.concatenate(reference.nll).mean()))
            out["perplexity_change"] = out["perplexity"] / ref_ppl - 1
            out["kl_mean"] = float(kl.mean())
            out["kl_p99"] = float(np.percentile(kl, 99))
            out["flip_rate"] = float(np.concatenate(self.flips).mean())
        return out


def quantized(cache) -> str:
    """How many of the prompt cache's attention caches are quantized: "k/n"."""
    flat = []
    for c in cache:
        flat.extend(getattr(c, "caches", None) or [c])
    attention = [c for c in flat if hasattr(c, "offset") and hasattr(c, "keys")]
    return f"{sum(hasattr(c, 'bits') for c in attention)}/{len(attention)}"


def bits_per_element(spec: Optional[KVSpec], tokens: int) -> float:
    """Stored bits per K/V element at ``tokens`` tokens, for 16-bit models:
    codes plus 16-bit scales and biases (K's and V's mean), plus the exact
    recent window's 16-bit copy spread over the text. 16 unquantized."""
    if spec is None:
        return 16.0
    f = spec.format
    k = f.bits + 32 / f.group_size
    v = f.v_bits + 32 / f.v_group_size
    return (k + v) / 2 + 16 * min(spec.recent, tokens) / tokens


def caches_for(
    model,
    spec: Optional[KVSpec],
    layers: Optional[Sequence[int]] = None,
    own: Optional[Dict[int, KVSpec]] = None,
) -> list:
    """mlx-lm's prompt cache for ``model``, with the caches at ``layers``
    (default: all) quantized by mlxq as ``spec`` says (``None``: none), or
    as ``own`` says for the cache indices it names."""
    from mlx_lm.models import cache as lm_cache

    from ..mlx_lm import families
    from ..mlx_lm.caches import quantize_caches
    from ..mlx_lm.settings import Settings

    cache = lm_cache.make_prompt_cache(model)
    if spec is None:
        return cache
    own = dict(own or {})
    families.check(model, spec.format.bits, "mlxq.fidelity")
    families.tag_roles(model, cache)
    for i in range(len(cache)) if layers is None else layers:
        s = own.get(i, spec)
        one = [cache[i]]
        quantize_caches(one, 0, s.format.group_size, s.format.bits, Settings.of_spec(s))
        cache[i] = one[0]
    return cache


def mixed_label(base: KVSpec, own: Dict[int, KVSpec]) -> str:
    """``"4 with 3 caches at 8"``: a base setting with per-cache ones."""
    kinds = sorted({s.label for s in own.values()})
    return f"{base.label} with {len(own)} caches at {'/'.join(kinds)}"


def _logprobs(model, x, cache) -> mx.array:
    logits = model(x[None], cache=cache)[0].astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def compare(
    model,
    ids: Sequence[int],
    runs: Dict[str, list],
    *,
    chunk: int = 64,
    progress=None,
) -> Dict[str, dict]:
    """Each prompt cache in ``runs`` (name -> cache; ``REFERENCE`` is the
    unquantized one) over ``ids``, teacher-forced in lockstep with the
    reference. Returns name -> summary: perplexity, and for every other run
    its change, the mean and 99th-percentile KL divergence of the next-token
    distribution from the reference's, the top-1 flip rate and KV bytes.
    ``progress(n)`` is called after each chunk's forward passes."""
    from .. import mlx_lm as mlxq_lm

    if len(ids) < 2 or chunk < 1:
        raise ValueError(
            f"[mlxq.fidelity] need at least 2 tokens and chunk >= 1, got {len(ids)} and {chunk}."
        )
    state = {name: Run(cache) for name, cache in runs.items()}
    ref = state[REFERENCE]
    x = mx.array(ids)
    with mlxq_lm.enabled():
        for s in range(0, len(ids) - 1, chunk):
            n = min(chunk, len(ids) - 1 - s)
            xs, target = x[s : s + n], x[s + 1 : s + 1 + n]
            ref_lp = _logprobs(model, xs, ref.cache)
            ref_top = mx.argmax(ref_lp, axis=-1)
            ref_p = mx.exp(ref_lp)
            ref.nll.append(-np.array(mx.take_along_axis(ref_lp, target[:, None], -1))[:, 0])
            for name, run in state.items():
                if run is ref:
                    continue
                lp = _logprobs(model, xs, run.cache)
                kl = mx.sum(ref_p * (ref_lp - lp), axis=-1)
                flips = mx.argmax(lp, axis=-1) != ref_top
                nll = -mx.take_along_axis(lp, target[:, None], -1)[:, 0]
                mx.eval(kl, flips, nll)
                run.nll.append(np.array(nll))
                run.kl.append(np.maximum(np.array(kl), 0.0))  # rounding below 0
                run.flips.append(np.array(flips))
            if progress is not None:
                progress(n)
    return {name: run.summary(None if run is ref else ref) for name, run in state.items()}


def measure(
    model,
    ids: Sequence[int],
    specs: Sequence[KVSpec],
    *,
    chunk: int = 64,
    per_layer: Optional[KVSpec] = None,
    layers: Optional[Sequence[int]] = None,
    mixed: Optional[Tuple[KVSpec, Dict[int, KVSpec]]] = None,
    progress=None,
) -> dict:
    """Every setting in ``specs`` against the unquantized model over ``ids``
    (see :func:`compare`), and with ``per_layer`` that setting applied to one
    cache at a time (the others unquantized): each layer's sensitivity, for
    the cache indices ``layers`` (default: every one). ``mixed``, a base
    setting and per-cache ones (what ``enable(kv_layers=...)`` applies),
    adds a row whose bits per element are the caches' mean."""
    runs = {REFERENCE: caches_for(model, None)}
    for spec in specs:
        runs[spec.label] = caches_for(model, spec)
    count = len(runs[REFERENCE])
    rows = [(s.label, bits_per_element(s, len(ids))) for s in specs]
    if mixed is not None:
        base, own = mixed
        for i in own:
            if not 0 <= i < count:
                raise ValueError(f"[mlxq.fidelity] kv_layers names cache {i}, not in [0, {count}).")
        label = mixed_label(base, own)
        runs[label] = caches_for(model, base, own=own)
        per_cache = [bits_per_element(own.get(i, base), len(ids)) for i in range(count)]
        rows.append((label, float(np.mean(per_cache))))
    if per_layer is None:
        layers = []
    elif layers is None:
        layers = list(range(count))
    for i in layers:
        if not 0 <= i < count:
            raise ValueError(f"[mlxq.fidelity] layer {i} is not a cache index in [0, {count}).")
        runs[f"layer {i}"] = caches_for(model, per_layer, [i])
    out = compare(model, ids, runs, chunk=chunk, progress=progress)
    result = {
        "settings": [dict(setting=REFERENCE, bits_per_element=16.0, **out[REFERENCE])]
        + [dict(setting=label, bits_per_element=bpe, **out[label]) for label, bpe in rows],
    }
    if per_layer is not None:
        result["per_layer"] = {
            "setting": per_layer.label,
            "layers": [dict(layer=i, **out[f"layer {i}"]) for i in layers],
        }
    return result
