"""Random-weight models built from mlx-lm's own model classes, and a byte tokenizer.

They let the mlx-lm integration, the ``python -m mlxq.generate`` command and
the end-to-end benchmark run with no downloads: the architecture code is
mlx-lm's (``mlx_lm.models.<arch>.Model``), only the weights are random.

>>> from mlxq.random_models import random_model
>>> model, tokenizer = random_model("gemma3", size="tiny")
"""

import copy
from typing import Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

ARCHITECTURES = ("llama", "qwen3", "gemma3", "gpt_oss", "gemma4", "qwen2", "deepseek_v3")

# Shared by every size: the attention shapes that mlxq's fast paths cover
# (head dim a multiple of the KV group size), GQA 4 where the size allows.
_SIZES: Dict[str, Dict[str, dict]] = {
    # Tests: a few layers and a 256-token vocabulary, fast on two CPU cores.
    "tiny": {
        "llama": dict(
            hidden_size=256,
            num_hidden_layers=4,
            intermediate_size=512,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=64,
        ),
        "qwen3": dict(
            hidden_size=256,
            num_hidden_layers=4,
            intermediate_size=512,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=64,
        ),
        "gemma3": dict(
            hidden_size=256,
            num_hidden_layers=4,
            intermediate_size=512,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=64,
            sliding_window=32,
            sliding_window_pattern=2,
        ),
        "gpt_oss": dict(
            hidden_size=256,
            num_hidden_layers=4,
            intermediate_size=256,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=64,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=32,
        ),
        "gemma4": dict(
            hidden_size=256,
            num_hidden_layers=6,
            intermediate_size=512,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=64,
            global_head_dim=128,
            num_kv_shared_layers=2,
            hidden_size_per_layer_input=0,
            sliding_window=32,
            sliding_window_pattern=3,
            use_double_wide_mlp=False,
        ),
        # Qwen 2's head dim is hidden_size / heads: 4 heads of 64 over 2 KV heads.
        "qwen2": dict(
            hidden_size=256,
            num_hidden_layers=4,
            intermediate_size=512,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
        "deepseek_v3": dict(
            hidden_size=256,
            num_hidden_layers=2,
            intermediate_size=512,
            num_attention_heads=4,
            q_lora_rank=128,
        ),
    },
    # Benchmarks: a small real model's attention (hidden 1024, 8 query heads
    # over 2 KV heads of dim 128, GQA 4) and a 32k vocabulary.
    "small": {
        "llama": dict(
            hidden_size=1024,
            num_hidden_layers=12,
            intermediate_size=2816,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=128,
            vocab_size=32000,
        ),
        "qwen3": dict(
            hidden_size=1024,
            num_hidden_layers=12,
            intermediate_size=2816,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=128,
            vocab_size=32000,
        ),
        "gemma3": dict(
            hidden_size=1024,
            num_hidden_layers=12,
            intermediate_size=2816,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=128,
            sliding_window=512,
            sliding_window_pattern=6,
            vocab_size=32000,
        ),
        "gpt_oss": dict(
            hidden_size=1024,
            num_hidden_layers=12,
            intermediate_size=1024,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=128,
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=128,
            vocab_size=32000,
        ),
        "gemma4": dict(
            hidden_size=1024,
            num_hidden_layers=12,
            intermediate_size=2816,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=128,
            global_head_dim=256,
            num_kv_shared_layers=4,
            hidden_size_per_layer_input=0,
            sliding_window=512,
            sliding_window_pattern=6,
            use_double_wide_mlp=False,
            vocab_size=32000,
        ),
        "qwen2": dict(
            hidden_size=1024,
            num_hidden_layers=12,
            intermediate_size=2816,
            num_attention_heads=8,
            num_key_value_heads=2,
            vocab_size=32000,
        ),
        # DeepSeek-V2-Lite's attention (16 heads) at DeepSeek-V3's dims.
        "deepseek_v3": dict(
            hidden_size=2048,
            num_hidden_layers=4,
            intermediate_size=2048,
            num_attention_heads=16,
            q_lora_rank=None,
            vocab_size=32000,
        ),
    },
}

_COMMON = {
    "llama": dict(
        model_type="llama",
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        max_position_embeddings=131072,
    ),
    "qwen3": dict(
        model_type="qwen3",
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        max_position_embeddings=40960,
    ),
    "gemma3": dict(
        model_type="gemma3_text",
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        query_pre_attn_scalar=64,
        max_position_embeddings=32768,
    ),
    "gpt_oss": dict(model_type="gpt_oss", rms_norm_eps=1e-5, rope_theta=150000),
    "gemma4": dict(
        model_type="gemma4_text",
        rms_norm_eps=1e-6,
        max_position_embeddings=131072,
        final_logit_softcapping=30.0,
    ),
    "qwen2": dict(
        model_type="qwen2",
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
    ),
    "deepseek_v3": dict(
        # DeepSeek-V3's attention dims (MLA); every layer a dense MLP.
        model_type="deepseek_v3",
        num_key_value_heads=1,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        moe_intermediate_size=256,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1000,
        rope_theta=10000.0,
        max_position_embeddings=163840,
        rms_norm_eps=1e-6,
    ),
}

_MODULES = {
    "llama": "llama",
    "qwen3": "qwen3",
    "gemma3": "gemma3_text",
    "gpt_oss": "gpt_oss",
    "gemma4": "gemma4_text",
    "qwen2": "qwen2",
    "deepseek_v3": "deepseek_v3",
}


class ByteTokenizer:
    """A byte-level tokenizer: token ``i < 256`` is byte ``i``.

    Enough of the Hugging Face tokenizer interface for mlx-lm's
    ``TokenizerWrapper``, ``stream_generate`` and ``generate``. Ids at or
    above 256 (a model's vocabulary may be larger) decode to nothing. There
    is no end-of-sequence token by default, so generation with random
    weights always runs to ``max_tokens``.
    """

    chat_template = None
    bos_token = None
    bos_token_id = None
    pad_token = None

    def __init__(self, vocab_size: int = 256, eos_token_id: Optional[int] = None):
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.eos_token = None if eos_token_id is None else f"<{eos_token_id}>"

    def get_vocab(self) -> Dict[str, int]:
        return {f"<{i}>": i for i in range(self.vocab_size)}

    def encode(self, text: str, add_special_tokens: bool = True):
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens: bool = False, **kwargs) -> str:
        if isinstance(ids, int):
            ids = [ids]
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def convert_tokens_to_ids(self, token: str):
        vocab = self.get_vocab()
        return vocab.get(token)

    def apply_chat_template(self, messages, tokenize=True, **kwargs):
        text = "".join(m["content"] for m in messages)
        return self.encode(text) if tokenize else text


