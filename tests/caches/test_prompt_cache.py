"""state / from_state / prompt-cache files, in both directions with mlx-lm.

After every round trip the loaded cache must hold the same state and keep
running in lockstep with the original.
"""

import mlx.core as mx
import pytest
from mlx.utils import tree_map
from mlx_lm.models import cache as lm
from support.caches import assert_same, fresh, kv

import mlxq

# (mlxq factory, mlx-lm factory, script of update sizes that fills/wraps)
KINDS = {
    "kv": (mlxq.KVCache, lm.KVCache, [40, 1, 1, 300, 1]),
    "quantized": (
        lambda: mlxq.QuantizedKVCache(32, 4),
        lambda: lm.QuantizedKVCache(32, 4),
        [7, 1, 1, 3],
    ),
    "rotating": (
        lambda: mlxq.RotatingKVCache(12, keep=2),
        lambda: lm.RotatingKVCache(12, keep=2),
        [9, 1, 1, 1, 1, 1, 5, 1, 1],
    ),
}


def copied(state):
    return tree_map(lambda x: mx.array(x) if isinstance(x, mx.array) else x, state)


def filled(make, rng, sizes, ref=None):
    cache = make()
    for T in sizes:
        k, v = kv(rng, T)
        cache.update_and_fetch(k, v)
        if ref is not None:
            ref.update_and_fetch(fresh(k), fresh(v))
    return cache


def lockstep(rng, a, b, sizes=(1, 1, 4, 1)):
    for T in sizes:
        k, v = kv(rng, T)
        assert_same(a.update_and_fetch(k, v), b.update_and_fetch(fresh(k), fresh(v)), f"T={T}")
        assert a.offset == b.offset


@pytest.mark.parametrize("kind", list(KINDS))
def test_state_round_trips_with_mlx_lm(rng, kind):
    ours_make, lm_make, sizes = KINDS[kind]
    ref = lm_make()
    ours = filled(ours_make, rng, sizes, ref)
    assert_same(ours.state, ref.state, "state")
    assert ours.meta_state == tuple(str(x) for x in ours.state[2:])
    # mlxq -> mlx-lm and mlx-lm -> mlxq, then both keep going together. (Copies:
    # mlx-lm writes into its buffers' array objects, which a shared state would alias.)
    theirs = type(ref).from_state(copied(ours.state))
    back = type(ours).from_state(copied(ref.state))
    assert type(back) is type(ours)
    lockstep(rng, theirs, ref)
    lockstep(rng, back, ours)


def test_rotating_quantized_state_round_trip(rng):
    make = lambda: mlxq.RotatingQuantizedKVCache(10, 1, 64, 6)  # noqa: E731
    cache = filled(make, rng, [8, 1, 1, 1, 1, 4, 1])
    copy = mlxq.RotatingQuantizedKVCache.from_state(cache.state)
    assert (copy.max_size, copy.keep, copy.group_size, copy.bits) == (10, 1, 64, 6)
    assert copy.ring_index == cache.ring_index and copy.offset == cache.offset
    lockstep(rng, copy, cache)
    meta = cache.meta_state
    other = make()
    other.meta_state = meta
    assert other.offset == cache.offset and other.ring_index == cache.ring_index


def test_our_files_load_in_mlx_lm(rng, tmp_path):
    refs = [lm_make() for _, lm_make, _ in KINDS.values()]
    ours = [filled(make, rng, sizes, ref) for (make, _, sizes), ref in zip(KINDS.values(), refs)]
    path = str(tmp_path / "ours.safetensors")
    mlxq.save_prompt_cache(path, ours, {"model": "test", "tokens": "42"})
    loaded, meta = lm.load_prompt_cache(path, return_metadata=True)
    assert meta == {"model": "test", "tokens": "42"}
    for got, ref in zip(loaded, refs):
        assert type(got) is type(ref)
        assert_same(got.state, ref.state)
        lockstep(rng, got, ref)


def test_mlx_lm_files_load_in_mlxq(rng, tmp_path):
    refs = [lm_make() for _, lm_make, _ in KINDS.values()]
    ours = [filled(make, rng, sizes, ref) for (make, _, sizes), ref in zip(KINDS.values(), refs)]
    path = str(tmp_path / "mlx_lm.safetensors")
    lm.save_prompt_cache(path, refs, {"note": "from mlx-lm"})
    loaded, meta = mlxq.load_prompt_cache(path, return_metadata=True)
    assert meta == {"note": "from mlx-lm"}
    for got, want in zip(loaded, ours):
        assert type(got) is type(want)
        assert_same(got.state, want.state)
        lockstep(rng, got, want)


