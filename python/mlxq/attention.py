"""Attention entry points: plain K/V go to MLX, quantized triples to mlxq."""

from typing import Optional, Sequence, Tuple, Union

import mlx.core as mx

from . import _ext, routing
from .guard import entries
from .hadamard import check_head_dim, transform
from .kv_format import FormattedTriple, is_hadamard
from .split import is_split

QuantizedTensor = Tuple[mx.array, mx.array, mx.array]
Mask = Union[None, str, mx.array]


def is_quantized(x) -> bool:
    """True for a ``(packed, scales, biases)`` triple as ``mx.quantize`` returns."""
    return isinstance(x, (tuple, list)) and len(x) == 3


def _split_mask(mask: Mask):
    if mask is None:
        return "", None
    if isinstance(mask, str):
        return mask, None
    if isinstance(mask, mx.array):
        return "", mask
    raise ValueError(
        f'[mlxq.sdpa] mask must be None, "causal" or an mx.array, got {type(mask).__name__}.'
    )


def quantized_sdpa(
    q: mx.array,
    keys: Sequence[mx.array],
    values: Sequence[mx.array],
    *,
    scale: float,
    mask: Mask = None,
    sinks: Optional[mx.array] = None,
    group_size: Optional[int] = None,
    bits: Optional[int] = None,
    v_group_size: Optional[int] = None,
    v_bits: Optional[int] = None,
    stream: Union[None, mx.Stream, mx.Device] = None,
    return_lse: bool = False,
) -> Union[mx.array, Tuple[mx.array, mx.array]]:
    """Fused scaled dot-product attention over affine-quantized keys and values.

    Computes ``softmax(scale * q @ dequantize(K).T + mask) @ dequantize(V)``
    without dequantizing ``K`` or ``V`` to memory: each key and value row is
    unpacked once, in registers, for all the query heads that share it.

    Args:
        q (array): Queries ``[B, H_q, L, D_k]`` in float32, float16 or bfloat16.
        keys (tuple(array, array, array)): ``(packed, scales, biases)`` of keys
          ``[B, H_kv, N, D_k]`` as returned by :func:`mx.quantize`. May be a
          strided view, such as ``buffer[..., :offset, :]`` of a cache; it is
          read in place.
        values (tuple(array, array, array)): The same for values
          ``[B, H_kv, N, D_v]``. Either may be a
          :class:`~mlxq.kv_format.FormattedTriple`, which carries its
          format: its ``group_size`` / ``bits`` are used where not given (a
          cache with separate K/V quantization), and rows in the Hadamard
          basis (a ``hadamard`` cache's) are attended as the rows they
          encode: the queries, or the output, are rotated to match.
        scale (float): Scale applied to ``q @ K.T``.
        mask (str or array, optional): ``None``, ``"causal"`` (bottom-right
          aligned, as :func:`mx.fast.scaled_dot_product_attention`), or an
          array broadcastable to ``[B, H_q, L, N]``: bool (``True`` attends) or
          additive. Default: ``None``.
        sinks (array, optional): Per-head logits ``[H_q]`` added to the softmax
          denominator (attention sinks). Default: ``None``.
        group_size (int, optional): Quantization group size of the keys (32,
          64 or 128). Inferred from the shapes when omitted.
        bits (int, optional): Bits per element of the keys (2, 3, 4, 5, 6 or
          8). Inferred from the shapes when omitted.
        v_group_size (int, optional): Group size of the values. Default:
          the keys' group size.
        v_bits (int, optional): Bits per element of the values, when they
          differ from the keys' (e.g. 8-bit keys with 4-bit values). Default:
          the keys' bits (the value head dim is inferred from it).
        stream (Stream, optional): Stream or device to run on.
        return_lse (bool, optional): Also return each row's log-sum-exp
          ``[B, H_q, L]`` (float32, natural log of the softmax denominator,
          sinks included; ``-inf`` for a row that sees nothing), so attention
          over these keys merges exactly with attention over other keys
          (:func:`merge_attention`). Every backend (Metal's through its
          merge kernel, checked on an emulator only). Default: ``False``.

    Returns:
        array: ``[B, H_q, L, D_v]`` in the dtype of ``q``. A query that sees no
        key at all (every key masked) gets zeros. With ``return_lse``, the
        pair ``(output, lse)``.

    Raises:
        ValueError: If a shape, dtype, bits/group size or mask is unsupported
          or inconsistent; the message names the offending input.
    """
    return _fused(
        q,
        keys,
        values,
        scale=scale,
        mask=mask,
        sinks=sinks,
        group_size=group_size,
        bits=bits,
        v_group_size=v_group_size,
        v_bits=v_bits,
        stream=stream,
        return_lse=return_lse,
    )


