"""Decode steps with many query heads per KV head, against float64.

Multi-head latent attention (DeepSeek-V3, Kimi K2) puts 16-128 query heads
on one latent KV head of 512 dims, which serves as keys and values alike,
and adds its RoPE scores as an additive mask; some GQA models have 12-16
query heads per KV head. On CUDA the decode kernel attends at most 8 rows
per block, so such a step runs as groups of query heads (plan.h's
head_groups); the cases below must reach it and match the oracle, with
sinks, every additive mask dtype, bool masks and the log-sum-exp output.
On the CPU and Metal they check the same shapes on those backends' kernels.
"""

import mlx.core as mx
import numpy as np
import pytest
from support.helpers import assert_close, assert_cuda_kernel, random_inputs, random_sinks
from support.reference64 import sdpa64
from test_lse import assert_lse_close

import mlxq

CASES = [
    # B, Hq, Hkv, D, N, bits, q dtype, mask, latent (K is V), sinks
    (1, 16, 1, 512, 4099, 4, mx.bfloat16, "add_bf16", True, False),
    (2, 128, 1, 512, 1500, 4, mx.bfloat16, "add_bf16", True, True),
    (1, 16, 1, 512, 700, 8, mx.float16, "add_f32", True, False),
    (1, 32, 1, 512, 33, 4, mx.float16, "add_f16", True, True),
    (1, 64, 4, 128, 3000, 4, mx.bfloat16, None, False, True),
    (2, 24, 2, 128, 333, 8, mx.float16, "bool", False, True),  # 12 heads: groups of 6
    (1, 11, 1, 64, 2000, 4, mx.bfloat16, "causal", False, False),  # 11 heads: groups of 1
]


def additive_mask(rng, B, Hq, N, dtype):
    """RoPE-like scores with some keys hidden (-inf) and one head seeing none."""
    a = rng.normal(0, 2, (B, Hq, 1, N)).astype(np.float32)
    a[rng.random(a.shape) < 0.1] = -np.inf
    a[:, Hq // 2] = -np.inf
    return mx.array(a).astype(dtype)


def make(rng, B, Hq, Hkv, D, N, bits, q_dtype, mask, latent):
    q, k, v = random_inputs(
        rng,
        B=B,
        Hq=Hq,
        Hkv=Hkv,
        L=1,
        N=N,
        Dk=D,
        bits=bits,
        group_size=64,
        q_dtype=q_dtype,
        kv_dtype=q_dtype,
    )
    if latent:
        v = k
    if mask and mask.startswith("add_"):
        dtype = {"add_f32": mx.float32, "add_f16": mx.float16, "add_bf16": mx.bfloat16}[mask]
        mask = additive_mask(rng, B, Hq, N, dtype)
    elif mask == "bool":
        vis = rng.random((B, Hq, 1, N)) < 0.6
        vis[0, 1] = False
        mask = mx.array(vis)
    return q, k, v, mask


@pytest.mark.parametrize("B,Hq,Hkv,D,N,bits,q_dtype,mask,latent,with_sinks", CASES)
def test_many_query_heads_per_kv_head(
    rng, B, Hq, Hkv, D, N, bits, q_dtype, mask, latent, with_sinks
):
    q, k, v, mask = make(rng, B, Hq, Hkv, D, N, bits, q_dtype, mask, latent)
    sinks = random_sinks(rng, Hq) if with_sinks else None
    scale = D**-0.5
    # The decode kernel has no 8-bit instance at head dim 512: the generic
    # kernel serves those steps (docs/results/performance.md, MLA on CUDA).
    family = "cuda_generic" if (bits, D) == (8, 512) else "cuda_decode"
    mlxq._ext._take_last_sdpa_kernel()
    out, lse = mlxq.quantized_sdpa(q, k, v, scale=scale, mask=mask, sinks=sinks, return_lse=True)
    mx.eval(out, lse)
    assert_cuda_kernel(family)
    ref, ref_lse = sdpa64(
        q, k, v, scale=scale, mask=mask, sinks=sinks, group_size=64, bits=bits, return_lse=True
    )
    assert_close(out, ref, dtype=q_dtype)
    assert_lse_close(lse, ref_lse, q_dtype)
    plain = mlxq.quantized_sdpa(q, k, v, scale=scale, mask=mask, sinks=sinks)
    mx.eval(plain)
    assert_cuda_kernel(family)
    assert_close(plain, ref, dtype=q_dtype)
