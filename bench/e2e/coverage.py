"""Which mlx-lm model families get a quantized KV cache: stock mlx-lm against mlxq.

Every model mlx-lm's own ``tests/test_models.py`` builds (its configs,
recorded by running that file with the ``harvest_models`` plugin from the
installed release's source distribution; see tools/mlx_lm_tests/) is built
again with random float32 weights, with its head dims scaled up to 64
where they are smaller (``mx.quantize`` groups of 64), and runs greedy
``generate_step`` (24 prompt tokens, 8 new) four ways:

  bf16        no kv_bits: the reference tokens
  stock kv4   stock mlx-lm, kv_bits=4, quantized_kv_start=0
  mlxq kv4    mlxq.mlx_lm.enable(), the same call (the 4-bit recipe)
  mlxq kv8    mlxq, kv_bits=8: greedy-token agreement with the reference

Each quantized run is recorded as ``error`` (the exception, first line),
``refused`` (mlxq's ValueError before any work: the model computes attention
in a way mlxq does not serve), ``silent`` (it ran, but some attention caches
stayed unquantized: k of n quantized) or ``quantized`` (every attention
cache quantized, except those the model's family keeps exact: see
mlxq.mlx_lm.families). Models whose unquantized run fails are ``not run``
(for example, vision models that need images).

    python bench/e2e/coverage.py                       # every model
    python bench/e2e/coverage.py --only llama gemma2   # model types containing these
"""

import argparse
import importlib
import json
import math
import os
import subprocess
import sys
import tarfile
import tempfile
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common  # noqa: E402
import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

import mlxq.mlx_lm as mlxq_lm  # noqa: E402
from mlxq.mlx_lm.families import EXACT, ROLE  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPT, NEW = 24, 8
MAX_PARAMETERS = 300_000_000  # float32: 1.2 GB
# Widths scaled together so that every head dim reaches 64 (any key ending
# in "head_dim" too), in nested configs (text_config) as well.
SCALED = (
    "hidden_size",
    "hidden_dim",
    "model_dim",
    "d_model",
    "dim",
    "n_embd",
    "rotary_dim",
    "kv_lora_rank",
    "q_lora_rank",
)