def _fused(
    q,
    keys,
    values,
    *,
    scale,
    mask,
    sinks,
    group_size,
    bits,
    v_group_size,
    v_bits,
    stream,
    return_lse=False,
    recent=None,
    rows=None,
):
    """:func:`quantized_sdpa`'s call of the op; ``recent``, a triple
    ``(keys, values, causal)`` of an exact window in the queries' basis,
    adds the window's rows (not with rows in the Hadamard basis); ``rows``:
    attend only the first ``rows`` of whole buffers (RecentSplit.rows)."""
    if not (is_quantized(keys) and is_quantized(values)):
        raise ValueError(
            "[mlxq.quantized_sdpa] keys and values must each be a "
            "(packed, scales, biases) triple as mx.quantize returns."
        )
    if isinstance(stream, mx.DeviceType):  # mx.cpu / mx.gpu, as MLX's ops take them
        stream = mx.Device(stream)
    # Fetches that carry their format (a cache's separate V widths).
    group_size, bits, v_group_size, v_bits = _carried_widths(
        keys, values, (group_size, bits, v_group_size, v_bits)
    )
    if recent is not None and (is_hadamard(keys) or is_hadamard(values)):
        raise ValueError(
            "[mlxq.quantized_sdpa] an exact window beside rows in the Hadamard basis is "
            "attended apart (mlxq.attention.recent_split_sdpa)."
        )
    if is_hadamard(keys) and isinstance(q, mx.array):
        # Keys stored in the Hadamard basis (mlxq.hadamard): scores need H q.
        check_head_dim(q.shape[-1], "mlxq.quantized_sdpa")
        q = transform(q, stream=stream)
    mask_mode, mask_arr = _split_mask(mask)
    recent_keys, recent_values, recent_causal = (
        recent if recent is not None else (None, None, False)
    )
    # On a GPU, prefill-sized calls may run as MLX's fused attention over a
    # dequantized copy of this layer (mlxq.routing); the op decides.
    out = _ext.quantized_sdpa(
        q,
        *keys,
        *values,
        scale=scale,
        mask_mode=mask_mode,
        mask=mask_arr,
        sinks=sinks,
        group_size=group_size,
        bits=bits,
        v_group_size=v_group_size,
        v_bits=v_bits,
        return_lse=return_lse,
        recent_keys=recent_keys,
        recent_values=recent_values,
        recent_causal=recent_causal,
        rows=rows,
        stream=stream,
    )
    lse = None
    if return_lse:
        out, lse = out
    if is_hadamard(values):
        # Values in the Hadamard basis: the output comes back as
        # H^T (P H V) = P V (H is its own inverse).
        check_head_dim(out.shape[-1], "mlxq.quantized_sdpa")
        out = transform(out, stream=stream)
    return (out, lse) if return_lse else out


# Blocks of dense_attention_with_lse: its f32 scores are [B, H_q, rows, N].
# A block takes as many query rows as fit in DENSE_SCORE_BYTES, and at least
# DENSE_ROW_BLOCK (256 rows over 4k keys and 32 heads fill it): a prefill
# chunk over a short window is one block, a dozen MLX ops, not one per 256
# rows (on a GPU each op is host time).
DENSE_SCORE_BYTES = 128 << 20
DENSE_ROW_BLOCK = 256
# A joined pass (_joined_attention) is MLX's attention over every row, whose
# unfused path holds the step's [B, H_q, L, N] scores in the queries' dtype.
JOINED_SCORE_BYTES = 128 << 20


