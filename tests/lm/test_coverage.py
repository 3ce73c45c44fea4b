"""A representative subset of the coverage matrix (bench/e2e/coverage.py), in CI.

Each model is one of mlx-lm's own classes, built with random float32
weights by coverage.py's builder (small configs of the families, head dims
64), and runs coverage.py's greedy ``generate_step`` (24 prompt tokens, 8
new) unquantized and with mlxq enabled at ``kv_bits=4`` and ``kv_bits=8``:

* quantized: after generation every attention cache is one of mlxq's
  quantized caches, except those the family keeps exact by role
  (mlxq.mlx_lm.families); state caches are left alone;
* kv8 greedy tokens against unquantized: reported (``-s`` prints them);
* refused: ``generate_step``, ``make_prompt_cache`` and ``BatchGenerator``
  raise a ValueError naming the model type before the first model call.

The families: llama (plain caches), gemma3_text (sliding-window rings),
qwen3_next (hybrid: SSM state and attention), falcon_h1 (``CacheList``),
llama4 (``ChunkedKVCache``), afm7 (KV reuse: its last layer exact),
gemma2 (refused: softcapping), deepseek_v3 (MLA latent caches: asserted
where mlxq's caches take ``latent``).
"""

import importlib.util
import inspect
import pathlib

import mlx.core as mx
import pytest
from mlx_lm.models import cache as lm_cache
from support.caches import assert_same

