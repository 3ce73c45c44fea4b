"""QuantizedSDPA's Metal kernels (metal/qsdpa_*.metal) run on the emulator.

The same equivalence checks as the CPU tests: fresh random inputs, every
bits / group size / head-dim pairing / GQA ratio / mask kind / sinks /
dtype, strided K/V cache views and query views, against the float64 oracle
(tests/support/reference64.py) with tests/support/helpers.py's tolerances (TOL); outputs and partial
buffers are poisoned first; rows that see no key must be exactly 0. Every
dispatch -- kernel choice, key blocks, grid, threadgroup, argument block --
comes from mlxq._ext._metal_plan_sdpa, the C++ arithmetic the Metal host code
uses. Each test runs under the default, reverse and random schedules.
"""

import itertools

import mlx.core as mx
import numpy as np
import pytest
from harness import DT, run_sdpa
from sdpa_cases import MODES, Case, run_case
from support.masks import MASK_KINDS

import mlxq

BITS = [2, 3, 4, 5, 6, 8]
GROUP_SIZES = [32, 64, 128]


# --- bits, group sizes, scale dtypes ------------------------------------------------

RAGGED_N = [1, 7, 33, 100, 257]


@pytest.mark.parametrize(
    "bits,group_size,N",
    [
        (b, g, RAGGED_N[i % len(RAGGED_N)])
        for i, (b, g) in enumerate(itertools.product(BITS, GROUP_SIZES))
    ],
)
def test_bits_and_group_sizes(emu, rng, bits, group_size, N):
    case = Case(rng, Hq=4, Hkv=1, L=2, N=N, Dk=128, bits=bits, group_size=group_size)
    run_case(emu, case, rng)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("kv_dtype", ["f32", "f16", "bf16"])
def test_bits_and_scale_dtypes(emu, rng, bits, kv_dtype):
    case = Case(rng, Hq=4, Hkv=2, L=3, N=97, Dk=64, bits=bits, group_size=64, kv_dtype=kv_dtype)
    run_case(emu, case, rng, "causal")


# Separate K and V quantization: the k8v4 instance, the run-time-widths
# instance for every other pair, own group sizes, both modes.
MIXED = [
    # k_bits, k_group_size, v_bits, v_group_size, Dk, Dv, mode, mask, kernel widths
    (8, 64, 4, 64, 128, 128, "decode", "causal", "k8v4"),
    (8, 32, 4, 128, 256, 256, "prefill", "bool_BHLN", "k8v4"),
    (8, 64, 4, 64, 512, 512, "decode", "none", "k8v4"),
    (4, 64, 8, 64, 64, 64, "decode", "causal", "kv"),
    (8, 128, 2, 32, 128, 64, "prefill", "causal", "kv"),
    (3, 32, 6, 64, 96, 128, "decode", "add_f16", "kv"),
    (5, 64, 4, 32, 192, 160, "prefill", "none", "kv"),
    (6, 64, 3, 64, 512, 256, "decode", "bool_keypad", "kv"),
    (2, 32, 5, 32, 64, 96, "auto", "causal", "kv"),
]


@pytest.mark.parametrize("kb,kg,vb,vg,Dk,Dv,mode,mask,widths", MIXED)
def test_separate_key_and_value_quantization(emu, rng, kb, kg, vb, vg, Dk, Dv, mode, mask, widths):
    case = Case(
        rng,
        B=2,
        Hq=4,
        Hkv=2,
        L=5 if mode == "decode" else 19,
        N=83,
        Dk=Dk,
        Dv=Dv,
        bits=kb,
        group_size=kg,
        v_bits=vb,
        v_group_size=vg,
        kv_dtype="f16",
    )
    out, plan = run_case(emu, case, rng, mask, with_sinks=kb == 8, mode=mode)
    assert f"_{widths}_d" in plan["kernel"], plan["kernel"]


# --- head dims, GQA, batch, query length ------------------------------------------------