def _dense_rows(B: int, Hq: int, N: int) -> int:
    """Query rows per block of :func:`dense_attention_with_lse`."""
    return max(DENSE_ROW_BLOCK, DENSE_SCORE_BYTES // max(1, 4 * B * Hq * N))


def _weights(s: mx.array, lse: mx.array) -> mx.array:
    """Each row's ``exp(s - lse)``; a row that saw no key (``lse = -inf``)
    gets zeros."""
    safe = mx.where(mx.isinf(lse), 0.0, lse)[..., None]
    return mx.exp(s - safe)


# One kernel on a GPU rather than a subtraction and an exponential, each a
# launch writing a tensor of the block's scores' size.
_fused_weights = mx.compile(_weights)


def dense_attention_with_lse(
    q: mx.array,
    keys: mx.array,
    values: mx.array,
    *,
    scale: float,
    mask: Mask = None,
    sinks: Optional[mx.array] = None,
    stream: Union[None, mx.Stream, mx.Device] = None,
) -> Tuple[mx.array, mx.array]:
    """Attention over plain keys/values ``[B, H_kv, N, D]`` with each row's
    log-sum-exp, in float32 MLX ops (for the few exact keys that
    :func:`merge_attention` combines with a quantized segment).

    ``mask`` is ``None``, ``"causal"`` (bottom-right aligned) or an array
    broadcastable to ``[B, H_q, L, N]`` (bool or additive). Query rows go in
    blocks whose scores fit ``DENSE_SCORE_BYTES`` (at least
    ``DENSE_ROW_BLOCK`` rows), so they stay bounded. Returns
    ``(output in q's dtype, lse float32 [B, H_q, L])``.
    """
    B, Hq, L, D = q.shape
    Hkv, N = keys.shape[1], keys.shape[2]
    rep = Hq // Hkv
    k = keys.astype(mx.float32, stream=stream)[:, :, None]  # [B, Hkv, 1, N, D]
    v = values.astype(mx.float32, stream=stream)[:, :, None]
    outs, lses = [], []
    block = _dense_rows(B, Hq, N)
    weights = _fused_weights if _device_of(stream).type == mx.gpu else _weights
    for r0 in range(0, L, block):
        r1 = min(L, r0 + block)
        qb = q[:, :, r0:r1].astype(mx.float32, stream=stream).reshape(B, Hkv, rep, r1 - r0, D)
        s = (qb * scale) @ mx.swapaxes(k, -1, -2)  # [B, Hkv, rep, rows, N]
        s = s.reshape(B, Hq, r1 - r0, N)
        if isinstance(mask, str):
            if mask != "causal":
                raise ValueError(f'[mlxq.dense_attention_with_lse] mask "{mask}" is not "causal".')
            rows = mx.arange(r0, r1)[:, None] + (N - L)
            s = mx.where(mx.arange(N)[None, :] <= rows, s, -mx.inf)
        elif mask is not None:
            m = mx.broadcast_to(mask, (B, Hq, L, N))[:, :, r0:r1]
            s = mx.where(m, s, -mx.inf) if m.dtype == mx.bool_ else s + m.astype(mx.float32)
        if sinks is not None:
            sk = mx.broadcast_to(sinks.astype(mx.float32)[None, :, None, None], (B, Hq, r1 - r0, 1))
            lse = mx.logsumexp(mx.concatenate([s, sk], axis=-1), axis=-1)
        else:
            lse = mx.logsumexp(s, axis=-1)
        p = weights(s, lse).reshape(B, Hkv, rep, r1 - r0, N)
        outs.append((p @ v).reshape(B, Hq, r1 - r0, -1))
        lses.append(lse)
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)
    lse = lses[0] if len(lses) == 1 else mx.concatenate(lses, axis=2)
    return out.astype(q.dtype), lse


def merge_attention(
    out_a: mx.array, lse_a: mx.array, out_b: mx.array, lse_b: mx.array
) -> Tuple[mx.array, mx.array]:
    """Attention over the union of two disjoint key sets from each set's
    output ``[..., L, D]`` and log-sum-exp ``[..., L]``: each output weighs
    ``exp(lse_i - lse)`` with ``lse = logaddexp(lse_a, lse_b)``. A side that
    saw no key (``lse = -inf``) weighs 0. Returns ``(output, lse)``, the
    output in ``out_a``'s dtype."""
    lse = mx.logaddexp(lse_a, lse_b)
    # Rows that see nothing on either side: lse = -inf, both weights 0.
    safe = mx.where(mx.isinf(lse), 0.0, lse)
    wa = mx.exp(lse_a - safe)[..., None]
    wb = mx.exp(lse_b - safe)[..., None]
    out = wa * out_a.astype(mx.float32) + wb * out_b.astype(mx.float32)
    return out.astype(out_a.dtype), lse