def harvest(path: str) -> list:
    """mlx-lm's test_models.py configs (cached at ``path``)."""
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    version = mlx_lm.__version__
    src = os.path.join(tempfile.gettempdir(), "mlx-lm-src", version)
    tests = os.path.join(src, f"mlx_lm-{version}")
    if not os.path.isdir(os.path.join(tests, "tests")):
        os.makedirs(src, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:"]
            + [f"mlx-lm=={version}", "-d", src],
            check=True,
        )
        with tarfile.open(os.path.join(src, f"mlx_lm-{version}.tar.gz")) as tar:
            tar.extractall(src, filter="data")
    env = dict(os.environ, MLXQ_HARVEST=os.path.abspath(path))
    env["PYTHONPATH"] = os.path.join(ROOT, "tools", "mlx_lm_tests")
    subprocess.run(
        [sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        + ["-p", "harvest_models", "tests/test_models.py"],
        cwd=tests,
        env=env,
        stdout=subprocess.DEVNULL,
    )
    with open(path) as f:
        return json.load(f)


def attention_caches(cache) -> list:
    """The KV caches in a prompt cache (CacheList members included), not SSM state."""
    out = []
    for c in cache:
        inner = getattr(c, "caches", None)
        if isinstance(inner, (list, tuple)):
            out += attention_caches(inner)
        elif "KVCache" in type(c).__name__ or hasattr(c, "bits"):
            out.append(c)
    return out


def head_dims(cache) -> list:
    """The head dims of the keys and values the attention caches hold."""
    dims = []
    for c in attention_caches(cache):
        for side in ("keys", "values"):
            t = getattr(c, side, None)
            if isinstance(t, mx.array):
                dims.append(t.shape[-1])
    return sorted(set(dims))


def scaled(args: dict, scale: int) -> dict:
    out = {}
    for k, v in args.items():
        if isinstance(v, dict):
            v = scaled(v, scale)
        elif isinstance(v, int) and not isinstance(v, bool):
            if k in SCALED or k.endswith("head_dim"):
                v = v * scale
        out[k] = v
    return out


def build(entry, scale: int):
    module = importlib.import_module(entry["module"])
    args = scaled(entry["args"], scale)
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict(args))
    n = sum(v.size for _, v in tree_flatten(model.parameters()))  # shapes only: lazy
    if n > MAX_PARAMETERS:
        raise ValueError(f"{n / 1e6:.0f}M parameters: beyond this machine (the config as recorded)")
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def generate(model, vocab, kv_bits=None, logprobs=None):
    """(tokens, prompt cache) of greedy generate_step; each step's
    log-probabilities (float32) are appended to ``logprobs`` when given."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    mx.random.seed(1)
    prompt = mx.random.randint(1, max(2, min(vocab, 256)), (PROMPT,))
    cache = make_prompt_cache(model)
    kw = {} if kv_bits is None else dict(kv_bits=kv_bits, kv_group_size=64, quantized_kv_start=0)
    steps = generate_step(prompt, model, max_tokens=NEW, prompt_cache=cache, **kw)
    tokens = []
    for t, lp in steps:
        tokens.append(int(t))
        if logprobs is not None:
            logprobs.append(lp.astype(mx.float32))
    return tokens, cache


def first_disagreement(ref, ref_lp, got, got_lp):
    """Where greedy tokens first part, and whether that step is a near tie:
    the reference's top-2 log-probability gap there against the largest
    change quantization made to any log-probability at that step. Two
    tokens' log-probabilities can move apart by twice that change, so a gap
    up to twice it is one the quantization's own noise can close."""
    i = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), None)
    if i is None:
        return None
    top2 = mx.sort(ref_lp[i])[-2:]
    gap = float(top2[1] - top2[0])
    moved = float(mx.abs(ref_lp[i] - got_lp[i]).max())
    return {"step": i, "top2_gap": gap, "max_logprob_change": moved, "near_tie": gap <= 2 * moved}


def is_refusal(e: Exception) -> bool:
    """mlxq's refusal of kv_bits for a model family (mlxq.mlx_lm.families)."""
    return isinstance(e, ValueError) and "run it without kv_bits" in str(e)


def classify(run) -> dict:
    try:
        tokens, cache = run()
    except Exception as e:  # noqa: BLE001  (recorded)
        line = (str(e).splitlines() or [""])[0][:160]
        kind = "refused" if is_refusal(e) else "error"
        return {"result": kind, "error": f"{type(e).__name__}: {line}"}
    caches = attention_caches(cache)
    n, q = len(caches), sum(hasattr(c, "bits") for c in caches)
    exact = sum(not hasattr(c, "bits") and getattr(c, ROLE, None) == EXACT for c in caches)
    result = "quantized" if q and q + exact == n else "silent"
    out = {"result": result, "quantized": f"{q}/{n}", "tokens": tokens}
    if exact:
        out["exact_by_role"] = exact
    return out


def run_model(entry) -> dict:
    row = {"model_type": entry["model_type"], "test": entry["test"]}
    vocab = entry.get("vocab_size") or entry["args"].get("vocab_size", 256)
    try:
        scale = 1
        model = build(entry, scale)
        ref_lp = []
        ref, cache = generate(model, vocab, logprobs=ref_lp)
        dims = head_dims(cache)
        if dims and min(dims) < 64:
            scale = 2 ** math.ceil(math.log2(64 / min(dims)))
            model = build(entry, scale)
            ref_lp = []
            ref, cache = generate(model, vocab, logprobs=ref_lp)
            dims = head_dims(cache)
    except Exception as e:  # noqa: BLE001  (recorded)
        line = (str(e).splitlines() or [""])[0][:120]
        return dict(row, result="not run", error=f"{type(e).__name__}: {line}")
    row.update(scale=scale, head_dims=dims, result="ran")
    if not dims:
        row["note"] = "no KV cache (state only)"
    elif min(dims) < 64:
        row["note"] = "head dims below 64 after scaling"
    mlxq_lm.disable()
    row["stock_kv4"] = classify(lambda: generate(model, vocab, 4))
    with mlxq_lm.enabled():
        row["mlxq_kv4"] = classify(lambda: generate(model, vocab, 4))
        kv8_lp = []
        kv8 = classify(lambda: generate(model, vocab, 8, logprobs=kv8_lp))
    row["mlxq_kv8"] = kv8
    if "tokens" in kv8:
        row["kv8_agreement"] = sum(a == b for a, b in zip(kv8["tokens"], ref)) / len(ref)
        parted = first_disagreement(ref, ref_lp, kv8["tokens"], kv8_lp)
        if parted is not None:
            row["kv8_first_disagreement"] = parted
    return row


