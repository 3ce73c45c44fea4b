"""What a KV setting costs a model: ``mlxq-fidelity`` / ``python -m mlxq.fidelity``.

For an mlx-lm model folder, a GGUF file or a packaged model
(``smollm2-135m``, ``gemma3-270m``), and any list of KV settings (see
:mod:`mlxq.kv_spec`), it measures against the unquantized model over a
text: perplexity, the mean and 99th-percentile KL divergence of the
next-token distribution, the top-1 flip rate and the KV bytes, and with
``per_layer`` each layer's sensitivity (one layer quantized at a time).

>>> from mlxq import fidelity
>>> model, tokenizer = fidelity.load("smollm2-135m")
>>> ids = fidelity.text_ids(tokenizer, fidelity.DEFAULT_TEXT, 256)
>>> report = fidelity.measure(model, ids, [fidelity.parse_spec("4")])
"""

from pathlib import Path
from typing import List, Optional

import mlx.core as mx

from ..kv_spec import GRAMMAR, KVSpec, parse_spec
from .measure import REFERENCE, caches_for, compare, measure

# The Apache License 2.0, shipped with mlxq: a text every install has.
DEFAULT_TEXT = str(Path(__file__).resolve().parent.parent / "data" / "apache-2.0.txt")


def load(model: str, dtype=None):
    """``(model, tokenizer)`` of a packaged model name, a ``.gguf`` file or an
    mlx-lm model folder, its weights cast to ``dtype`` when given."""
    from .. import gguf

    if model in gguf.PACKAGED:
        return gguf.load_packaged(model, dtype=dtype)
    path = Path(model)
    if path.suffix == ".gguf" and path.is_file():
        return gguf.load_gguf(str(path), dtype=dtype)
    if path.is_dir():
        import mlx_lm

        loaded, tokenizer = mlx_lm.load(str(path))
        if dtype is not None:
            loaded.set_dtype(dtype)
        return loaded, tokenizer
    raise ValueError(
        f"[mlxq.fidelity] model {model!r} is not a packaged model ({', '.join(gguf.PACKAGED)}), "
        "a .gguf file or an mlx-lm model folder."
    )


def text_ids(tokenizer, path: str, tokens: int) -> List[int]:
    """The first ``tokens`` token ids of the text file at ``path``."""
    with open(path, encoding="utf-8") as f:
        ids = tokenizer.encode(f.read())
    if len(ids) < 2:
        raise ValueError(f"[mlxq.fidelity] {path} holds {len(ids)} tokens; at least 2 are needed.")
    return list(ids[:tokens])


def default_dtype() -> Optional[mx.Dtype]:
    """float32 on the CPU (its float16 matmuls are slow); the weights' own elsewhere."""
    return mx.float32 if mx.default_device().type == mx.cpu else None


__all__ = [
    "DEFAULT_TEXT",
    "GRAMMAR",
    "KVSpec",
    "REFERENCE",
    "caches_for",
    "compare",
    "default_dtype",
    "load",
    "measure",
    "parse_spec",
    "text_ids",
]