@pytest.mark.parametrize(
    "Dk,Dv,group_size,bits",
    [
        (32, 32, 32, 4),
        (64, 64, 64, 8),
        (96, 96, 32, 3),
        (128, 128, 128, 5),
        (256, 256, 64, 6),
        (512, 512, 128, 4),
        (512, 512, 32, 2),
        (192, 128, 64, 4),
        (128, 256, 32, 8),
        (64, 512, 64, 3),
        (512, 64, 64, 6),
        (160, 96, 32, 5),
    ],
)
def test_head_dims(emu, rng, Dk, Dv, group_size, bits):
    case = Case(rng, Hq=4, Hkv=2, L=3, N=75, Dk=Dk, Dv=Dv, bits=bits, group_size=group_size)
    out, plan = run_case(emu, case, rng, "causal")
    assert out.shape == (1, 4, 3, Dv)
    assert plan["kernel"].endswith("_d128" if max(Dk, Dv) <= 128 else "_d512")


@pytest.mark.parametrize(
    "Hq,Hkv,L",
    [
        (1, 1, 1),
        (4, 4, 5),
        (8, 4, 1),
        (8, 2, 5),
        (16, 2, 1),
        (32, 4, 3),
        (12, 4, 2),
        (40, 8, 2),
        (8, 1, 9),
    ],
)
def test_gqa_ratios(emu, rng, Hq, Hkv, L):
    # rep * L rows share each K/V tile; more than 16 rows need several row tiles.
    case = Case(rng, B=2, Hq=Hq, Hkv=Hkv, L=L, N=90, Dk=64, bits=4, group_size=64)
    run_case(emu, case, rng, "causal")


@pytest.mark.parametrize(
    "B,L,N,mask,mode",
    [
        (1, 1, 600, "none", "auto"),
        (2, 2, 257, "causal", "decode"),
        (3, 4, 33, "none", "prefill"),
        (1, 8, 7, "causal", "decode"),
        (1, 8, 7, "causal", "prefill"),
        (2, 31, 129, "causal", "prefill"),
        (1, 40, 50, "causal", "auto"),
        (2, 24, 17, "causal", "prefill"),
        (3, 1, 1, "causal", "auto"),
    ],
)
def test_batch_and_query_length(emu, rng, B, L, N, mask, mode):
    case = Case(rng, B=B, Hq=4, Hkv=2, L=L, N=N, Dk=64, bits=8, group_size=32)
    run_case(emu, case, rng, mask, mode=mode)


# --- masks and sinks ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_masks(emu, rng, kind, with_sinks, mode):
    case = Case(rng, B=2, Hq=8, Hkv=2, L=8, N=100, Dk=64, bits=4, group_size=64)
    # decode: 32-key blocks, merged by log-sum-exp; prefill: one pass over all keys
    out, plan = run_case(
        emu, case, rng, kind, with_sinks, mode=mode, target_threadgroups=10**6, min_block_keys=32
    )
    assert plan["prefill"] == (mode == "prefill") and plan["merge"] == (mode == "decode")
    if kind.startswith("all_"):
        assert (out.astype(np.float32) == 0).all()


@pytest.mark.parametrize(
    "kind,q_dtype",
    [
        ("causal", "f32"),
        ("bool_window", "f32"),
        ("bool_BHLN", "bf16"),
        ("add_f32", "f16"),
        ("all_hidden", "f32"),
        ("add_row_const", "f32"),
    ],
)
def test_masks_with_split_keys(emu, rng, kind, q_dtype):
    # One KV head, few queries: many key blocks; a window hides most of them.
    case = Case(rng, Hq=4, Hkv=1, L=3, N=700, Dk=64, bits=6, group_size=32, q_dtype=q_dtype)
    _, plan = run_case(emu, case, rng, kind, True, min_block_keys=32)
    assert plan["n_blocks"] > 10


