"""CUDA's attention plan (csrc/cuda/sdpa/plan.cpp), tested on every machine.

The plan is a pure function of the problem, the operands' layout, the
device's limits and the candidate kernels' shapes, so which kernel runs and
how it splits and merges is checked here without a GPU. The GPU tests pin
the same choices on real arrays (helpers.assert_cuda_kernel).
"""

import numpy as np
import pytest

from mlxq import _ext

F32, F16, BF16, BOOL = 0, 1, 2, 3
NONE, CAUSAL, ARRAY = 0, 1, 2

# Shapes of H200 instances (4-bit, D = 128, group 64).
DECODE = dict(
    available=True, smem=60 * 1024, max_rows=8, step_keys=32, merge_smem=48 * 1024, blocks_per_sm=3
)
TILED = dict(available=True, smem=90 * 1024, threads=256, rows=128, keys=32, blocks_per_sm=2)
H200 = dict(sm_count=132, max_smem=227 * 1024)


def plan(limits=H200, decode=DECODE, tiled=TILED, layout=None, **problem):
    problem = dict(dict(B=1, Hq=32, Hkv=8, L=1, N=32768, Dk=128, q_dtype=BF16), **problem)
    return _ext._cuda_plan_sdpa(problem, layout or {}, limits, decode, tiled, 40 * 1024)


def test_decode_takes_few_rows_and_splits_keys_for_one_wave():
    p = plan()
    assert p["kernel"] == "cuda_decode"
    assert p["row_tile"] == p["rows"] == 4 and p["row_tiles"] == 1
    # 3 blocks per SM x 132 SMs over 8 KV heads: 50 splits wanted, of whole
    # 32-key steps (672 keys), so 49 cover the 32768 keys.
    assert p["split_keys"] == 672 and p["splits"] == 49
    assert p["grid"] == (49, 8, 1) and p["threads"] == 128 and p["smem"] == DECODE["smem"]
    assert p["partial_slots"] == 8 * 49 * 4


def test_decode_merges_in_its_last_block_while_a_head_partials_fit():
    assert plan()["fused_merge"] and not plan()["merge_kernel"]
    few_heads = plan(Hq=8, Hkv=1, N=131072)  # 396 splits of one head: too many partials
    assert few_heads["kernel"] == "cuda_decode"
    assert few_heads["merge_kernel"] and not few_heads["fused_merge"]
    off = plan(limits=dict(H200, fused_merge_on=False))
    assert off["merge_kernel"] and not off["fused_merge"]


@pytest.mark.parametrize("mask_dtype", [BOOL, F32, F16, BF16])
def test_decode_takes_mask_arrays(mask_dtype):
    """A left-padded batch's decode step (mlxq's batch caches) masks with a
    bool array, multi-head latent attention adds its RoPE scores: the decode
    kernel reads either per score."""
    assert plan(B=8, mask=ARRAY, mask_dtype=mask_dtype)["kernel"] == "cuda_decode"


