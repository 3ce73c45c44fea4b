"""Attention as GEMMs over blocks of keys, for head dims no fused kernel takes.

MLX 0.32 has no fused attention for head dim 512 (Gemma 4's global layers):
``mx.fast.scaled_dot_product_attention`` falls back to a composition that
materialises the whole ``[B, H_q, L, N]`` score matrix. mlxq's tiled kernel
keeps memory bounded there but runs its ``16 x 512`` accumulators on
``mma.sync`` at a third of cuBLAS's rate. This route keeps both: a layer's
dequantized K/V are split into blocks of keys, each block is one score GEMM,
a row max, an exponential and a GEMM with V (the GEMMs are MLX's, i.e.
cuBLAS), and the blocks' partial results are merged by their row maxima and
sums, as a split-key attention kernel merges its splits. Only one block's
scores are needed at a time (``O(L * block)``, bounded by
:data:`BLOCK_ELEMENTS`, never ``O(L * N)``); MLX's CUDA backend keeps them
longer, as measured below.

Measured on an H200 (MLX 0.32.4, 8 query / 1 KV head, D=512, L=2048, 4-bit,
bench/results/gpu_wide_blocked_nvidia_h200.json): 0.89 / 2.10 / 4.64 ms at
2k / 8k / 32k keys, against mlxq's tiled kernel 0.68 / 3.16 / 12.8 and MLX's
unfused bf16 composition 0.50 / 1.36 / 3.96. But in mlx-lm's generate_step
on gemma4_text's defaults at 32k (bench/results/e2e_gemma4_blocked_nvidia_h200.json)
the time to first token went from 0.69-0.76 s (tiled kernel) to 1.53-1.65 s
and peak memory from 11.0 to 15-18 GB, whatever the block size (2**26 to
2**30 elements). The likely cause: MLX's CUDA backend keeps every kernel's
inputs alive until the CUDA graph that ran it completes (what
:mod:`mlxq.workspace` works around for the dense K/V), so in a 35-layer
prefill graph each block's score buffers are fresh allocations instead of
recycled ones. Hence the route is opt-in (:func:`mlxq.routing.set_blocked_prefill`).

Numerics: scores, ``exp`` and the row sums in the query's dtype like MLX's
own composition (``exp`` computed in float32, then rounded), the maxima
exact, the merge in float32.
"""

import contextlib
import os
from functools import partial
from typing import Optional

import mlx.core as mx

# Scores per block (all heads and rows together): 2**26 elements is 128 MiB
# in bf16. Blocks are whole multiples of BLOCK_KEYS_MULTIPLE keys.
BLOCK_ELEMENTS = int(os.environ.get("MLXQ_BLOCKED_ELEMENTS", 1 << 26))
BLOCK_KEYS_MULTIPLE = 256


@partial(mx.compile, shapeless=True)
def _exp_shifted(s: mx.array, m: mx.array) -> mx.array:
    # One fused pass: exp(s - m) in f32, rounded back to the scores' dtype for the V GEMM.
    return mx.exp(s.astype(mx.float32) - m.astype(mx.float32)).astype(s.dtype)


@partial(mx.compile, shapeless=True)
def _fold(top, num, den, m, o, l_):
    # Merges a block (max m, sum l_, unnormalised output o) into the running ones.
    new = mx.maximum(top, m)
    old_w, w = mx.exp(top - new), mx.exp(m - new)
    return new, num * old_w + o * w, den * old_w + l_ * w


def block_keys(rows: int, N: int, block_elements: int = BLOCK_ELEMENTS) -> int:
    """Keys per block for ``rows`` score rows (``B * H_q * L``) over ``N`` keys."""
    keys = max(block_elements // max(rows, 1), BLOCK_KEYS_MULTIPLE)
    keys -= keys % BLOCK_KEYS_MULTIPLE
    return min(keys, N)


def blocked_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    causal: bool,
    sinks: Optional[mx.array] = None,
    block: Optional[int] = None,
    stream=None,
) -> mx.array:
    """``softmax(scale * q @ k.T [+ causal]) @ v`` one block of keys at a time.

    ``q`` is ``[B, H_q, L, D_k]``; ``k``, ``v`` are dense ``[B, H_kv, N, D]``
    in ``q``'s dtype (H_q a multiple of H_kv). ``causal`` is bottom-right
    aligned and needs ``L <= N`` (every row then sees key 0, so no row is
    fully masked). ``sinks`` are per-query-head logits ``[H_q]`` added to the
    denominator. ``block`` overrides the keys per block (tests).
    """
    # Default stream inside: the compiled helpers run on it.
    with mx.stream(stream) if stream is not None else contextlib.nullcontext():
        return _blocked(q, k, v, scale, causal, sinks, block)


def _blocked(q, k, v, scale, causal, sinks, block):
    B, Hq, L, Dk = q.shape
    Hkv, N, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = Hq // Hkv
    if causal and L > N:
        raise ValueError(f"[mlxq.blocked_attention] causal needs L <= N, got L={L}, N={N}.")
    rows = G * L
    block = block or block_keys(B * Hq * L, N)
    # GQA without copies: a KV head's G query heads are one [G * L, D] row block.
    qs = (q * mx.array(scale, q.dtype)).reshape(B, Hkv, rows, Dk)
    offset = N - L  # causal: row l sees keys j <= l + offset
    row_pos = mx.arange(L)[:, None] + offset
    # Folded block by block (an online softmax over blocks), so one f32
    # accumulator lives, not one per block. Block 0 holds key 0, which every
    # row sees, so the running maximum is finite from the start.
    top = num = den = None
    for start in range(0, N, block):
        end = min(start + block, N)
        s = mx.matmul(qs, k[:, :, start:end].swapaxes(-1, -2))
        if causal and end - 1 > offset:  # some rows do not see the block's last keys
            visible = mx.arange(start, end)[None, :] <= row_pos
            s = mx.where(visible, s.reshape(B, Hkv, G, L, end - start), -mx.inf)
            s = s.reshape(B, Hkv, rows, end - start)
        m = mx.max(s, axis=-1, keepdims=True)
        # A row that sees no key of this block has max -inf: shift it by 0
        # (its p is all 0); exp(-inf - top) then gives the block weight 0.
        p = _exp_shifted(s, mx.where(m == -mx.inf, mx.zeros_like(m), m))
        m = m.astype(mx.float32)
        l_ = mx.sum(p, axis=-1, keepdims=True).astype(mx.float32)
        o = mx.matmul(p, v[:, :, start:end]).astype(mx.float32)
        if top is None:
            top, num, den = m, o, l_
            continue
        top, num, den = _fold(top, num, den, m, o, l_)
    if sinks is not None:
        sink = sinks.astype(mx.float32).reshape(1, Hkv, G, 1, 1)
        sink = mx.broadcast_to(sink, (B, Hkv, G, L, 1)).reshape(B, Hkv, rows, 1)
        top, num, den = _fold(top, num, den, sink, mx.zeros_like(sink), mx.ones_like(sink))
    return (num / den).astype(q.dtype).reshape(B, Hq, L, Dv)
