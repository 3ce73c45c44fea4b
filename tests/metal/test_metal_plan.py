"""The Metal grid arithmetic (csrc/metal/dispatch.cpp) on its own: what the
host code will ask of a real GPU, for shapes too large to emulate."""

import itertools
import struct

import pytest

import mlxq


def plan(**kw):
    base = dict(B=1, Hq=32, Hkv=8, L=1, N=4096, Dk=128, bits=4, group_size=64)
    base.update(kw)
    return mlxq._ext._metal_plan_sdpa(base)


@pytest.mark.parametrize("N", [1, 63, 64, 1000, 4096, 32768, 131072, 10**6])
@pytest.mark.parametrize("B,Hq,Hkv", [(1, 32, 8), (1, 8, 1), (4, 16, 16), (1, 64, 8)])
def test_decode_blocks_fill_the_gpu(N, B, Hq, Hkv):
    p = plan(B=B, Hq=Hq, Hkv=Hkv, N=N)
    assert not p["prefill"] and p["kernel"].startswith("mlxq_qsdpa_decode_")
    rows = Hq // Hkv
    assert p["row_tile"] * p["row_tiles"] >= rows and p["row_tile"] <= 16
    assert p["group"] == (32 * p["row_tile"], 1, 1)
    blocks, bk = p["n_blocks"], p["block_keys"]
    assert bk % 32 == 0 and 1 <= blocks <= 1024
    assert (blocks - 1) * bk < max(N, 1) <= blocks * bk  # every key in exactly one block
    assert p["grid"] == (blocks, p["row_tiles"] * Hkv, B)
    units = B * Hkv * p["row_tiles"]
    if N >= 64 * 256 and blocks < 1024:
        assert units * blocks >= 256  # long context: enough threadgroups
    if blocks > 1:
        assert bk >= 64
        assert p["merge"] and p["merge_kernel"] == "mlxq_qsdpa_merge_f32"
        assert p["partial_o_floats"] == B * Hkv * rows * blocks * 128
        assert p["partial_ml_floats"] == B * Hkv * rows * blocks * 2
        assert p["merge_grid"][0] * (p["merge_group"][0] // 32) >= B * Hkv * rows
    else:
        assert not p["merge"] and p["partial_o_floats"] == 0


def test_prefill_when_row_tiles_fill_the_gpu():
    assert plan(L=2048, N=2048)["prefill"]
    assert not plan(L=8, N=2048)["prefill"]  # short query runs decode
    assert not plan(Hq=8, Hkv=1, L=16, N=8192)["prefill"]  # few row tiles: split the keys
    p = plan(L=100, N=300, B=2)
    assert p["grid"] == (p["row_tiles"], 8, 2) and p["n_blocks"] == 1 and not p["merge"]


@pytest.mark.parametrize("max_threads", [32, 96, 128, 512, 1024])
def test_rows_per_threadgroup_respect_the_pipeline_limit(max_threads):
    for mode in (1, 2):
        p = plan(Hq=32, Hkv=2, L=3, mode=mode, max_threads=max_threads)
        assert p["group"][0] <= max_threads and p["row_tile"] * p["row_tiles"] >= 48


@pytest.mark.parametrize(
    "q,bits,dims",
    list(
        itertools.product(
            [0, 1, 2], [2, 3, 4, 5, 6, 8], [(64, 64), (128, 96), (192, 128), (512, 512)]
        )
    ),
)
def test_kernel_names(q, bits, dims):
    p = plan(q_dtype=q, bits=bits, Dk=dims[0], Dv=dims[1], group_size=32)
    tag = ["f32", "f16", "bf16"][q]
    assert p["kernel"] == f"mlxq_qsdpa_decode_{tag}_b{bits}_d{128 if max(dims) <= 128 else 512}"


def test_sixteen_byte_loads_need_alignment():
    W = 128 * 4 // 32  # 16 words per row
    assert plan(k_packed_strides=(8 * 100 * W, 100 * W, W))["k_vec4"]
    assert not plan(k_packed_strides=(8 * 100 * (W + 1), 100 * (W + 1), W + 1))["k_vec4"]
    assert not plan(k_packed_strides=(8 * 100 * W, 100 * W, W), k_packed_offset=2)["k_vec4"]
    # a buffer base off 16 bytes (the host checks it) takes the scalar path too
    assert not plan(k_packed_strides=(8 * 100 * W, 100 * W, W), k_base_aligned16=False)["k_vec4"]
    assert plan(k_packed_strides=(8 * 100 * W, 100 * W, W), v_base_aligned16=False)["k_vec4"]
    assert not plan(bits=3, Dk=96, v_packed_strides=(0, 0, 9))["v_vec4"]  # 9 words a row


def test_argument_block_layout():
    p = plan(
        B=3,
        Hq=12,
        Hkv=4,
        L=5,
        N=77,
        Dk=96,
        Dv=64,
        bits=3,
        group_size=32,
        v_bits=5,
        v_group_size=64,
        scale=0.25,
        q_strides=(1, 2, 3, 4),
        has_sinks=True,
        mask_kind=2,
        mask_dtype=1,
        mask_strides=(5, 6, 7, 8),
        sinks_stride=2,
    )
    raw = p["params"]
    assert len(raw) == 27 * 8 + 26 * 4
    longs = struct.unpack_from("<27q", raw)
    ints = struct.unpack_from("<24i", raw, 27 * 8)
    (scale,) = struct.unpack_from("<f", raw, 27 * 8 + 24 * 4)
    assert longs[:4] == (1, 2, 3, 4) and longs[22:26] == (5, 6, 7, 8) and longs[26] == 2
    # B..rep, K and V group sizes and bits, rows
    assert ints[:13] == (3, 12, 4, 5, 77, 96, 64, 3, 32, 64, 3, 5, 15)
    # mask kind (array) and dtype (f16), scale dtype, sinks
    assert ints[17:21] == (2, 1, 0, 1) and scale == 0.25
    assert "_kv_d128" in p["kernel"]


def test_ring_plans():
    r = mlxq._ext._metal_plan_ring_update(
        dict(B=2, H=8, S=4096, T=3, D=128, itemsize=2, update_strides=(1, 2, 3, 4))
    )
    assert r["kernel"] == "mlxq_ring_update_u16" and r["grid_is_threads"]
    assert r["grid"] == (128, 3, 16) and r["group"][0] * r["group"][1] <= 256
    q = mlxq._ext._metal_plan_quantized_ring_update(
        dict(B=2, H=8, S=4096, T=1, D=256, group_size=64, bits=6, dtype=2)
    )
    assert q["kernel"] == "mlxq_quantized_ring_update_bf16_b6" and not q["grid_is_threads"]
    assert q["grid"] == (4, 1, 16) and q["group"] == (32, 1, 1)
    assert q["part"] == 0 and struct.unpack_from("<i", q["params"], 4 * 8 + 9 * 4) == (0,)
    for part in (1, 2):  # the part is the argument block's last word; the dispatch is the same
        qp = mlxq._ext._metal_plan_quantized_ring_update(
            dict(B=2, H=8, S=4096, T=1, D=256, group_size=64, bits=6, dtype=2, part=part)
        )
        assert qp["part"] == part and struct.unpack_from("<i", qp["params"], 4 * 8 + 9 * 4) == (
            part,
        )
        assert (qp["kernel"], qp["grid"], qp["group"]) == (q["kernel"], q["grid"], q["group"])
    c = mlxq._ext._metal_plan_copy4d(dict(shape=(2, 3, 5, 7), strides=(1, 1, 1, 1), itemsize=8))
    assert c["kernel"] == "mlxq_copy4d_u64" and c["grid"] == (7, 5, 6)


def test_kernel_widths_names():
    names = {
        (4, 4): "_b4_",
        (3, 3): "_b3_",
        (8, 4): "_k8v4_",
        (4, 8): "_kv_",
        (8, 2): "_kv_",
    }
    for (kb, vb), tag in names.items():
        p = plan(Hq=4, Hkv=1, L=1, N=100, Dk=128, bits=kb, v_bits=vb)
        assert tag in p["kernel"], (kb, vb, p["kernel"])
        assert p["params"][27 * 8 + 10 * 4 : 27 * 8 + 12 * 4] == struct.pack("<2i", kb, vb)


def test_unsupported_shapes_raise():
    for kw in (
        dict(Dk=100),
        dict(Dk=1024),
        dict(Hq=6, Hkv=4),
        dict(group_size=16),
        dict(v_group_size=16),
    ):
        with pytest.raises(ValueError, match="unsupported"):
            plan(**kw)