@pytest.mark.parametrize(
    "Hq,Hkv,groups",
    [(16, 1, 2), (128, 1, 16), (64, 4, 2), (24, 2, 2), (11, 1, 11), (32, 8, 1)],
)
def test_decode_attends_many_query_heads_per_kv_head_in_groups(Hq, Hkv, groups):
    """A decode step with more query heads per KV head than the kernel's 8
    rows (multi-head latent attention's 16-128 heads on one latent head of
    512 dims) runs as groups of heads, each of them a KV head of the grid:
    the fewest groups that divide the heads and fit 8 rows."""
    p = plan(Hq=Hq, Hkv=Hkv, Dk=512, mask=ARRAY, mask_dtype=BF16)
    assert p["kernel"] == "cuda_decode" and p["head_groups"] == groups
    assert p["rows"] == Hq // Hkv // groups <= DECODE["max_rows"]
    assert p["grid"][1] == Hkv * groups
    # The kernel finds a grid row's KV head as a multiply-high by the magic.
    magic = p["head_group_magic"]
    if groups == 1:
        assert magic == 0
    else:
        rows = np.arange(1 << 16, dtype=np.uint64)
        assert ((rows * np.uint64(magic)) >> np.uint64(32) == rows // groups).all()
    if p["merge_kernel"] or p["fused_merge"]:
        assert p["partial_slots"] == Hkv * groups * p["splits"] * p["rows"]
    # Splits are planned over the grouped heads: one wave of blocks.
    want = DECODE["blocks_per_sm"] * H200["sm_count"]
    assert p["splits"] * Hkv * groups <= want + Hkv * groups


def test_groups_of_heads_are_for_decode_steps_only():
    """Drafts of several positions keep their rows together (the tiled
    kernel) rather than reading K/V once per head group."""
    p = plan(Hq=16, Hkv=1, L=4)
    assert p["kernel"] != "cuda_decode" and p["head_groups"] == 1


@pytest.mark.parametrize(
    "change",
    [
        dict(q_dtype=F32),  # f32 queries
        dict(Dv=64),  # Dk != Dv
        dict(L=3),  # 12 rows per KV head > max_rows (not a decode step)
        dict(N=0),
    ],
)
def test_decode_refuses_what_it_does_not_cover(change):
    assert plan(**change)["kernel"] != "cuda_decode"


@pytest.mark.parametrize(
    "layout", [dict(vec_loads=False), dict(dense_kv=False), dict(head_fits_32bit=False)]
)
def test_decode_needs_its_layout(layout):
    assert plan(layout=layout)["kernel"] == "cuda_generic"


def test_decode_that_does_not_fit_shared_memory_takes_another_kernel():
    small_gpu = dict(sm_count=84, max_smem=99 * 1024)
    big = dict(DECODE, smem=112 * 1024)
    assert plan(limits=small_gpu, decode=big)["kernel"] == "cuda_generic"
    assert plan(limits=small_gpu, decode=big, L=8)["kernel"] == "cuda_tiled"
    assert plan(decode=big)["kernel"] == "cuda_decode"


def test_tiled_takes_many_rows_and_splits_only_idle_grids():
    p = plan(L=2048, N=2048, mask=CAUSAL)
    assert p["kernel"] == "cuda_tiled"
    assert p["rows"] == 8192 and p["row_tiles"] == 64 and p["splits"] == 1
    assert p["grid"] == (8 * 64, 1, 1) and not p["merge_kernel"]
    few = plan(L=8, Hq=8, Hkv=1, N=65536)  # 64 rows: one row tile, keys split
    assert few["kernel"] == "cuda_tiled" and few["splits"] > 1 and few["merge_kernel"]
    assert few["partial_slots"] == few["splits"] * few["row_tile"]


def test_tiled_wide_heads_take_the_instance_block():
    # Head dim 512: 4 row warps x 4 column warps share a block of 64 rows.
    til = dict(TILED, threads=512, rows=64, smem=200 * 1024, blocks_per_sm=1)
    p = plan(L=2048, N=32768, Hq=8, Hkv=1, Dk=512, tiled=til, limits=dict(H200, gemm_on=False))
    assert p["kernel"] == "cuda_tiled" and p["threads"] == 512 and p["row_tile"] == 64
    assert p["grid"][1] == p["splits"] and p["grid"][0] == p["row_tiles"]


def test_wide_heads_with_many_rows_read_a_dense_copy():
    # Gemma 4's prefill: 8 query heads x 2048 positions on one KV head.
    gemma = dict(L=2048, N=32768, Hq=8, Hkv=1)
    assert plan(Dk=512, **gemma)["dense_candidate"]
    assert plan(Dk=256, **gemma)["dense_candidate"]
    assert not plan(Dk=128, **gemma)["dense_candidate"]  # codes instance
    assert not plan(Dk=512, L=31, N=32768, Hq=8, Hkv=1)["dense_candidate"]  # 248 rows
    assert plan(Dk=512, L=32, N=32768, Hq=8, Hkv=1)["dense_candidate"]  # 256 rows
    assert not plan(Dk=512, limits=dict(H200, dense_on=False), **gemma)["dense_candidate"]
    assert not plan(Dk=512, q_dtype=F32, **gemma)["dense_candidate"]
    til = dict(TILED, threads=256, rows=32, smem=182 * 1024, blocks_per_sm=1, dense=True)
    short = dict(gemma, N=4095)  # below kGemmMinKeys: the tiled kernel
    p = plan(Dk=512, tiled=til, **short)
    assert p["kernel"] == "cuda_tiled" and p["dense_copy"] and p["row_tile"] == 32
    assert not plan(Dk=512, **short)["dense_copy"]


def test_wide_heads_over_many_keys_run_as_gemms_over_key_blocks():
    gemma = dict(L=2048, N=32768, Hq=8, Hkv=1, mask=CAUSAL)
    til = dict(TILED, threads=256, rows=32, smem=182 * 1024, blocks_per_sm=1, dense=True)
    for Dk in (256, 512):
        p = plan(Dk=Dk, tiled=til, **gemma)
        assert p["kernel"] == "cuda_gemm" and p["dense_copy"]
        # 2^26 score elements over 16384 rows: 4096-key blocks.
        assert p["block_keys"] == 4096 and p["blocks"] == 8
        assert p["grid"][0] == 8 * 2048 and p["threads"] == 256
    assert plan(Dk=512, N=4096, L=2048, Hq=8, Hkv=1)["kernel"] == "cuda_gemm"
    assert plan(Dk=512, N=4095, L=2048, Hq=8, Hkv=1)["kernel"] != "cuda_gemm"
    # Few rows: the block grows to the cap, and never past the keys.
    p = plan(Dk=512, L=32, N=9000, Hq=8, Hkv=1)
    assert (p["kernel"], p["block_keys"], p["blocks"]) == ("cuda_gemm", 4096, 3)
    p = plan(Dk=512, L=32, N=4100, Hq=8, Hkv=1, limits=dict(H200, gemm_block_elements=2**20))
    assert (p["block_keys"], p["blocks"]) == (4096, 2)
    p = plan(Dk=512, **gemma, limits=dict(H200, gemm_block_elements=2**24))
    assert (p["block_keys"], p["blocks"]) == (1024, 32)
    lim = dict(H200, gemm_min_keys=1000, gemm_block_elements=2**24)
    p = plan(Dk=256, B=2, L=512, N=5000, Hq=8, Hkv=2, limits=lim)
    assert (p["kernel"], p["block_keys"], p["blocks"]) == ("cuda_gemm", 2048, 3)  # 8192 rows
    # Batches, sinks and no mask are covered; these are not.
    refused = [
        dict(Dk=128),
        dict(Dk=512, q_dtype=F32),
        dict(Dk=512, Dv=256),
        dict(Dk=512, mask=ARRAY),
        dict(Dk=512, L=31),  # 248 rows per KV head
        dict(Dk=512, limits=dict(H200, gemm_on=False)),
        dict(Dk=512, limits=dict(H200, dense_on=False)),
    ]
    for change in refused:
        assert plan(**dict(gemma, **change))["kernel"] != "cuda_gemm", change
    # Causal needs L <= N (every row then sees key 0).
    assert plan(Dk=512, L=8192, N=4096, Hq=8, Hkv=1, mask=CAUSAL)["kernel"] != "cuda_gemm"
    assert plan(Dk=512, L=8192, N=4096, Hq=8, Hkv=1)["kernel"] == "cuda_gemm"


def test_generic_takes_the_rest():
    p = plan(q_dtype=F32, L=2048, N=2048)
    assert p["kernel"] == "cuda_generic" and p["row_tile"] <= 16 and p["threads"] == 128
    assert p["smem"] == 40 * 1024
    assert plan(limits=dict(H200, tiled_on=False), L=64)["kernel"] == "cuda_generic"
    assert plan(limits=dict(H200, decode_on=False))["kernel"] == "cuda_generic"
    assert plan(tiled=dict(TILED, available=False), L=64)["kernel"] == "cuda_generic"
    assert plan(layout=dict(packed_unit_stride=False), L=64)["kernel"] == "cuda_generic"


def test_keys_and_values_quantized_apart():
    # The decode kernel stages K and V of one quantization, or 8-bit keys
    # with 4-bit values (any groups it has an instance of: the host's decode
    # shape says); the tiled kernel over codes only the first. Other mixed
    # pairs take the generic kernel, or the kernels over a dense copy (any
    # pair) where the shape has them.
    k8v4 = dict(bits=8, v_bits=4)
    assert plan()["kernel"] == "cuda_decode"
    assert plan(**k8v4)["kernel"] == "cuda_decode"
    assert plan(v_group_size=32, **k8v4)["kernel"] == "cuda_decode"
    no_instance = dict(DECODE, available=False)
    assert plan(decode=no_instance, **k8v4)["kernel"] == "cuda_generic"
    assert plan(bits=4, v_bits=8)["kernel"] == "cuda_generic"
    assert plan(v_group_size=32)["kernel"] == "cuda_generic"
    assert plan(L=64, **k8v4)["kernel"] == "cuda_generic"
    wide = dict(L=2048, N=2048, Hq=8, Hkv=1, mask=CAUSAL, **k8v4)
    til = dict(TILED, threads=256, rows=32, smem=182 * 1024, blocks_per_sm=1, dense=True)
    p = plan(Dk=256, tiled=til, **wide)
    assert p["kernel"] == "cuda_tiled" and p["dense_copy"] and p["dense_candidate"]
    assert plan(Dk=512, tiled=til, **dict(wide, N=8192))["kernel"] == "cuda_gemm"
    assert plan(Dk=256, **dict(wide, L=31))["kernel"] == "cuda_generic"  # 248 rows: no copy


def test_the_log_sum_exp_comes_from_a_split_merge():
    # quantized_sdpa with return_lse: the merge (fused in decode, merge_kernel
    # otherwise) writes each row's log-sum-exp, so every split family writes
    # partials, even with one split; the GEMM family's finish writes it.
    assert plan(with_lse=True)["kernel"] == "cuda_decode"
    assert plan(with_lse=True)["fused_merge"]
    one = plan(q_dtype=F32, B=128, L=4, N=64, with_lse=True)  # enough blocks unsplit
    assert one["kernel"] == "cuda_generic" and one["splits"] == 1 and one["merge_kernel"]
    assert one["partial_slots"] > 0
    assert not plan(q_dtype=F32, B=128, L=4, N=64)["merge_kernel"]
    tiled = plan(L=64, N=300, with_lse=True)
    assert tiled["kernel"] == "cuda_tiled" and tiled["merge_kernel"]
    wide = dict(L=2048, N=8192, Hq=8, Hkv=1, Dk=512, mask=CAUSAL)
    til = dict(TILED, threads=256, rows=32, smem=182 * 1024, blocks_per_sm=1, dense=True)
    assert plan(tiled=til, **wide)["kernel"] == "cuda_gemm"
    gemm = plan(tiled=til, with_lse=True, **wide)
    assert gemm["kernel"] == "cuda_gemm" and not gemm["merge_kernel"]
    assert gemm["partial_slots"] == 0


def test_a_recent_window_adds_decode_blocks_to_the_merge():
    # An exact window of 129 rows beside the quantized keys: three more
    # splits per KV head (64 rows each), merged with the key splits.
    base, p = plan(), plan(recent=129)
    assert p["kernel"] == "cuda_decode" and p["recent_splits"] == 3
    assert p["splits"] == base["splits"] + 3 and p["grid"] == (base["splits"] + 3, 8, 1)
    assert p["split_keys"] == base["split_keys"]
    assert p["partial_slots"] == 8 * (base["splits"] + 3) * 4
    assert p["fused_merge"]
    # MLA's head groups: each group's blocks attend the window too.
    mla = plan(Hq=16, Hkv=1, Dk=512, recent=64)
    assert mla["head_groups"] == 2 and mla["recent_splits"] == 1
    # Off (MLXQ_CUDA_FUSED_RECENT=0), or another family: no recent blocks;
    # the launch merges the window in after the quantized part.
    assert plan(recent=129, limits=dict(H200, fused_recent_on=False))["recent_splits"] == 0
    other = plan(q_dtype=F32, recent=129)
    assert other["kernel"] == "cuda_generic" and other["recent_splits"] == 0


@pytest.mark.parametrize("N", [1, 100, 255, 257, 1000, 2049, 5000, 32767])
@pytest.mark.parametrize("q_dtype", [BF16, F32])
def test_splits_follow_the_key_class(N, q_dtype):
    """Compiled decode reads a cache's whole buffer (N rounded up to the
    256-key class) with the unwritten rows masked: its plan must cut and
    count the keys as the exact fetch's does, so both give the same bits."""
    klass = -(-N // 256) * 256
    exact, whole = plan(N=N, q_dtype=q_dtype), plan(N=klass, q_dtype=q_dtype)
    for key in ("kernel", "split_keys", "splits", "fused_merge", "merge_kernel", "grid"):
        assert exact[key] == whole[key], key