@pytest.mark.parametrize("level", ["mixed", "dominant", "neg_inf", "strided"])
def test_sinks(emu, rng, level):
    Hq = 8
    case = Case(rng, B=2, Hq=Hq, Hkv=2, L=4, N=50, Dk=64, bits=5, group_size=32)
    values = {
        "mixed": rng.normal(0, 2, Hq),
        "dominant": np.full(Hq, 12.0),
        "neg_inf": np.full(Hq, -np.inf),
        "strided": rng.normal(0, 2, Hq),
    }[level].astype(np.float32)
    sinks_np = values
    if level == "strided":
        wide = np.zeros(2 * Hq, np.float32)
        wide[::2] = values
        sinks_np = wide[::2]
    case.run(emu, mask="causal", sinks=mx.array(values), sinks_np=sinks_np)


# --- dtypes and scales ---------------------------------------------------------------------


@pytest.mark.parametrize("q_dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("kv_dtype", ["f32", "f16", "bf16"])
def test_query_and_scale_dtypes(emu, rng, q_dtype, kv_dtype):
    bits = {"f32": 4, "f16": 8, "bf16": 3}[kv_dtype]
    case = Case(
        rng,
        B=2,
        Hq=8,
        Hkv=2,
        L=4,
        N=150,
        Dk=64,
        bits=bits,
        group_size=64,
        q_dtype=q_dtype,
        kv_dtype=kv_dtype,
    )
    run_case(emu, case, rng, "causal", True, min_block_keys=32)


@pytest.mark.parametrize("scale", [0.0, -0.09, 3 / 8])
def test_scale_values(emu, rng, scale):
    case = Case(rng, Hq=4, Hkv=1, L=2, N=300, Dk=64, bits=8, group_size=64)
    case.run(emu, scale=scale, mask="causal")


# --- strided views ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra_rows,pad_cols,q_layout,bits,mode",
    [
        (37, False, "contiguous", 4, "decode"),
        (200, False, "transposed", 8, "prefill"),
        (5, True, "contiguous", 4, "decode"),
        (13, True, "strided_last", 8, "prefill"),
        (0, True, "transposed", 3, "decode"),
        (64, False, "strided_last", 2, "auto"),
    ],
)
def test_views(emu, rng, extra_rows, pad_cols, q_layout, bits, mode):
    """K/V as slices of larger buffers (garbage elsewhere), padded rows that
    rule out 16-byte loads, and transposed / strided queries."""
    case = Case(
        rng,
        B=2,
        Hq=8,
        Hkv=2,
        L=3 if mode != "prefill" else 20,
        N=90,
        Dk=128,
        bits=bits,
        group_size=64,
        q_dtype="f16",
        kv_dtype="bf16",
        kv_extra_rows=extra_rows,
        kv_pad_cols=pad_cols,
        q_layout=q_layout,
    )
    _, plan = run_case(emu, case, rng, "causal", mode=mode, min_block_keys=32)
    assert plan["k_vec4"] == plan["v_vec4"] == (not pad_cols)


@pytest.mark.parametrize("max_threads,mode", [(64, "decode"), (96, "prefill"), (32, "decode")])
def test_pipeline_thread_limit(emu, rng, max_threads, mode):
    """The host re-plans with fewer rows per threadgroup when a pipeline
    allows fewer threads than planned."""
    case = Case(
        rng, B=2, Hq=12, Hkv=2, L=5 if mode == "decode" else 18, N=70, Dk=64, bits=6, group_size=64
    )
    _, plan = run_case(
        emu, case, rng, "causal", True, mode=mode, min_block_keys=32, max_threads=max_threads
    )
    assert plan["group"][0] <= max_threads


# --- prefill: tiles that no query sees are skipped ----------------------------------------------


@pytest.mark.parametrize("L,N", [(16, 16), (33, 73), (64, 64), (48, 20)])
@pytest.mark.parametrize("kind", ["none", "causal", "bool_window"])
def test_prefill(emu, rng, L, N, kind):
    case = Case(
        rng, Hq=4, Hkv=2, L=L, N=N, Dk=64, bits=4, group_size=32, q_dtype="bf16", kv_dtype="bf16"
    )
    _, plan = run_case(emu, case, rng, kind, mode="prefill")
    assert plan["prefill"] and not plan["merge"]