import mlxq
import mlxq.mlx_lm as mlxq_lm
from mlxq.mlx_lm import families

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _coverage_module():
    spec = importlib.util.spec_from_file_location(
        "mlxq_bench_coverage", ROOT / "bench" / "e2e" / "coverage.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cov = _coverage_module()

_DENSE = dict(
    hidden_size=256,
    num_hidden_layers=2,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    rms_norm_eps=1e-5,
    vocab_size=256,
    rope_theta=10000.0,
)

# Entries as coverage.py takes them (mlx-lm's tests/test_models.py configs,
# shrunk to a few layers and head dims of 64).
MODELS = {
    "llama": dict(_DENSE, model_type="llama", tie_word_embeddings=True),
    "gemma3_text": dict(
        _DENSE,
        model_type="gemma3_text",
        num_hidden_layers=4,
        num_key_value_heads=1,
        query_pre_attn_scalar=64,
        rope_local_base_freq=10000.0,
        sliding_window=8,
        sliding_window_pattern=2,
        max_position_embeddings=1024,
        rope_scaling=None,
    ),
    "qwen3_next": dict(
        _DENSE,
        model_type="qwen3_next",
        num_hidden_layers=4,
        full_attention_interval=2,
        linear_num_value_heads=4,
        linear_num_key_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=3,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        shared_expert_intermediate_size=128,
        mlp_only_layers=[0],
        moe_intermediate_size=128,
        partial_rotary_factor=0.5,
        max_position_embeddings=1024,
        norm_topk_prob=False,
        tie_word_embeddings=False,
        attention_bias=False,
        rope_scaling=None,
    ),
    "falcon_h1": dict(
        _DENSE,
        model_type="falcon_h1",
        attention_bias=False,
        mamba_chunk_size=16,
        mamba_conv_bias=True,
        mamba_d_conv=4,
        mamba_d_head=32,
        mamba_d_ssm=128,
        mamba_d_state=16,
        mamba_expand=2,
        mamba_n_groups=1,
        mamba_n_heads=4,
        mamba_norm_before_gate=False,
        mamba_proj_bias=False,
        mamba_rms_norm=False,
        mamba_use_mlp=True,
        max_position_embeddings=1024,
        mlp_bias=False,
        projectors_bias=False,
        rope_traditional=False,
        rope_scaling=None,
        tie_word_embeddings=True,
    ),
    "llama4": dict(
        model_type="llama4",
        text_config=dict(
            _DENSE,
            model_type="llama4",
            num_hidden_layers=4,  # every 4th layer global, the others chunked
            attention_bias=False,
            attention_chunk_size=8,
            interleave_moe_layer_step=2,
            intermediate_size_mlp=256,
            max_position_embeddings=1024,
            num_experts_per_tok=1,
            num_local_experts=2,
            rope_scaling=None,
            use_qk_norm=True,
            attn_temperature_tuning=4,
            floor_scale=8192,
            attn_scale=0.1,
        ),
    ),
    "afm7": dict(
        model_type="afm7",
        vocab_size=256,
        hidden_dim=256,
        num_layers=4,
        num_kv_reuse_layers=2,
        num_heads=4,
        num_kv_heads=2,
        hidden_dim_scale_factor=2.0,
        rope_theta=50000,
        rms_norm_eps=1e-5,
    ),
    "gemma2": dict(
        _DENSE,
        model_type="gemma2",
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        query_pre_attn_scalar=64.0,
        rope_traditional=False,
    ),
    "deepseek_v3": dict(
        _DENSE,
        model_type="deepseek_v3",
        moe_intermediate_size=128,
        n_shared_experts=1,
        n_routed_experts=4,
        routed_scaling_factor=1.0,
        kv_lora_rank=128,
        q_lora_rank=64,
        qk_rope_head_dim=64,
        v_head_dim=64,
        qk_nope_head_dim=64,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        norm_topk_prob=True,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
        moe_layer_freq=1,
        first_k_dense_replace=0,
        max_position_embeddings=2048,
        rope_scaling=None,
        attention_bias=False,
    ),
}
VOCAB = 256
QUANTIZED = ["llama", "gemma3_text", "qwen3_next", "falcon_h1", "llama4", "afm7"]

_models = {}


def model_of(name):
    if name not in _models:
        entry = {"module": f"mlx_lm.models.{name}", "model_type": name, "args": MODELS[name]}
        _models[name] = cov.build(entry, 1)
    return _models[name]


@pytest.fixture
def enabled():
    mlxq_lm.enable()
    yield
    mlxq_lm.disable()


def _reference(name, logprobs=None):
    model = model_of(name)
    mlxq_lm.disable()
    tokens, cache = cov.generate(model, VOCAB, logprobs=logprobs)
    assert all(d >= 64 for d in cov.head_dims(cache) if d), cov.head_dims(cache)
    return model, tokens


def _assert_quantized(name, row):
    assert row["result"] == "quantized", (name, row)
    exact = row.get("exact_by_role", 0)
    assert exact == (1 if name == "afm7" else 0), (name, row)


@pytest.mark.parametrize("name", QUANTIZED)
def test_quantized_and_kv8_tokens(name, device):
    ref_lp, kv8_lp = [], []
    model, ref = _reference(name, ref_lp)
    with mlxq_lm.enabled():
        kv4 = cov.classify(lambda: cov.generate(model, VOCAB, 4))
        kv8 = cov.classify(lambda: cov.generate(model, VOCAB, 8, logprobs=kv8_lp))
    _assert_quantized(name, kv4)
    _assert_quantized(name, kv8)
    agree = sum(a == b for a, b in zip(kv8["tokens"], ref))
    print(f"{name}: kv8 greedy tokens equal to unquantized at {agree}/{len(ref)} positions")
    # Random weights have near ties: kv8 may part from the unquantized run
    # only where the reference's top two are closer than twice the largest
    # log-probability change 8-bit KV made at that step (on CUDA, MLX's f32
    # matmuls round as TF32 and move more ties), and that change is small.
    parted = cov.first_disagreement(ref, ref_lp, kv8["tokens"], kv8_lp)
    if parted is not None:
        assert parted["near_tie"] and parted["max_logprob_change"] < 0.5, (name, parted)


def test_cache_kinds(enabled):
    """falcon_h1's CacheList keeps its state cache and quantizes its KV
    member; llama4's chunked layers become ChunkedQuantizedKVCache."""
    cache = mlxq_lm.make_prompt_cache(model_of("falcon_h1"), kv_bits=4)
    for c in cache:
        state, kv = c.caches
        assert type(state) is lm_cache.ArraysCache
        assert type(kv) is mlxq.QuantizedKVCache and (kv.bits, kv.v_bits) == (8, 4)  # the recipe
    cache = mlxq_lm.make_prompt_cache(model_of("llama4"), kv_bits=4)
    kinds = [type(c).__name__ for c in cache]
    assert kinds == ["ChunkedQuantizedKVCache"] * 3 + ["QuantizedKVCache"], kinds
    assert cache[0].chunk_size == 8
    cache = mlxq_lm.make_prompt_cache(model_of("afm7"), kv_bits=4)
    assert [hasattr(c, "bits") for c in cache] == [True, False]  # 2 layers + 2 reusing
    assert [families.role_of(c) for c in cache][-1] == families.EXACT


def _continue(model, cache, prompt, n=4):
    from mlx_lm.generate import generate_step

    return [int(t) for t, _ in generate_step(prompt, model, max_tokens=n, prompt_cache=cache)]


@pytest.mark.parametrize("saver", ["mlx_lm", "mlxq"])
def test_cache_list_prompt_cache_files(enabled, tmp_path, saver):
    """A CacheList with quantized members goes through prompt-cache files and
    continues as the cache it was saved from."""
    model = model_of("falcon_h1")
    prompt = mx.array([3, 1, 4, 1, 5, 9, 2, 6])
    cache = mlxq_lm.make_prompt_cache(model, kv_bits=8)
    _continue(model, cache, prompt)
    path = str(tmp_path / "falcon.safetensors")
    save = lm_cache.save_prompt_cache if saver == "mlx_lm" else mlxq.save_prompt_cache
    load = lm_cache.load_prompt_cache if saver == "mlx_lm" else mlxq.load_prompt_cache
    save(path, cache)
    loaded = load(path)
    for a, b in zip(cache, loaded):
        assert a.caches[1].offset == b.caches[1].offset
        assert_same(a.caches[1].keys_and_values(), b.caches[1].keys_and_values(), "members")
    nxt = mx.array([7])
    assert _continue(model, loaded, nxt) == _continue(model, cache, nxt)


def test_chunked_prompt_cache_files(enabled, tmp_path, monkeypatch):
    """llama4's quantized chunked caches load with mlxq's loader (which
    mlx-lm's name is while enabled), and with mlx-lm's own where its cache
    module has ChunkedQuantizedKVCache registered (enable() does)."""
    from mlxq.mlx_lm.originals import original

    model = model_of("llama4")
    cache = mlxq_lm.make_prompt_cache(model, kv_bits=8)
    _continue(model, cache, mx.array(list(range(3, 23))))
    path = str(tmp_path / "llama4.safetensors")
    mlxq.save_prompt_cache(path, cache)
    stock = original("load_prompt_cache")
    monkeypatch.delattr(lm_cache, "ChunkedQuantizedKVCache", raising=False)
    with pytest.raises(KeyError, match="ChunkedQuantizedKVCache"):
        stock(path)
    monkeypatch.setattr(
        lm_cache, "ChunkedQuantizedKVCache", mlxq.ChunkedQuantizedKVCache, raising=False
    )
    # (mlx-lm's own loader gives the last, global layer mlx-lm's own class.)
    theirs = stock(path)
    assert [type(c) for c in theirs[:3]] == [mlxq.ChunkedQuantizedKVCache] * 3
    loaded = mlxq.load_prompt_cache(path)
    assert [type(c) for c in loaded] == [type(c) for c in cache]
    assert [type(c) for c in lm_cache.load_prompt_cache(path)] == [type(c) for c in cache]
    nxt = mx.array([7])
    assert _continue(model, loaded, nxt) == _continue(model, cache, nxt)


def test_chunked_caches_are_not_batched(enabled):
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model_of("llama4"), kv_bits=4, max_tokens=2)
    with pytest.raises(ValueError, match="chunked"):
        gen.insert([[1, 2, 3], [4, 5]])
        while gen.next():
            pass