def _device_of(stream) -> mx.Device:
    """The device a ``stream`` argument names (a stream, a device, a device
    type such as ``mx.cpu``, or None: the default)."""
    if stream is None:
        return mx.default_device()
    if isinstance(stream, mx.Stream):
        return stream.device
    return mx.Device(stream) if isinstance(stream, mx.DeviceType) else stream


def recent_attention(
    q: mx.array,
    keys: mx.array,
    values: mx.array,
    out_q: mx.array,
    lse_q: mx.array,
    *,
    scale: float,
    causal: bool = False,
    mask: Optional[mx.array] = None,
    stream: Union[None, mx.Stream, mx.Device] = None,
) -> mx.array:
    """Attention over plain ``keys``/``values`` ``[B, H_kv, T, D]``, merged
    with attention over other keys given as its output ``out_q`` ``[B, H_q,
    L, D_v]`` and log-sum-exp ``lse_q`` (float32 ``[B, H_q, L]``, ``-inf``
    for rows that saw none): what :func:`merge_attention` of
    :func:`dense_attention_with_lse` computes, in one primitive (a recent
    window's step; CPU and CUDA, head dims up to 512). Every query row sees
    every key, or with ``causal`` (``T >= L``, the queries being the last
    ``L`` of the ``T`` positions) query ``l`` sees keys ``j <= l + T - L``,
    or (the CPU only) a ``mask`` array broadcastable to ``[B, H_q, L, T]``
    says which (bool, or additive). A row that saw no key in either part
    gets zeros."""
    return _ext.recent_attention(
        q, keys, values, out_q, lse_q, scale=scale, causal=causal, mask=mask, stream=stream
    )


def _part_masks(keys, mask, L: int):
    """The masks of a recent-window step's quantized and exact parts."""
    n = keys.quantized_length
    mask_q, mask_e = None, mask
    if isinstance(mask, mx.array):
        if mask.shape[-1] != keys.mask_columns:
            raise ValueError(
                f"[mlxq.sdpa] mask covers {mask.shape[-1]} keys, the fetch holds "
                f"{keys.mask_columns}."
            )
        mask_q = mask[..., :n]
        if keys.columns is None:
            mask_e = mask[..., n:]
        else:
            mask_e = mx.take(mask, mx.array(keys.exact_columns, dtype=mx.int32), axis=-1)
    elif mask is not None and mask != "causal":
        raise ValueError(f'[mlxq.sdpa] mask must be None, "causal" or an mx.array, got {mask!r}.')
    elif keys.columns is not None:
        # Rows in ring order: only a one-token step, which sees all of them.
        if L != 1:
            raise ValueError(
                f"[mlxq.sdpa] a recent-window fetch in ring order serves one query, got {L}."
            )
        mask_e = None
    if keys.visible is not None:
        visible = keys.visible
        if mask_q is None:
            mask_q = visible
        elif mask_q.dtype == mx.bool_:
            mask_q = mx.logical_and(mask_q, visible)
        else:
            mask_q = mx.where(visible, mask_q, -mx.inf)
    return mask_q, mask_e


def _exact_only(q, keys, values, scale: float, mask, sinks, stream) -> mx.array:
    """A recent-window step with no quantized row yet (a first prefill
    chunk) that mlxq's window kernel does not take (a GPU's prefill chunk,
    Metal, head dims over 512): attention over the exact rows alone.
    ``mx.fast`` where it takes the sinks and the mask (None, an array, or
    causal with every row seeing a key); else float32 MLX ops in blocks.
    A sliding-window layer's first chunk brings an array, and float32
    blocks hold several tensors of its scores' size at once where
    ``mx.fast`` holds at most one in the queries' dtype."""
    L, T = q.shape[2], keys.shape[2]
    # (a causal mask with more queries than keys leaves rows seeing none,
    # which mx.fast does not zero)
    fast_takes_mask = not isinstance(mask, str) or L <= T
    if fast_takes_mask and (sinks is None or sinks.dtype == q.dtype):
        return _fast_attention(q, keys, values, scale=scale, mask=mask, sinks=sinks, stream=stream)
    out, _ = dense_attention_with_lse(
        q, keys, values, scale=scale, mask=mask, sinks=sinks, stream=stream
    )
    return out


