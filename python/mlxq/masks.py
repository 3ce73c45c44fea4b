"""Attention masks: causal (with offset and sliding window) and bidirectional spans.

Every mask here is a bool array, ``True`` where a query may attend to a key,
laid out ``[queries, keys]`` with the queries being the *last* ``N`` positions
of the keys (bottom-right aligned, as :func:`mx.fast.scaled_dot_product_attention`
aligns ``"causal"``). The values are exactly those of mlx-lm's
``create_causal_mask`` and ``create_attention_mask``, so caches built on them
give masks bit-identical to mlx-lm's.
"""

import numbers
from typing import Optional, Sequence, Tuple, Union

import mlx.core as mx

Mask = Union[None, str, mx.array]


def _check_int(name: str, value, minimum: int, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"[mlxq.{where}] {name} must be an int, got {type(value).__name__}.")
    if value < minimum:
        raise ValueError(f"[mlxq.{where}] {name} must be >= {minimum}, got {value}.")
    return int(value)


def create_causal_mask(N: int, offset: int = 0, window_size: Optional[int] = None) -> mx.array:
    """Causal mask of ``N`` new queries over ``offset + N`` keys.

    Query ``i`` sits at position ``offset + i`` and sees key ``j`` when
    ``j <= offset + i``, and, with a sliding window, also
    ``offset + i - j < window_size``.

    Args:
        N (int): Number of queries (new tokens), ``>= 0``.
        offset (int): Number of keys before the first query. Default: ``0``.
        window_size (int, optional): Sliding-window length, ``>= 1``.

    Returns:
        array: bool ``[N, offset + N]``.
    """
    N = _check_int("N", N, 0, "create_causal_mask")
    offset = _check_int("offset", offset, 0, "create_causal_mask")
    if window_size is not None:
        window_size = _check_int("window_size", window_size, 1, "create_causal_mask")
    key_pos = mx.arange(offset + N)[None]
    query_pos = mx.arange(offset, offset + N)[:, None]
    mask = query_pos >= key_pos
    if window_size is not None:
        mask = mask & (query_pos < key_pos + window_size)
    return mask


def left_padded(mask: mx.array, left_padding: mx.array) -> mx.array:
    """``mask`` ``[N, S]`` for each sequence of a left-padded batch:
    ``[B, 1, N, S]``, with key columns before ``left_padding[b]`` hidden
    (mlx-lm's ``create_causal_mask(..., left_padding=)``)."""
    columns = mx.arange(mask.shape[-1])
    return mask[None, None] & (columns >= left_padding[:, None, None, None])


def create_attention_mask(
    N: int, offset: int, return_array: bool = False, window_size: Optional[int] = None
) -> Mask:
    """The mask a non-rotating cache hands its attention for an ``N``-token step.

    ``None`` for one token without a window (it sees everything), ``"causal"``
    when the fused kernels' built-in causal mode is enough, otherwise an array
    from :func:`create_causal_mask` (always one when ``window_size`` is given
    or ``return_array`` is set). This is mlx-lm's rule for its ``KVCache``.
    """
    if window_size is not None or (N > 1 and return_array):
        return create_causal_mask(N, offset, window_size=window_size)
    return None if N == 1 else "causal"


Span = Tuple[int, int]


def _span_membership(spans: Sequence[Span], total: int) -> mx.array:
    """Span id + 1 of each position (0 outside every span), as int32 [total]."""
    ids = [0] * total
    for k, span in enumerate(spans, start=1):
        if len(span) != 2:
            raise ValueError(
                f"[mlxq.bidirectional_mask] a span must be (start, end), got {span!r}."
            )
        start, end = int(span[0]), int(span[1])
        if not 0 <= start < end <= total:
            raise ValueError(
                f"[mlxq.bidirectional_mask] span {span!r} is not within [0, {total}) "
                "or is empty (start must be < end)."
            )
        for p in range(start, end):
            if ids[p]:
                raise ValueError(f"[mlxq.bidirectional_mask] span {span!r} overlaps another span.")
            ids[p] = k
    return mx.array(ids, dtype=mx.int32)


def bidirectional_mask(
    L: int,
    window_size: Optional[int],
    bidirectional: Union[mx.array, Sequence[bool], Sequence[Span]],
    *,
    offset: int = 0,
) -> mx.array:
    """Causal mask OR'd with bidirectional attention among image tokens.

    Text attends causally (with the optional sliding window); image tokens
    additionally attend to each other in both directions, as vision-language
    models such as Gemma 3 prefill their image embeddings.

    Args:
        L (int): Number of queries (new tokens).
        window_size (int, optional): Sliding window of the causal part.
        bidirectional: Which tokens attend to each other, over all
          ``offset + L`` key positions, either

          * a bool vector ``[offset + L]`` (array or list): every marked
            token sees every other marked token (the seed's ``bidirMask``);
          * a list of ``(start, end)`` spans (end exclusive): tokens see the
            others of *their own* span only (one span per image).
        offset (int): Keys before the first query (chunked prefill). Default: ``0``.

    Returns:
        array: bool ``[L, offset + L]``.
    """
    L = _check_int("L", L, 1, "bidirectional_mask")
    offset = _check_int("offset", offset, 0, "bidirectional_mask")
    total = offset + L
    causal = create_causal_mask(L, offset, window_size)
    spans = not isinstance(bidirectional, mx.array) and (
        len(bidirectional) == 0 or isinstance(bidirectional[0], (tuple, list))
    )
    if spans:
        ids = _span_membership(bidirectional, total)
        together = (ids[offset:, None] == ids[None, :]) & (ids[None, :] > 0)
    else:
        marked = mx.array(bidirectional)
        if marked.dtype != mx.bool_ or marked.ndim != 1 or marked.shape[0] != total:
            raise ValueError(
                "[mlxq.bidirectional_mask] a bool vector must be 1-D of length "
                f"offset + L = {total}, got shape {tuple(marked.shape)} and dtype {marked.dtype}."
            )
        together = marked[offset:, None] & marked[None, :]
    return causal | together
