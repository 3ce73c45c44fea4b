"""Long-context retrieval with quantized KV: a pass key in a haystack.

The pass-key task of Mohtashami and Jaggi (2023): a five-digit key is
stated once, at a depth of the prompt, inside filler sentences that repeat
("The grass is green. The sky is blue. ..."), and the prompt ends by asking
for it. Greedy decoding of a few tokens must reproduce the key. Each length
(tokens of the whole prompt) and depth (where the key sits, 0 = start, 1 =
end) gets ``--keys`` different keys; accuracy is the fraction retrieved.

``--answer free`` (the default) counts a key found anywhere in the greedy
answer. A small model often answers in words ("the pass key.") instead of
digits, and that choice flips on small changes of the cache, so a hit also
measures it. ``--answer digits`` takes the question away: the greedy answer
may use only ASCII digits and spaces, and a hit is an answer that starts with
the key. It measures whether the key is found, given that a number is given.

The model is a packaged one (mlxq.gguf: Gemma 3 270M has a 32k context) or
any .gguf file or mlx-lm folder, in bf16, through mlx-lm's ``generate_step``
with the cache of each run:

  bf16     mlx-lm's own caches, unquantized
  kv8      mlxq's caches at 8 bits (group 64) from the first token
  kv4      mlxq's caches at 4 bits (group 64) from the first token
  recipe   what kv_bits=4 gets under a bare enable(): 8-bit keys, 4-bit
           values, the last 128 tokens also kept exact (mlxq.mlx_lm's
           4-bit recipe)

and, with ``--runs``: ``kv4-w128`` (4-bit keys and values with the window),
its variants ``kv4-w128-rot`` (rows in a Hadamard basis), ``kv4-w128-g32``
(groups of 32) and ``kv4-w128-k8-global``, ``kv4-w128-k6-global``,
``kv4-w128-k5-global`` (8-, 6- or 5-bit keys on the caches that hold the
whole context: every cache but the sliding-window rings,
``enable(kv_layers=...)``), and ``k8v4-w128`` (8-bit keys, 4-bit values,
the window, set as kv_bits=8 with v_bits=4: the recipe's caches).

    python bench/e2e/needle.py --lengths 4096 8192 16384
    python bench/e2e/needle.py --lengths 32768 --record      # on a GPU
"""

import argparse
import importlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common  # noqa: E402
import gpu_runs  # noqa: E402
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

import mlxq.mlx_lm as mlxq_lm  # noqa: E402

# Each run's kv_bits, enable() settings and group size (None: stock bf16
# caches).
RUNS = {
    "bf16": None,
    "kv8": (8, dict(kv_recent=0), 64),
    "kv4": (4, dict(kv_recent=0, k_bits=4), 64),
    "recipe": (4, {}, 64),
    "kv4-w128": (4, dict(k_bits=4), 64),
    "kv4-w128-rot": (4, dict(k_bits=4, kv_hadamard=True), 64),
    "kv4-w128-g32": (4, dict(k_bits=4), 32),
    # (full_attention_kv: enable(kv_layers=...) for each full-attention cache)
    "kv4-w128-k8-global": (4, dict(k_bits=4, full_attention_kv="8/4+recent128"), 64),
    "kv4-w128-k6-global": (4, dict(k_bits=4, full_attention_kv="6/4+recent128"), 64),
    "kv4-w128-k5-global": (4, dict(k_bits=4, full_attention_kv="5/4+recent128"), 64),
    "k8v4-w128": (8, dict(v_bits=4, kv_recent=128), 64),
}
DEFAULT_RUNS = ["bf16", "kv8", "kv4", "recipe"]
INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it.\n\n"
)
FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\n\nWhat is the pass key? The pass key is"


def load(model: str):
    from mlx_lm import load as lm_load

    from mlxq import gguf

    if model in gguf.PACKAGED:
        return gguf.load_packaged(model, dtype=mx.bfloat16)
    if model.endswith(".gguf"):
        return gguf.load_gguf(model, dtype=mx.bfloat16)
    return lm_load(model)


def prompt_ids(tokenizer, length: int, depth: float, key: int):
    """``length`` tokens: the intro, filler with the needle at ``depth`` of
    the filler, the question (the filler is cut at sentence ends)."""
    encode = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    head = tokenizer.encode(INTRO)  # (with the model's BOS)
    needle = encode(NEEDLE.format(key=key))
    tail = encode(QUESTION)
    sentence = encode(FILLER)
    room = length - len(head) - len(needle) - len(tail)
    if room < len(sentence):
        raise ValueError(f"--lengths {length} leaves no room for filler.")
    n = room // len(sentence)
    before = int(round(depth * n))
    ids = head + sentence * before + needle + sentence * (n - before) + tail
    return ids