def model_args(arch: str, size: str = "tiny", **overrides):
    """mlx-lm's ``ModelArgs`` of ``arch`` at ``size``, with ``overrides``."""
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"[mlxq.random_models] unknown architecture {arch!r}; one of {ARCHITECTURES}."
        )
    if size not in _SIZES:
        raise ValueError(f"[mlxq.random_models] unknown size {size!r}; one of {tuple(_SIZES)}.")
    import importlib

    module = importlib.import_module(f"mlx_lm.models.{_MODULES[arch]}")
    config = dict(vocab_size=256)
    config.update(_COMMON[arch])
    config.update(copy.deepcopy(_SIZES[size][arch]))
    config.update(overrides)
    return module, module.ModelArgs.from_dict(config)


def random_model(
    arch: str,
    size: str = "tiny",
    *,
    seed: int = 0,
    dtype=None,
    **overrides,
) -> Tuple[nn.Module, "object"]:
    """A model of mlx-lm's ``arch`` class with random weights, and its tokenizer.

    Args:
        arch (str): ``"llama"``, ``"qwen3"``, ``"gemma3"`` (sliding-window
          layers), ``"gpt_oss"`` (sliding window, attention sinks, MoE),
          ``"gemma4"`` (sliding window, KV-shared layers) or ``"qwen2"``
          (the one of them with mlx-lm's pipeline sharding, ``model.model.pipeline``)
          or ``"deepseek_v3"`` (MLA: DeepSeek-V3's attention dims, dense MLPs).
        size (str): ``"tiny"`` (tests) or ``"small"`` (benchmarks).
        seed (int): Seed of the weights.
        dtype: Weight dtype. Default: bfloat16, as checkpoints run, except
          float32 for ``gpt_oss`` on the CPU (MLX's CPU ``gather_mm``, which
          its experts use, supports float32 only).
        overrides: ``ModelArgs`` fields to change.

    Returns:
        (model, tokenizer): the ``nn.Module`` (evaluated) and an mlx-lm
        ``TokenizerWrapper`` around :class:`ByteTokenizer`.
    """
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    module, args = model_args(arch, size, **overrides)
    mx.random.seed(seed)
    model = module.Model(args)
    _sane_init(arch, module, model)
    if dtype is None:
        cpu = mx.default_device().type == mx.cpu
        dtype = mx.float32 if arch == "gpt_oss" and cpu else mx.bfloat16
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    model.eval()
    tokenizer = TokenizerWrapper(ByteTokenizer())
    return model, tokenizer