def _rows_in_order(keys) -> bool:
    """Whether a RecentSplit's rows are ``[quantized, exact]`` in key order:
    quantized rows held, no ring layout and no rows hidden by a mask."""
    return keys.visible is None and keys.columns is None and keys.quantized_length > 0


def _one_pass_prefill(q, keys, values, mask: Mask, sinks, stream) -> bool:
    """Whether a recent-window step runs as one ``mx.fast`` attention over
    the dequantized rows followed by the window's: on a GPU, where the op
    routes a prefill of that size through ``mx.fast`` (mlxq.routing), rows
    in order (no ring layout, no hidden rows). Two parts merged by
    log-sum-exp would attend the step's own rows densely in float32 MLX ops,
    ``O(L^2)`` of them."""
    if not _rows_in_order(keys):
        return False
    device = _device_of(stream).type
    if device != mx.gpu:
        return False
    L, N = q.shape[2], keys.quantized_length + keys.exact.shape[2]
    mask_kind = "none" if mask is None else "causal" if isinstance(mask, str) else "array"
    return routing.route_through_mx_fast(
        routing.gpu_backend(),
        L=L,
        N=N,
        Hq=q.shape[1],
        Hkv=keys.exact.shape[1],
        Dk=q.shape[3],
        Dv=values.exact.shape[3],
        dtype=q.dtype,
        scales_dtype=keys.quantized[1].dtype,
        mask_kind=mask_kind,
        sinks_dtype=None if sinks is None else sinks.dtype,
    )


def _dense_format(part) -> Tuple[int, int]:
    """``(group_size, bits)`` of a RecentSplit's quantized rows, as the
    shapes give them (the exact rows have the head dim)."""
    packed, scales = part.quantized[0], part.quantized[1]
    D = part.exact.shape[3]
    return D // scales.shape[3], packed.shape[3] * 32 // D


def _dequantized_rows(part, dtype, stream) -> mx.array:
    """A RecentSplit's quantized rows, dequantized into the exact rows' basis."""
    triple = part.quantized_rows
    group_size, bits = _dense_format(part)
    rows = mx.dequantize(*triple, group_size=group_size, bits=bits, stream=stream)
    rows = rows.astype(dtype, stream=stream)
    if is_hadamard(triple):
        rows = transform(rows, stream=stream)  # H is its own inverse
    return rows


def _dequantized_one_pass(
    q, keys, values, *, scale, mask: Mask, sinks, stream, formats
) -> mx.array:
    """A recent-window step as one attention over ``[dequantized rows, window
    rows]`` (see :func:`_one_pass_prefill`): the mask's columns are in that
    order already, and a causal mask hides no quantized row. The op does
    it, dequantizing the buffers into the stream's workspace and writing
    the exact rows over the window's (csrc/prefill_route.h: ExactRows);
    rows in the Hadamard basis are dequantized here and turned back."""
    kq, vq, rows = _quantized_parts(keys, values)
    if not (is_hadamard(kq) or is_hadamard(vq)):
        recent = (keys.exact, values.exact, mask is not None)
        return _fused(
            q, kq, vq, scale=scale, mask=None, sinks=sinks, recent=recent, rows=rows, **formats
        )
    return _joined_attention(q, keys, values, scale=scale, mask=mask, sinks=sinks, stream=stream)


def _joined_prefill(q, keys, mask: Mask, sinks, stream) -> bool:
    """Whether a recent-window step that the op would not route (MLX has no
    fused kernel for it: Gemma's 256-dim heads on CUDA) runs as one
    ``mx.fast`` attention over ``[dequantized rows, window rows]``, MLX's
    unfused attention as the model's own layer runs it: on a GPU, a
    prefill-sized step of rows in order whose scores fit
    ``JOINED_SCORE_BYTES`` (a sliding-window layer's chunk). Two parts
    merged would attend the step's own rows in float32 MLX ops; a longer
    context (a global layer's) keeps them, so its scores stay bounded."""
    if not _rows_in_order(keys):
        return False
    B, Hq, L = q.shape[:3]
    if L <= 16 or _device_of(stream).type != mx.gpu:
        return False
    if sinks is not None and sinks.dtype != q.dtype:
        return False  # (MLX's CUDA attention refuses sinks it cannot promote)
    N = keys.quantized_length + keys.exact.shape[2]
    return 4 * B * Hq * L * N <= JOINED_SCORE_BYTES