# --- log-sum-exp (quantized_sdpa with return_lse) ---------------------------------------------


@pytest.mark.parametrize(
    "L,N,kind,with_sinks,mode",
    [
        (1, 300, "none", False, "decode"),
        (1, 40, "none", True, "decode"),  # one key block: the merge still runs
        (5, 77, "causal", True, "auto"),
        (3, 700, "add_f32", False, "decode"),  # query 0 sees no key: -inf
        (64, 64, "causal", False, "prefill"),  # prefill asked: the decode kernel serves
    ],
)
def test_log_sum_exp(emu, rng, L, N, kind, with_sinks, mode):
    case = Case(rng, Hq=4, Hkv=2, L=L, N=N, Dk=64, bits=4, group_size=32, q_dtype="bf16")
    _, plan = run_case(emu, case, rng, kind, with_sinks, mode=mode, with_lse=True)
    assert plan["merge"] and not plan["prefill"]


def _poison_keys(triple, start):
    """The storage triple with the scales of keys >= start set to NaN."""
    packed, scales, biases = (np.array(a) for a in triple)
    nan = 0x7FC0 if scales.dtype == np.uint16 else np.nan
    scales[:, :, start:] = nan
    return packed, scales, biases


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_causal_tiles_past_the_diagonal_are_not_read(emu, rng, mode):
    # 96 queries, 2 heads per KV head: 12 row tiles of 8 positions. Keys >= 64
    # get NaN scales; row tiles whose last query is < 64 stop before them.
    case = Case(rng, Hq=2, Hkv=1, L=96, N=96, Dk=64, bits=4, group_size=64)
    clean, _ = case.run(emu, mask="causal", mode=mode, min_block_keys=32)
    case.k_np, case.v_np = _poison_keys(case.k_np, 64), _poison_keys(case.v_np, 64)
    dirty, _ = run_sdpa(
        emu,
        case.q_np,
        "f32",
        case.k_np,
        case.v_np,
        "f32",
        scale=64**-0.5,
        bits=4,
        group_size=64,
        mask="causal",
        mode=MODES[mode],
        min_block_keys=32,
    )
    assert np.isfinite(dirty[:, :, :64]).all()
    np.testing.assert_array_equal(dirty[:, :, :64], clean[:, :, :64])


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_masked_tiles_are_not_read(emu, rng, mode):
    # A key-padding mask: keys past each batch entry's length are hidden from
    # every query, and whole hidden 32-key tiles get NaN scales: a read of any
    # of them would make NaN scores (additive -inf + NaN).
    B, Hq, L, N = 2, 8, 20, 130
    case = Case(rng, B=B, Hq=Hq, Hkv=2, L=L, N=N, Dk=64, bits=8, group_size=64)
    lengths = np.array([40, 97])
    add = np.where(np.arange(N)[None, :] < lengths[:, None], 0.0, -np.inf).astype(np.float32)[
        :, None, None, :
    ]
    for b, n in enumerate(lengths):
        start = -(-n // 32) * 32
        for triple in (case.k_np, case.v_np):
            triple[1][b, :, start:] = np.nan
    case.run(emu, mask=mx.array(add), mask_np=add, mask_tag="f32", mode=mode, min_block_keys=32)


# --- every kernel instance ---------------------------------------------------------------------


@pytest.mark.parametrize("q_dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dims", [(64, 96), (192, 256)])
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_every_instantiation(emu, rng, q_dtype, bits, dims, mode):
    """Each (kernel, q dtype, bits, head-dim class) runs at least once; decode
    with several blocks, so each merge kernel runs too."""
    Dk, Dv = dims
    case = Case(
        rng,
        Hq=2,
        Hkv=1,
        L=2,
        N=70,
        Dk=Dk,
        Dv=Dv,
        bits=bits,
        group_size=32,
        q_dtype=q_dtype,
        kv_dtype=q_dtype,
    )
    _, plan = run_case(emu, case, rng, "bool_keypad", True, mode=mode, min_block_keys=32)
    dmax = 128 if max(Dk, Dv) <= 128 else 512
    assert plan["kernel"] == f"mlxq_qsdpa_{mode}_{q_dtype}_b{bits}_d{dmax}"
    assert plan["merge"] == (mode == "decode")


def test_every_kernel_is_reachable_from_the_plan(metal_emu):
    """The kernels in the build are exactly those the grid arithmetic names."""
    names = set()
    widths = [(b, b) for b in BITS] + [(8, 4), (4, 8)]
    for q, (kb, vb), dims, mode in itertools.product(
        DT, widths, [(64, 64), (512, 64)], ["decode", "prefill"]
    ):
        p = mlxq._ext._metal_plan_sdpa(
            dict(
                B=1,
                Hq=1,
                Hkv=1,
                L=1,
                N=100,
                Dk=dims[0],
                Dv=dims[1],
                bits=kb,
                v_bits=vb,
                group_size=32,
                q_dtype=DT[q],
                mode=MODES[mode],
                target_threadgroups=10**6,
                min_block_keys=32,
            )
        )
        names.add(p["kernel"])
        if p["merge"]:
            names.add(p["merge_kernel"])
    for item, bits in itertools.product([1, 2, 4, 8], BITS):
        names.add(mlxq._ext._metal_plan_ring_update(dict(itemsize=item))["kernel"])
        names.add(mlxq._ext._metal_plan_copy4d(dict(itemsize=item))["kernel"])
        for dt in DT.values():
            names.add(
                mlxq._ext._metal_plan_quantized_ring_update(dict(bits=bits, dtype=dt))["kernel"]
            )
            names.add(
                mlxq._ext._metal_plan_dequantize_into(dict(bits=bits, out_dtype=dt))["kernel"]
            )
    names.add(mlxq._ext._metal_plan_fill(dict(n_words=1))["kernel"])
    assert set(metal_emu.kernels()) == names


# --- random combinations ---------------------------------------------------------------------


def random_config(seed):
    r = np.random.default_rng(seed)
    gs = int(r.choice(GROUP_SIZES))
    dims = [d for d in (32, 64, 96, 128, 192, 256, 384, 512) if d % gs == 0]
    Hkv = int(r.choice([1, 2, 3]))
    return dict(
        bits=int(r.choice(BITS)),
        group_size=gs,
        Dk=int(r.choice(dims)),
        Dv=int(r.choice(dims)),
        B=int(r.integers(1, 3)),
        Hkv=Hkv,
        Hq=Hkv * int(r.choice([1, 2, 3, 4, 8])),
        L=int(r.choice([1, 1, 2, 4, 17, 31])),
        N=int(r.choice([1, 5, 32, 33, 100, 250])),
        q_dtype=str(r.choice(list(DT))),
        kv_dtype=str(r.choice(list(DT))),
        mask=str(
            r.choice(["none", "causal", "bool_BHLN", "bool_keypad", "add_bf16", "bool_window"])
        ),
        sinks=bool(r.random() < 0.5),
        extra=int(r.choice([0, 0, 13])),
        pad=bool(r.random() < 0.25),
        q_layout=str(r.choice(["contiguous", "contiguous", "transposed", "strided_last"])),
        mode=str(r.choice(["auto", "decode", "prefill"])),
        min_block_keys=int(r.choice([32, 64])),
    )


@pytest.mark.parametrize("seed", range(24))
def test_random_configurations(emu, rng, seed):
    c = random_config(seed)
    case = Case(
        rng,
        B=c["B"],
        Hq=c["Hq"],
        Hkv=c["Hkv"],
        L=c["L"],
        N=c["N"],
        Dk=c["Dk"],
        Dv=c["Dv"],
        bits=c["bits"],
        group_size=c["group_size"],
        q_dtype=c["q_dtype"],
        kv_dtype=c["kv_dtype"],
        kv_extra_rows=c["extra"],
        kv_pad_cols=c["pad"],
        q_layout=c["q_layout"],
    )
    run_case(
        emu, case, rng, c["mask"], c["sinks"], mode=c["mode"], min_block_keys=c["min_block_keys"]
    )