def _refuses(monkeypatch, name, match):
    """Every entry point raises before the model runs."""
    from mlx_lm.generate import BatchGenerator, generate_step

    model = model_of(name)

    def no_call(*args, **kwargs):
        raise AssertionError(f"{name} ran before the refusal")

    monkeypatch.setattr(type(model), "__call__", no_call)
    prompt = mx.array([1, 2, 3])
    with pytest.raises(ValueError, match=match):
        next(generate_step(prompt, model, kv_bits=4, quantized_kv_start=0))
    with pytest.raises(ValueError, match=match):
        next(
            generate_step(prompt, model, kv_bits=8, prompt_cache=lm_cache.make_prompt_cache(model))
        )
    with pytest.raises(ValueError, match=match):
        lm_cache.make_prompt_cache(model, kv_bits=4)
    with pytest.raises(ValueError, match=match):
        BatchGenerator(model, kv_bits=4)
    monkeypatch.undo()


def test_gemma2_is_refused(enabled, monkeypatch):
    _refuses(monkeypatch, "gemma2", r"gemma2 computes softcapped attention .*without kv_bits")
    # Without kv_bits it is mlx-lm's, untouched.
    assert len(cov.generate(model_of("gemma2"), VOCAB)[0]) == cov.NEW


def _latent_supported():
    return "latent" in inspect.signature(mlxq.QuantizedKVCache.__init__).parameters


def test_deepseek_v3_latent(monkeypatch, enabled):
    if not families.latent_supported():
        _refuses(monkeypatch, "deepseek_v3", r"deepseek_v3 keeps an MLA latent cache")
    if not _latent_supported():
        pytest.skip("mlxq's QuantizedKVCache has no latent parameter (MLA latent caches)")
    model, ref = _reference("deepseek_v3")
    with mlxq_lm.enabled():
        kv4 = cov.classify(lambda: cov.generate(model, VOCAB, 4))
        kv8 = cov.classify(lambda: cov.generate(model, VOCAB, 8))
    _assert_quantized("deepseek_v3", kv4)
    _assert_quantized("deepseek_v3", kv8)
    agree = sum(a == b for a, b in zip(kv8["tokens"], ref))
    print(f"deepseek_v3: kv8 greedy tokens equal to unquantized at {agree}/{len(ref)} positions")
    assert agree >= len(ref) // 2
