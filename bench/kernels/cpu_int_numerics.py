"""The CPU integer products' numerics: int16 against f32 products.

Two measurements, both paths in one process (``MLXQ_CPU_INT=0`` forces the
f32 products):

  kernel  mlxq.sdpa over a grid of formats (2/3/4/5/6/8-bit, K8/V4, head dims
          64 to 512, group sizes 32 to 128, GQA 1 to 8, bf16 and f16, query scale 1
          and 8), each path's relative error against the float64 oracle
          (tests/support/reference64.py), and the integer path's excess over f32's.
  e2e     mlx-lm's llama, qwen3 and gemma3 classes (random_models' "small"
          shapes, head dim 128, 6 layers, random bf16 weights,
          kv_bits 4 and 8) decode greedily with the integer path; the same
          tokens are fed to a second model call per step with the f32 path
          (teacher forcing), and the argmax agreement and largest logit
          difference are recorded.

    python bench/kernels/cpu_int_numerics.py
"""

import argparse
import itertools
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import common  # noqa: E402
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from support.helpers import random_inputs, rel_err, to_f64  # noqa: E402
from support.reference64 import sdpa64  # noqa: E402

import mlxq  # noqa: E402

FORMATS = [
    (4, 4, 128, 64),
    (4, 4, 128, 32),
    (4, 4, 256, 64),
    (8, 8, 64, 64),
    (8, 8, 128, 64),
    (8, 4, 128, 64),
    (4, 4, 512, 128),
    # Spread to bytes first, then the 8-bit kernels.
    (2, 2, 128, 32),
    (3, 3, 128, 64),
    (5, 5, 128, 64),
    (6, 6, 256, 64),
]


def kernel_errors(seed):
    rng = np.random.default_rng(seed)
    rows = []
    for (kb, vb, D, gs), (Hq, Hkv), dtype, qscale, N in itertools.product(
        FORMATS, [(8, 8), (16, 8), (32, 8)], [mx.bfloat16, mx.float16], [1.0, 8.0], [257, 4096]
    ):
        q, k, v = random_inputs(
            rng,
            Hq=Hq,
            Hkv=Hkv,
            N=N,
            Dk=D,
            bits=kb,
            group_size=gs,
            q_dtype=mx.float32,
            kv_dtype=dtype,
            v_bits=vb,
        )
        q = (q * qscale).astype(dtype)
        fmt = dict(group_size=gs, bits=kb, v_group_size=gs, v_bits=vb, scale=D**-0.5)
        ref = sdpa64(q, k, v, **fmt)
        err = {
            f: rel_err(to_f64(common.cpu_int_path(f, lambda: mlxq.sdpa(q, k, v, **fmt))), ref)
            for f in "10"
        }
        rows.append(
            dict(
                format=f"K{kb}V{vb} D{D} g{gs}",
                gqa=Hq // Hkv,
                dtype=str(dtype).split(".")[-1],
                q_scale=qscale,
                N=N,
                err_int=err["1"],
                err_f32=err["0"],
                excess=err["1"] - err["0"],
            )
        )
    return rows


def e2e(arch, bits, tokens, seed):
    import mlx_lm.generate as lm_generate

    import mlxq.mlx_lm as mlxq_lm
    from mlxq.random_models import random_model

    mlxq_lm.enable()
    try:
        model, _ = random_model(arch, "small", dtype=mx.bfloat16, seed=seed, num_hidden_layers=6)
        prompt = mx.array(np.random.default_rng(seed).integers(0, 256, (24,)))
        int_cache = mlxq_lm.make_prompt_cache(model, kv_bits=bits, kv_group_size=64)
        f32_cache = mlxq_lm.make_prompt_cache(model, kv_bits=bits, kv_group_size=64)
        agree, worst, y = 0, 0.0, prompt[None]
        for step in range(tokens):
            a = common.cpu_int_path("1", lambda: model(y, cache=int_cache)[:, -1])
            b = common.cpu_int_path("0", lambda: model(y, cache=f32_cache)[:, -1])
            agree += int(mx.argmax(a).item() == mx.argmax(b).item())
            worst = max(worst, mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item())
            y = mx.argmax(a, axis=-1)[:, None]
        del lm_generate
        return dict(
            arch=arch, kv_bits=bits, steps=tokens, argmax_agree=agree / tokens, max_logit_diff=worst
        )
    finally:
        mlxq_lm.disable()


def real_weights(tokens):
    import importlib.util
    from pathlib import Path

    import mlxq.mlx_lm as mlxq_lm
    from mlxq import gguf
    from mlxq.evaluate import teacher_forced

    text = (Path(ROOT) / "tests" / "data" / "apache-2.0.txt").read_text()
    runs = []
    for name, bits_list in (("smollm2-135m", [8]), ("gemma3-270m", [4, 8])):
        if importlib.util.find_spec(gguf.PACKAGED[name]) is None:
            print(f"real: {name} is not installed, skipped")
            continue
        model, tok = gguf.load_packaged(name, dtype=mx.bfloat16)
        ids = tok.encode(text)[: tokens + 1]
        mlxq_lm.enable()
        try:
            for bits in bits_list:
                res = {}
                for flag in "10":
                    caches = mlxq_lm.make_prompt_cache(model, kv_bits=bits, kv_group_size=64)
                    with common.cpu_int(flag):
                        res[flag] = teacher_forced(model, ids, caches)
                r = dict(
                    model=name,
                    kv_bits=bits,
                    tokens=len(ids) - 1,
                    ppl_int=res["1"][0],
                    ppl_f32=res["0"][0],
                    argmax_agree=float((res["1"][1] == res["0"][1]).mean()),
                )
                runs.append(r)
                print(
                    f"real {name} kv{bits}: perplexity int16 {r['ppl_int']:.3f} / f32 {r['ppl_f32']:.3f} "
                    f"({100 * (r['ppl_int'] / r['ppl_f32'] - 1):+.2f}%), argmax agreement "
                    f"{100 * r['argmax_agree']:.1f}%"
                )
        finally:
            mlxq_lm.disable()
        del model
    return runs


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--real-tokens", type=int, default=512)
    common.add_output_args(p)
    args = p.parse_args()
    args.out = common.output_path(args, "cpu_int_numerics")
    info = common.machine_info()
    common.print_machine(info)
    rows = kernel_errors(args.seed)
    excess = [r["excess"] for r in rows]
    print(
        f"\nkernel: {len(rows)} cases; error int16 max {max(r['err_int'] for r in rows):.3g}, "
        f"f32 max {max(r['err_f32'] for r in rows):.3g}; excess of int16 over f32: "
        f"max {max(excess):.2e}, median {float(np.median(excess)):.2e}"
    )
    for dtype in ("bfloat16", "float16"):
        sub = [r for r in rows if r["dtype"] == dtype]
        print(
            f"  {dtype}: worst int16 {max(r['err_int'] for r in sub):.3g} "
            f"(f32 {max(r['err_f32'] for r in sub):.3g}), worst excess {max(r['excess'] for r in sub):.2e}"
        )
    runs = []
    for arch, bits in itertools.product(["llama", "qwen3", "gemma3"], [4, 8]):
        r = e2e(arch, bits, args.tokens, args.seed)
        runs.append(r)
        print(
            f"e2e {arch} kv{bits}: argmax agreement {100 * r['argmax_agree']:.1f}% over {r['steps']} steps, "
            f"max |logit diff| {r['max_logit_diff']:.3g}"
        )
    real = real_weights(args.real_tokens)
    common.save_json(args.out, dict(machine=info, kernel=rows, e2e=runs, real=real))


if __name__ == "__main__":
    main()