def _joined_attention(q, keys, values, *, scale, mask: Mask, sinks, stream) -> mx.array:
    """``mx.fast`` attention over a split's quantized rows dequantized (out
    of the Hadamard basis) and joined to its exact rows. Rows whose mask
    hides every key get zeros, as mlxq's kernels give them."""
    k = mx.concatenate(
        [_dequantized_rows(keys, keys.exact.dtype, stream), keys.exact], axis=2, stream=stream
    )
    v = mx.concatenate(
        [_dequantized_rows(values, values.exact.dtype, stream), values.exact],
        axis=2,
        stream=stream,
    )
    return _fast_attention(q, k, v, scale=scale, mask=mask, sinks=sinks, stream=stream)


def _fast_attention(q, keys, values, *, scale, mask: Mask, sinks, stream) -> mx.array:
    """``mx.fast`` attention, except that rows whose mask array hides every
    key (and no sink) get zeros, as mlxq's kernels give them."""
    out = mx.fast.scaled_dot_product_attention(
        q, keys, values, scale=scale, mask=mask, sinks=sinks, stream=stream
    )
    if isinstance(mask, mx.array) and sinks is None:
        visible = mask if mask.dtype == mx.bool_ else mask > -mx.inf
        seen = mx.any(visible, axis=-1, keepdims=True, stream=stream)
        out = mx.where(seen, out, mx.zeros((), out.dtype), stream=stream)
    return out


# Whether this process has a Metal GPU (fixed for its life; asked once).
_METAL = mx.metal.is_available()


def _window_in_kernel(head_dim: int, stream) -> bool:
    """Whether mlxq's kernels attend a recent window (recent_attention, or
    the decode kernel's own blocks) of rows ``head_dim`` wide (the wider of
    keys and values): up to 512, not on Metal (no kernel there yet)."""
    if head_dim > 512:
        return False
    return not (_METAL and _device_of(stream).type == mx.gpu)


def _recent_decode(
    q, keys, values, *, scale: float, mask: Mask, sinks, formats
) -> Optional[mx.array]:
    """A recent window's decode step (the step every generated token takes)
    in as few host steps as the op allows, for a split already checked
    (:func:`recent_split_sdpa`): one query per head, no mask, rows in the
    queries' basis, too few rows per KV head to route. Its one op attends
    the window too (on CUDA, in the decode kernel's own blocks), as the
    general path would, and a ring's quantized rows through the mask that
    hides the window's slots (RecentSplit.visible); None for any other
    step."""
    if mask is not None:
        return None
    _, Hq, L, D = q.shape
    kq, vq, rows = _quantized_parts(keys, values)
    ek, ev = keys.exact, values.exact
    H, Dv = ek.shape[1], ev.shape[3]
    if (
        L != 1
        or keys.quantized_length == 0
        or is_hadamard(kq)
        or is_hadamard(vq)
        or not _window_in_kernel(max(D, Dv), formats["stream"])
        # Enough query rows per KV head, the op would route the step
        # through mx.fast (mlxq.routing): the general path decides.
        or Hq // H >= routing.MIN_ROUTED_QUERY_ROWS
    ):
        return None
    if not (isinstance(kq, tuple) and isinstance(vq, tuple)):  # lists: the general checks
        recent = (ek, ev, False)
        return _fused(
            q,
            kq,
            vq,
            scale=scale,
            mask=keys.visible,
            sinks=sinks,
            recent=recent,
            rows=rows,
            **formats,
        )
    if type(kq) is not tuple or type(vq) is not tuple:
        # Values quantized apart from the keys (the Hadamard basis is ruled
        # out above): the triples carry their widths. Read here rather than
        # through _fused, whose general checks cost host time on every step.
        names = ("group_size", "bits", "v_group_size", "v_bits")
        widths = _carried_widths(kq, vq, tuple(formats[n] for n in names))
        formats = dict(formats, **dict(zip(names, widths)))
        kq, vq = entries(kq), entries(vq)
    return _ext.quantized_sdpa(
        q,
        *kq,
        *vq,
        scale=scale,
        mask=keys.visible,
        sinks=sinks,
        recent_keys=ek,
        recent_values=ev,
        rows=rows,
        **formats,
    )