def test_own_round_trip_with_every_class(rng, tmp_path):
    caches = [
        filled(mlxq.KVCache, rng, [3]),
        filled(lambda: mlxq.QuantizedKVCache(64, 8), rng, [5, 1]),
        filled(lambda: mlxq.RotatingKVCache(6), rng, [4, 1, 1, 1, 1]),
        filled(lambda: mlxq.RotatingQuantizedKVCache(6, 2, 128, 3), rng, [7, 1, 1]),
        mlxq.KVCache(),  # empty: keys/values None
        lm.ArraysCache(2),  # another mlx-lm class rides along
    ]
    caches[-1][0] = mx.ones((1, 3))
    path = str(tmp_path / "all.safetensors")
    mlxq.save_prompt_cache(path, caches)
    loaded = mlxq.load_prompt_cache(path)
    assert [type(c) for c in loaded] == [type(c) for c in caches]
    for got, want in zip(loaded[:4], caches[:4]):
        assert_same(got.state, want.state)
        lockstep(rng, got, want)
    assert loaded[4].empty() and loaded[4].offset == 0
    assert_same(loaded[5][0], mx.ones((1, 3)))


@pytest.mark.parametrize(
    "make",
    [
        lambda: mlxq.QuantizedKVCache(64, 4, hadamard=True),
        lambda: mlxq.QuantizedKVCache(64, 8, v_bits=4, v_group_size=32),
        lambda: mlxq.ChunkedQuantizedKVCache(8, 64, 4),
    ],
    ids=["hadamard", "v_bits", "chunked"],
)
def test_cache_list_members_keep_their_format(rng, tmp_path, make):
    """mlx-lm's CacheList rebuilds members by mlx-lm's classes; mlxq's loader
    builds them as mlxq's, with the format they were saved in."""
    member = filled(make, rng, [5, 1])
    state = lm.ArraysCache(1)
    state[0] = mx.ones((1, 3))
    path = str(tmp_path / "list.safetensors")
    mlxq.save_prompt_cache(path, [lm.CacheList(state, member)])
    (loaded,) = mlxq.load_prompt_cache(path)
    assert type(loaded) is lm.CacheList and type(loaded.caches[0]) is lm.ArraysCache
    got = loaded.caches[1]
    assert type(got) is type(member) and got.format == member.format
    assert_same(got.state, member.state)
    lockstep(rng, got, member)


@pytest.mark.parametrize(
    "make",
    [
        lambda: mlxq.QuantizedKVCache(64, 4, hadamard=True),
        lambda: mlxq.QuantizedKVCache(64, 8, v_bits=4, v_group_size=32),
        lambda: mlxq.QuantizedKVCache(64, 4, latent=True),
        lambda: mlxq.ChunkedQuantizedKVCache(8, 64, 4),
    ],
    ids=["hadamard", "v_bits", "latent", "chunked"],
)
@pytest.mark.parametrize("saver", ["mlxq", "mlx_lm"])
def test_mlx_lms_loader_reads_every_format_while_enabled(rng, tmp_path, make, saver):
    """While mlxq is enabled, mlx-lm's load_prompt_cache (so mlx-lm's
    generate and server) is mlxq's: files of formats only mlxq stores load
    with their format, whichever saver wrote them; disable() puts mlx-lm's
    loader back."""
    import mlxq.mlx_lm as mlxq_lm

    cache = filled(make, rng, [5, 1])
    path = str(tmp_path / "f.safetensors")
    (mlxq.save_prompt_cache if saver == "mlxq" else lm.save_prompt_cache)(path, [cache])
    stock = lm.load_prompt_cache
    with mlxq_lm.enabled():
        (got,), meta = lm.load_prompt_cache(path, return_metadata=True)
    assert lm.load_prompt_cache is stock
    assert type(got) is type(cache) and got.format == cache.format
    assert_same(got.state, cache.state)
    lockstep(rng, got, cache)


def test_loader_rejects_bad_files(tmp_path):
    path = str(tmp_path / "plain.safetensors")
    mx.save_safetensors(path, {"x": mx.ones(2)})
    with pytest.raises(ValueError, match="not a prompt-cache file"):
        mlxq.load_prompt_cache(path)
    mlxq.save_prompt_cache(path, [mlxq.KVCache()])
    arrays, meta = mx.load(path, return_metadata=True)
    meta["1.0"] = "NoSuchCache"
    mx.save_safetensors(path, arrays, meta)
    with pytest.raises(ValueError, match="unknown cache class 'NoSuchCache'"):
        mlxq.load_prompt_cache(path)