def cell(r) -> str:
    if r["result"] in ("error", "refused"):
        return f"{r['result']}: " + r["error"].replace("|", "/")
    if r["result"] == "silent":
        return f"unquantized ({r['quantized']} quantized)"
    exact = f", {r['exact_by_role']} exact by role" if r.get("exact_by_role") else ""
    return f"quantized ({r['quantized']}{exact})"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", help="model types containing any of these")
    p.add_argument("--configs", default=None, help="harvested configs (default: made, cached)")
    common.add_output_args(p)
    args = p.parse_args()
    out = common.output_path(args, "coverage_cpu")
    configs = args.configs or os.path.join(
        tempfile.gettempdir(), f"mlx_lm_{mlx_lm.__version__}_test_models.json"
    )
    entries = harvest(configs)
    if args.only:
        entries = [e for e in entries if any(o in e["model_type"] for o in args.only)]
    info = common.machine_info()
    common.print_machine(info)
    print(f"mlx-lm {mlx_lm.__version__}: {len(entries)} model builds from tests/test_models.py")
    print(
        "| model type | test | head dims | stock kv4 | mlxq kv4 | mlxq kv8 | kv8 tokens = bf16 "
        "| first kv8 difference: step, top-2 gap / largest log-prob change |"
    )
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for e in entries:
        try:
            row = run_model(e)
        except Exception:  # noqa: BLE001  (a crash of the harness itself)
            row = dict(model_type=e["model_type"], result="not run", error=traceback.format_exc())
        rows.append(row)
        if row["result"] == "not run":
            print(
                f"| {row['model_type']} | {e['test']} | - | not run: {row['error'][:80]} | | | | |"
            )
            continue
        agree, parted = row.get("kv8_agreement"), row.get("kv8_first_disagreement")
        where = "-"
        if parted is not None:
            where = (
                f"{parted['step']}: {parted['top2_gap']:.3f} / "
                f"{parted['max_logprob_change']:.3f}"
                + (" (near tie)" if parted["near_tie"] else "")
            )
        print(
            f"| {row['model_type']} | {e['test']} | {row['head_dims']} | {cell(row['stock_kv4'])} "
            f"| {cell(row['mlxq_kv4'])} | {cell(row['mlxq_kv8'])} "
            f"| {'-' if agree is None else f'{agree:.0%}'} | {where} |",
            flush=True,
        )
    ran = [r for r in rows if r["result"] == "ran" and r.get("head_dims")]
    summary = {
        key: {
            kind: sum(r[key]["result"] == kind for r in ran)
            for kind in ("quantized", "refused", "silent", "error")
        }
        for key in ("stock_kv4", "mlxq_kv4", "mlxq_kv8")
    }
    summary["models with KV caches"] = len(ran)
    parted = [r["kv8_first_disagreement"] for r in ran if "kv8_first_disagreement" in r]
    summary["kv8 disagreements"] = len(parted)
    summary["kv8 disagreements starting at a near tie"] = sum(p["near_tie"] for p in parted)
    summary["not run"] = sum(r["result"] == "not run" for r in rows)
    summary["state only"] = sum(r["result"] == "ran" and not r.get("head_dims") for r in rows)
    print(json.dumps(summary))
    common.save_json(
        out,
        {
            "benchmark": "coverage",
            "machine": info,
            "mlx_lm": mlx_lm.__version__,
            "rows": rows,
            "summary": summary,
        },
    )


if __name__ == "__main__":
    main()