def full_attention_caches(model):
    """Indices of the model's caches that are not sliding-window rings (mlx-lm's
    own cache classes, as make_prompt_cache gives them unpatched)."""
    from mlx_lm.models import cache as lm_cache

    caches = lm_cache.make_prompt_cache(model)
    return [i for i, c in enumerate(caches) if not isinstance(c, lm_cache.RotatingKVCache)]


def digits_only(tokenizer):
    """A logits processor that leaves only the tokens that decode to ASCII
    digits or spaces."""
    allowed = []
    for text, i in tokenizer.get_vocab().items():
        if any(c.isdigit() for c in text) or text.strip("\u2581\u0120 ") == "":
            decoded = tokenizer.decode([i])
            if decoded and all(c == " " or (c.isascii() and c.isdigit()) for c in decoded):
                allowed.append(i)
    if not allowed:
        raise ValueError("--answer digits: the tokenizer has no digit tokens.")
    allowed = sorted(set(allowed))
    bias = {}

    def processor(tokens, logits):
        n = logits.shape[-1]
        if n not in bias:
            b = mx.full((n,), -float("inf"), dtype=logits.dtype)
            b[mx.array([i for i in allowed if i < n])] = 0
            bias[n] = b
        return logits + bias[n]

    return processor


def hit(answer, key, mode):
    if mode == "digits":
        return answer.strip().startswith(str(key))
    return str(key) in answer


def retrieve(model, tokenizer, ids, run, max_tokens=8, processors=None):
    lm_generate = importlib.import_module("mlx_lm.generate")
    from mlx_lm.models import cache as lm_cache

    spec = RUNS[run]
    options = {} if spec is None else dict(spec[1])
    setting = options.pop("full_attention_kv", None)
    if setting is not None:
        options["kv_layers"] = {i: setting for i in full_attention_caches(model)}
    handle = None if spec is None else mlxq_lm.enable(**options)
    try:
        if spec is None:
            cache, kwargs = lm_cache.make_prompt_cache(model), {}
        else:
            bits, _, group = spec
            cache = lm_cache.make_prompt_cache(model, kv_bits=bits, kv_group_size=group)
            kwargs = dict(kv_bits=bits, kv_group_size=group, quantized_kv_start=0)
        out = [
            int(t)
            for t, _ in lm_generate.generate_step(
                mx.array(ids),
                model,
                max_tokens=max_tokens,
                prompt_cache=cache,
                logits_processors=processors,
                **kwargs,
            )
        ]
    finally:
        if handle is not None:
            mlxq_lm.disable()
    return tokenizer.decode(out)


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    p.add_argument("--keys", type=int, default=3, help="keys per length and depth (default 3)")
    p.add_argument("--runs", nargs="+", choices=list(RUNS), default=DEFAULT_RUNS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--answer",
        choices=["free", "digits"],
        default="free",
        help="free: the key anywhere in the greedy answer; digits: an answer of digits only "
        "that starts with the key (default free)",
    )
    common.add_output_args(p)
    args = p.parse_args()
    info = common.machine_info()
    common.print_machine(info)
    model, tokenizer = load(args.model)
    processors = [digits_only(tokenizer)] if args.answer == "digits" else None
    rng = np.random.default_rng(args.seed)
    slug, info["device"] = gpu_runs.device_name()
    name = os.path.basename(os.path.normpath(args.model)).removesuffix(".gguf")
    suffix = "_digits" if args.answer == "digits" else ""
    path = common.output_path(args, f"needle_{common.slug(name)}_{slug}{suffix}")
    cols = [("length", "length", "{}"), ("depth", "depth", "{:.2f}")]
    cols += [(run, run, "{:.2f}") for run in args.runs]
    table, rows, trials = common.Table(cols), [], []
    payload = dict(machine=info, model=args.model, answer=args.answer, rows=rows, trials=trials)
    table.header()
    for length in args.lengths:
        for depth in args.depths:
            keys = [int(k) for k in rng.integers(10000, 100000, args.keys)]
            row = dict(length=length, depth=depth)
            for run in args.runs:
                hits = 0
                for key in keys:
                    ids = prompt_ids(tokenizer, length, depth, key)
                    t0 = time.perf_counter()
                    text = retrieve(model, tokenizer, ids, run, processors=processors)
                    found = hit(text, key, args.answer)
                    hits += found
                    trials.append(
                        dict(
                            length=length,
                            depth=depth,
                            run=run,
                            key=key,
                            answer=text,
                            retrieved=found,
                            seconds=time.perf_counter() - t0,
                        )
                    )
                row[run] = hits / len(keys)
            table.row(row)
            rows.append(row)
            common.save_json(path, payload, quiet=True)  # (a cut-off run keeps its rows)
    common.save_json(path, payload)


if __name__ == "__main__":
    main()
