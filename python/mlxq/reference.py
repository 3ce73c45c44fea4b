"""Plain-MLX-op compositions of mlxq's kernels: the oracle and the fallback.

These materialise the full ``[B, H_q, L, N]`` score matrix, exactly as mlx-lm's
``quantized_scaled_dot_product_attention`` does; use them to check the fused
kernels, not to run models.
"""

from typing import Optional, Sequence, Union

import mlx.core as mx


def _causal(L: int, N: int) -> mx.array:
    # Bottom-right aligned, as mx.fast.scaled_dot_product_attention.
    return mx.arange(N - L, N)[:, None] >= mx.arange(N)[None]


def quantized_sdpa(
    q: mx.array,
    keys: Sequence[mx.array],
    values: Sequence[mx.array],
    *,
    scale: float,
    mask: Union[None, str, mx.array] = None,
    sinks: Optional[mx.array] = None,
    group_size: int = 64,
    bits: int = 8,
) -> mx.array:
    """mlx-lm's quantized attention composition, plus attention sinks.

    Two ``mx.quantized_matmul`` calls around a precise softmax, with GQA done
    by a 5-D reshape, exactly as mlx-lm's
    ``quantized_scaled_dot_product_attention``. Bool masks fill hidden scores
    with the dtype's lowest finite value (so a query whose every key is masked
    averages all values, as in mlx-lm). ``sinks [H_q]`` add one logit per head
    to the softmax denominator.

    Args:
        q (array): Queries ``[B, H_q, L, D_k]``.
        keys (tuple(array, array, array)): Quantized keys ``[B, H_kv, N, D_k]``.
        values (tuple(array, array, array)): Quantized values ``[B, H_kv, N, D_v]``.
        scale (float): Scale applied to the queries.
        mask (str or array, optional): ``None``, ``"causal"`` or an array
          broadcastable to ``[B, H_q, L, N]``.
        sinks (array, optional): Attention-sink logits ``[H_q]``.
        group_size (int): Quantization group size. Default: ``64``.
        bits (int): Quantization bits. Default: ``8``.

    Returns:
        array: ``[B, H_q, L, D_v]``.
    """
    B, n_q_heads, L, _ = q.shape
    n_kv_heads, N = keys[0].shape[-3], keys[0].shape[-2]
    n_rep = n_q_heads // n_kv_heads

    queries = q * scale
    if n_rep > 1:
        queries = mx.reshape(queries, (B, n_kv_heads, n_rep, L, -1))
        keys = [mx.expand_dims(x, axis=-3) for x in keys]
        values = [mx.expand_dims(x, axis=-3) for x in values]

    scores = mx.quantized_matmul(queries, *keys, transpose=True, group_size=group_size, bits=bits)
    if mask is not None:
        if isinstance(mask, str):
            if mask != "causal":
                raise ValueError(f"mask must be None, 'causal' or an array, got {mask!r}")
            mask = _causal(L, N)
        mask = mx.broadcast_to(mask, (B, n_q_heads, L, N))
        if n_rep > 1:
            mask = mx.reshape(mask, (B, n_kv_heads, n_rep, L, N))
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    if sinks is not None:
        head_shape = (n_kv_heads, n_rep) if n_rep > 1 else (n_q_heads,)
        sink_col = mx.reshape(sinks.astype(scores.dtype), (1, *head_shape, 1, 1))
        sink_col = mx.broadcast_to(sink_col, scores.shape[:-1] + (1,))
        scores = mx.concatenate([sink_col, scores], axis=-1)
        scores = mx.softmax(scores, axis=-1, precise=True)[..., 1:]
    else:
        scores = mx.softmax(scores, axis=-1, precise=True)
    out = mx.quantized_matmul(scores, *values, transpose=False, group_size=group_size, bits=bits)
    if n_rep > 1:
        out = mx.reshape(out, (B, n_q_heads, L, -1))
    return out