def _carried_widths(keys, values, widths: tuple) -> tuple:
    """``widths``, ``(group_size, bits, v_group_size, v_bits)``, with those
    a :class:`FormattedTriple` of keys or values carries filled in where
    the caller left them None."""
    group_size, bits, v_group_size, v_bits = widths
    if isinstance(keys, FormattedTriple):
        g, b = keys.format.side(keys.values)
        group_size = g if group_size is None else group_size
        bits = b if bits is None else bits
    if isinstance(values, FormattedTriple):
        g, b = values.format.side(values.values)
        v_group_size = g if v_group_size is None else v_group_size
        v_bits = b if v_bits is None else v_bits
    return group_size, bits, v_group_size, v_bits


def _quantized_parts(keys, values):
    """The quantized parts of a split pair as the op takes them: ``(keys,
    values, rows)``, whole buffers and their row count when both carry them
    (RecentSplit.rows), else the parts themselves and None."""
    if keys.rows is not None and keys.rows == values.rows:
        return keys.quantized, values.quantized, keys.rows
    return keys.quantized_rows, values.quantized_rows, None


def recent_split_sdpa(
    q: mx.array,
    keys,
    values,
    *,
    scale: float,
    mask: Mask = None,
    sinks: Optional[mx.array] = None,
    group_size: Optional[int] = None,
    bits: Optional[int] = None,
    v_group_size: Optional[int] = None,
    v_bits: Optional[int] = None,
    stream: Union[None, mx.Stream, mx.Device] = None,
) -> mx.array:
    """Attention over a :class:`~mlxq.split.RecentSplit` of keys and one of
    values (a ``recent`` cache's fetch): the quantized rows through the
    fused kernel, the exact window densely, merged by log-sum-exp. ``mask``
    covers the fetch's columns as usual (``RecentSplit``): a ``"causal"``
    mask hides no quantized row (each precedes every query) and is causal
    over the window; an array is cut into the two parts. Sinks count once,
    in the quantized part (in the window's when there is no quantized row)."""
    n = keys.quantized_length
    same_cut = (
        n == values.quantized_length
        and keys.exact.shape[2] == values.exact.shape[2]
        and (keys.columns is None) == (values.columns is None)
    )
    if not same_cut:
        raise ValueError(
            "[mlxq.sdpa] keys and values of a recent-window fetch must be cut at the same "
            f"position, got {n} + {keys.exact.shape[2]} and {values.quantized_length} + "
            f"{values.exact.shape[2]}."
        )
    L, T = q.shape[2], keys.exact.shape[2]
    if T < L:
        raise ValueError(
            f"[mlxq.sdpa] a recent-window fetch must hold the step's {L} query tokens exactly, "
            f"got {T} exact rows."
        )
    formats = dict(
        group_size=group_size,
        bits=bits,
        v_bits=v_bits,
        v_group_size=v_group_size,
        stream=stream,
    )
    out = _recent_decode(q, keys, values, scale=scale, mask=mask, sinks=sinks, formats=formats)
    if out is not None:
        return out
    if _one_pass_prefill(q, keys, values, mask, sinks, stream):
        return _dequantized_one_pass(
            q, keys, values, scale=scale, mask=mask, sinks=sinks, stream=stream, formats=formats
        )
    if _joined_prefill(q, keys, mask, sinks, stream):
        return _joined_attention(
            q, keys, values, scale=scale, mask=mask, sinks=sinks, stream=stream
        )
    mask_q, mask_e = _part_masks(keys, mask, L)
    # recent_attention: any step on the CPU (MLX's CPU matmuls are slow; a
    # sliding-window layer's chunk brings a mask array, which only the CPU
    # kernel takes); on a GPU, steps of a few rows without one (a prefill
    # chunk's matmuls are faster there).
    on_cpu = _device_of(stream).type == mx.cpu
    mask_array = isinstance(mask_e, mx.array)
    fused = on_cpu or (L <= 16 and not mask_array)
    fused = fused and _window_in_kernel(max(q.shape[3], values.exact.shape[3]), stream)
    if n == 0 and not fused:
        return _exact_only(q, keys.exact, values.exact, scale, mask_e, sinks, stream)
    kq, vq, rows = _quantized_parts(keys, values)
    if fused and n > 0 and not mask_array and not (is_hadamard(kq) or is_hadamard(vq)):
        # One op: on CUDA the decode kernel attends the window in extra
        # blocks of its split merge; on the CPU the two parts as below.
        return _fused(
            q,
            kq,
            vq,
            rows=rows,
            scale=scale,
            mask=mask_q,
            sinks=sinks,
            recent=(keys.exact, values.exact, mask_e is not None),
            **formats,
        )
    if n == 0:
        # Nothing quantized yet: the "other part" is the sink alone (a key
        # of logit sink and value 0), or nothing.
        B, Hq = q.shape[:2]
        out_q = mx.zeros((B, Hq, L, values.exact.shape[3]), q.dtype)
        if sinks is None:
            lse_q = mx.full((B, Hq, L), -mx.inf)
        else:
            lse_q = mx.broadcast_to(sinks.astype(mx.float32)[None, :, None], (B, Hq, L))
    else:
        out_q, lse_q = quantized_sdpa(
            q,
            keys.quantized_rows,
            values.quantized_rows,
            scale=scale,
            mask=mask_q,
            sinks=sinks,
            return_lse=True,
            **formats,
        )
    if fused:
        return recent_attention(
            q,
            keys.exact,
            values.exact,
            out_q,
            lse_q,
            scale=scale,
            causal=mask_e is not None and not mask_array,
            mask=mask_e if mask_array else None,
            stream=stream,
        )
    out_e, lse_e = dense_attention_with_lse(
        q, keys.exact, values.exact, scale=scale, mask=mask_e, stream=stream
    )
    return merge_attention(out_q, lse_q, out_e, lse_e)[0]


