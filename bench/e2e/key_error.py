"""Where quantized keys lose a layer's attention: the KL divergence of each
layer's attention distribution when only its keys are quantized.

A packaged model (mlxq.gguf) in float32 reads ``--tokens`` tokens of the
Apache License 2.0 (tests/data/apache-2.0.txt) in one causal step with
mlx-lm's own caches; every layer's queries (the last ``--queries``
positions) and keys (post-RoPE, as a cache holds them) are kept. Per layer
and key setting, the keys are quantized and dequantized in float64 numpy
terms of MLX's affine codes, and the attention weights of every query head
are compared with the unquantized ones: mean KL(p || p_hat) in nats over
heads and query positions (causal; a sliding-window layer's keys are all of
the text here, as the KL is a property of the keys' format).

Key settings: ``4g64``, ``4g32``, ``8g64`` (mlxq's formats), ``4g64+hadamard``
(rows in the Walsh-Hadamard basis, ``kv_hadamard=True``), and two that are
not mlxq settings, measured to show what a shared offset does:
``4g64-centered`` and ``4g64+hadamard-centered`` quantize ``k - m`` and add
``m`` back, ``m`` the mean key of the text's first ``--center-tokens``
tokens (a per-channel offset every key shares, which a softmax over one
query's keys ignores).

    python bench/e2e/key_error.py --model gemma3-270m --tokens 2048
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common  # noqa: E402
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from mlxq import gguf  # noqa: E402
from mlxq.hadamard import transform  # noqa: E402

TEXT = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "data", "apache-2.0.txt")
SETTINGS = ["4g64", "4g32", "8g64", "4g64+hadamard", "4g64-centered", "4g64+hadamard-centered"]


def captured(model, ids, queries):
    """Per layer: (queries [Hq, Lq, D], keys [Hkv, N, D], scale)."""
    from mlx_lm.models import cache as lm_cache

    module = sys.modules[type(model.model.layers[0].self_attn).__module__]
    stock = module.scaled_dot_product_attention
    kept = []

    def keep(q, k, v, *args, scale, **kwargs):
        kept.append((np.array(q[0, :, -queries:]), np.array(k[0]), scale))
        return stock(q, k, v, *args, scale=scale, **kwargs)

    module.scaled_dot_product_attention = keep
    try:
        mx.eval(model(mx.array(ids)[None], cache=lm_cache.make_prompt_cache(model)))
    finally:
        module.scaled_dot_product_attention = stock
    return kept


def round_trip(k, bits, group, hadamard):
    x = mx.array(k.astype(np.float32))
    if hadamard:
        x = transform(x)
    w, s, b = mx.quantize(x, group_size=group, bits=bits)
    x = mx.dequantize(w, s, b, group_size=group, bits=bits)
    if hadamard:
        x = transform(x)  # H is its own inverse
    return np.array(x).astype(np.float64)


def quantized_keys(k, setting, center_tokens):
    fmt, _, centered = setting.partition("-")
    fmt, _, option = fmt.partition("+")
    bits, group = (int(x) for x in fmt.split("g"))
    m = k[:, :center_tokens].mean(axis=1, keepdims=True) if centered else 0.0
    return round_trip(k - m, bits, group, option == "hadamard") + m


def attention_kl(q, k, k_hat, scale):
    """Mean KL(p || p_hat) over query heads and positions, causal."""
    rep = q.shape[0] // k.shape[0]
    N, L = k.shape[1], q.shape[1]
    hidden = np.arange(N)[None, :] > (N - L + np.arange(L))[:, None]
    kls = []
    for h in range(q.shape[0]):
        qh = q[h].astype(np.float64)
        logp, logp_hat = (
            _log_softmax(np.where(hidden, -np.inf, qh @ kk[h // rep].T * scale))
            for kk in (k, k_hat)
        )
        gap = np.where(hidden, 0.0, logp - np.where(hidden, 0.0, logp_hat))
        kls.append((np.exp(logp) * gap).sum(1))
    return float(np.mean(kls))


def _log_softmax(s):
    s = s - s.max(axis=1, keepdims=True)
    return s - np.log(np.exp(s).sum(axis=1, keepdims=True))


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="gemma3-270m", choices=sorted(gguf.PACKAGED))
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--queries", type=int, default=256)
    p.add_argument("--center-tokens", type=int, default=64)
    p.add_argument("--settings", nargs="+", default=SETTINGS)
    common.add_output_args(p)
    args = p.parse_args()
    info = common.machine_info()
    common.print_machine(info)
    model, tokenizer = gguf.load_packaged(args.model, dtype=mx.float32)[:2]
    with open(TEXT) as f:
        ids = tokenizer.encode(f.read())[: args.tokens]
    from mlx_lm.models import cache as lm_cache

    sliding = [isinstance(c, lm_cache.RotatingKVCache) for c in lm_cache.make_prompt_cache(model)]
    cols = [("layer", "layer", "{}"), ("attention", "attention", "{}")]
    cols += [(s, s, "{:.4f}") for s in args.settings]
    table, rows = common.Table(cols), []
    table.header()
    for i, (q, k, scale) in enumerate(captured(model, ids, args.queries)):
        row = dict(layer=i, attention="sliding" if sliding[i] else "full")
        for s in args.settings:
            row[s] = attention_kl(q, k, quantized_keys(k, s, args.center_tokens), scale)
        table.row(row)
        rows.append(row)
    common.save_json(
        common.output_path(args, f"key_error_{common.slug(args.model)}_cpu"),
        {"machine": info, "args": vars(args), "rows": rows},
    )


if __name__ == "__main__":
    main()
