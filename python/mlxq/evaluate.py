"""Teacher-forced evaluation of a language model over a token sequence."""

from typing import List, Tuple

import mlx.core as mx
import numpy as np


def teacher_forced(model, ids: List[int], caches, chunk: int = 64) -> Tuple[float, np.ndarray]:
    """Perplexity of ``ids`` and the model's argmax prediction at each position.

    The tokens are fed in chunks of ``chunk`` through ``caches`` (an mlx-lm
    prompt cache, quantized or not), so every chunk after the first attends to
    cached history, as a generation does. Returns ``(perplexity, argmax)``
    with ``argmax[i]`` the greedy prediction for ``ids[i + 1]``.
    """
    if len(ids) < 2 or chunk < 1:
        raise ValueError(
            f"[mlxq.teacher_forced] need >= 2 tokens and chunk >= 1, got {len(ids)}, {chunk}."
        )
    x = mx.array(ids)
    logp, top = [], []
    for s in range(0, len(ids) - 1, chunk):
        n = min(chunk, len(ids) - 1 - s)
        logits = model(x[None, s : s + n], cache=caches)[0].astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        target = x[s + 1 : s + 1 + n]
        logp.append(np.array(mx.take_along_axis(lp, target[:, None], axis=-1))[:, 0])
        top.append(np.array(mx.argmax(logits, axis=-1)))
    return float(np.exp(-np.concatenate(logp).mean())), np.concatenate(top)