def sdpa(
    q: mx.array,
    keys: Union[mx.array, Sequence[mx.array]],
    values: Union[mx.array, Sequence[mx.array]],
    *,
    scale: float,
    mask: Mask = None,
    sinks: Optional[mx.array] = None,
    group_size: Optional[int] = None,
    bits: Optional[int] = None,
    v_group_size: Optional[int] = None,
    v_bits: Optional[int] = None,
    stream: Union[None, mx.Stream, mx.Device] = None,
) -> mx.array:
    """Scaled dot-product attention over plain or quantized keys and values.

    Plain ``keys``/``values`` arrays go to
    :func:`mx.fast.scaled_dot_product_attention`; ``(packed, scales, biases)``
    triples go to mlxq's fused kernel (:func:`quantized_sdpa`), with bits and
    group size inferred from the shapes unless given.

    Args:
        q (array): Queries ``[B, H_q, L, D_k]``.
        keys (array or tuple): Keys ``[B, H_kv, N, D_k]``, or their quantized triple.
        values (array or tuple): Values ``[B, H_kv, N, D_v]``, or their quantized triple.
        scale (float): Scale applied to ``q @ K.T``.
        mask (str or array, optional): ``None``, ``"causal"`` or an array
          broadcastable to ``[B, H_q, L, N]`` (bool or additive).
        sinks (array, optional): Per-head attention-sink logits ``[H_q]``.
        group_size (int, optional): Quantization group size (triples only).
        bits (int, optional): Quantization bits (triples only).
        v_group_size, v_bits (int, optional): The values' own quantization,
          when it differs from the keys' (see :func:`quantized_sdpa`).
        stream (Stream, optional): Stream or device to run on.

    Returns:
        array: ``[B, H_q, L, D_v]`` in the dtype of ``q``.

    Example:
        >>> k = mx.quantize(keys, group_size=64, bits=4)
        >>> v = mx.quantize(values, group_size=64, bits=4)
        >>> out = mlxq.sdpa(q, k, v, scale=q.shape[-1] ** -0.5, mask="causal")
    """
    split = is_split(keys) or is_split(values)
    if split and not (is_split(keys) and is_split(values)):
        raise ValueError(
            "[mlxq.sdpa] keys and values must both be recent-window fetches "
            "(RecentSplit) or neither."
        )
    if split or is_quantized(keys) or is_quantized(values):
        attend = recent_split_sdpa if split else quantized_sdpa
        return attend(
            q,
            keys,
            values,
            scale=scale,
            mask=mask,
            sinks=sinks,
            group_size=group_size,
            bits=bits,
            v_bits=v_bits,
            v_group_size=v_group_size,
            stream=stream,
        )
    return mx.fast.scaled_dot_product_attention(
        q, keys, values, scale=scale, mask=mask, sinks=sinks, stream=stream
    )