def _sane_init(arch: str, module, model: nn.Module) -> None:
    """mlx-lm's own initialisation, with three changes that keep a random model's
    attention in a realistic regime (scores of order one, not near-one-hot):

    * attention sinks start at zero in mlx-lm (a no-op); they get random logits;
    * Gemma 3 norms scale by ``1 + weight`` and mlx-lm starts ``weight`` at one
      (a gain of 2 on every query and key); they start at zero (gain 1);
    * Gemma 4 attends with scale 1 after unit-gain query/key norms, so scores
      have a standard deviation of sqrt(head_dim); its query/key norm gains
      start at ``head_dim ** -0.25``, giving scores of unit spread.
    """
    for _, m in model.named_modules():
        if arch == "gemma3" and isinstance(m, module.RMSNorm):
            m.weight = mx.zeros_like(m.weight)
    for layer in model.layers:
        attn = getattr(layer, "self_attn", None)
        if attn is None:
            continue
        if hasattr(attn, "sinks"):
            attn.sinks = mx.random.normal(attn.sinks.shape)
        if arch == "gemma4":
            for name in ("q_norm", "k_norm"):
                norm = getattr(attn, name, None)
                if norm is not None and "weight" in norm:
                    norm.weight = norm.weight * norm.weight.shape[-1] ** -0.25


def _bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's printable stand-in character for each byte (byte-level BPE)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\u00a1"), ord("\u00ac") + 1))
        + list(range(ord("\u00ae"), ord("\u00ff") + 1))
    )
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def save_random_model(
    path: str, arch: str, size: str = "tiny", *, seed: int = 0, dtype=None, **overrides
) -> str:
    """Write a random model as an mlx-lm model directory that ``mlx_lm.load`` reads.

    ``config.json``, ``model.safetensors`` (and its index, as mlx-lm writes
    it, so that ``sharded_load`` can pipeline it) and a byte-level Hugging Face
    tokenizer (256 tokens, no merges; needs ``tokenizers`` and
    ``transformers``, which mlx-lm depends on). Returns ``path``.
    """
    import dataclasses
    import json
    import os

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model, _ = random_model(arch, size, seed=seed, dtype=dtype, **overrides)
    _, args = model_args(arch, size, **overrides)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(dataclasses.asdict(args), f, indent=2)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(os.path.join(path, "model.safetensors"), weights, {"format": "mlx"})
    # The weight map mlx-lm's own saves write: its sharded_load reads it to
    # fetch only a pipeline rank's files.
    index = {
        "metadata": {"total_size": sum(v.nbytes for v in weights.values())},
        "weight_map": {name: "model.safetensors" for name in weights},
    }
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
    byte_chars = _bytes_to_unicode()
    tokenizer = Tokenizer(models.BPE(vocab={byte_chars[b]: b for b in range(256)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(path)
    return path


def num_parameters(model: nn.Module) -> int:
    return sum(p.size for _, p in tree_flatten(model.parameters()))


__all__ = [
    "ARCHITECTURES",
    "ByteTokenizer",
    "model_args",
    "random_model",
    "save_random_model",
    "num_parameters",
]
