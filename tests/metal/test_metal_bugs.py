"""The harness can fail: kernels with a planted bug must be caught.

Each bug is compiled into the real kernel source with a -D flag (hooks in
metal/qsdpa.h and metal/ring_update.metal; never defined in a real build):
  MQ_BUG_DROP_BARRIER  the barrier between staging V and reading it is gone
                         (a race: SIMD groups read rows others have not
                         staged yet -- stale K codes);
  MQ_BUG_LANE_INDEX    each lane unpacks its neighbour's element;
  MQ_BUG_RINT          codes round half to even instead of away from zero.
The same checks as the real tests are run on the buggy build and must fail,
while the unmodified build passes them.
"""

import os

import numpy as np
import pytest
from emu import METAL_DIR, Emulator, build
from harness import run_quantized_ring_update
from mlx_oracle import build_oracle, metal_quantize_model, mlx_metal_quantize
from sdpa_cases import Case


def bug_build(define, source):
    return Emulator(
        build([os.path.join(METAL_DIR, source)], defines=[define, "MQ_ONLY_F32"], name="bug")
    )


@pytest.fixture(scope="module")
def drop_barrier():
    return bug_build("MQ_BUG_DROP_BARRIER", "qsdpa_decode.metal")


@pytest.fixture(scope="module")
def lane_index():
    return bug_build("MQ_BUG_LANE_INDEX", "qsdpa_prefill.metal")


@pytest.fixture(scope="module")
def rint_bug():
    return bug_build("MQ_BUG_RINT", "ring_update.metal")


def sdpa_check(e, mode, seed=0):
    """The equivalence check of test_metal_sdpa: 8 query heads on one KV head
    (8 SIMD groups share each staged tile), K/V rows staged word by word."""
    rng = np.random.default_rng(seed)
    case = Case(
        rng,
        Hq=8,
        Hkv=1,
        L=1 if mode == "decode" else 2,
        N=200,
        Dk=128,
        bits=4,
        group_size=64,
        kv_pad_cols=True,
    )
    case.run(e, mask="causal", mode=mode, min_block_keys=32)


@pytest.mark.slow
def test_sdpa_checks_pass_on_the_real_kernels(metal_emu):
    for name in ("default", "reverse", "random"):
        metal_emu.set_schedule(name)
        sdpa_check(metal_emu, "decode")
        sdpa_check(metal_emu, "prefill")
    metal_emu.set_schedule("default")


@pytest.mark.slow
def test_dropped_barrier_is_caught(drop_barrier):
    """A race: whether it shows depends on the thread order, which is why the
    suite runs every kernel under three schedules. In the default order the
    threads that stage a row run before the SIMD groups that read it, so the
    race stays hidden; the reverse and random orders expose it."""
    caught = {}
    for name in ("default", "reverse", "random"):
        for seed in range(3):
            drop_barrier.set_schedule(name, seed=seed)
            try:
                sdpa_check(drop_barrier, "decode", seed)
                caught[name, seed] = False
            except AssertionError as e:
                assert "relative error" in str(e)
                caught[name, seed] = True
    drop_barrier.set_schedule("default")
    assert all(caught[name, seed] for name in ("reverse", "random") for seed in range(3)), caught


@pytest.mark.slow
def test_wrong_index_is_caught(lane_index, schedule):
    lane_index.set_schedule(schedule)
    with pytest.raises(AssertionError, match="relative error"):
        sdpa_check(lane_index, "prefill")
    lane_index.set_schedule("default")


@pytest.mark.slow
def test_round_half_to_even_is_caught(rint_bug, metal_emu):
    oracle = build_oracle()
    x = np.resize(np.array([0.0, 3.0, 0.5, 2.5, 1.5, 1.0], np.float32), (1, 1, 1, 64))
    want = mlx_metal_quantize(oracle, x, 32, 2, "f32")
    assert [
        np.array_equal(a, b) for a, b in zip(want, metal_quantize_model(x, 32, 2, "f32")[:3])
    ] == [True] * 3
    for e, ok in ((metal_emu, True), (rint_bug, False)):
        buf = [
            np.zeros((1, 1, 1, 4), np.uint32),
            np.zeros((1, 1, 1, 2), np.float32),
            np.zeros((1, 1, 1, 2), np.float32),
        ]
        run_quantized_ring_update(e, buf, x, 0, group_size=32, bits=2, tag="f32")
        assert np.array_equal(buf[0], want[0]) == ok
