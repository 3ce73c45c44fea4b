"""Does one greedy decode give the same numbers in every process?

Runs the same decode (a random-weight llama of mlx-lm's class, a fixed
prompt, greedy) in ``--processes`` processes at once and compares each
step's log-probabilities with the first process's, bit for bit. Every mode
runs the same model and prompt:

  mlxq-eager       mlxq.mlx_lm.enable(); the model called one token at a
                   time with ``mx.eval`` after each step (mlxq's caches)
  mlxq-pipelined   mlxq.mlx_lm.enable(); mlx-lm's generate_step (each step's
                   graph is queued before the previous one is read)
  stock-eager      stock mlx-lm and its own caches, one token at a time

``--kv-bits`` quantizes the cache (mlxq modes only). A child alone
(``--child OUT``) writes its tokens and log-probabilities to ``OUT.npz``;
that is what ``compute-sanitizer --tool racecheck`` runs under:

    python tools/decode_determinism.py --processes 10 --steps 300
    compute-sanitizer --tool racecheck python tools/decode_determinism.py \
        --child /tmp/one --steps 8 --layers 2

The report prints, per process, the first step whose log-probabilities
differ from process 0's and the largest difference; it exits 1 on any
difference.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

MODES = ("mlxq-eager", "mlxq-pipelined", "stock-eager")


def decode(args):
    """(tokens [steps], chosen log-probabilities [steps], step logits' max-abs
    checksums [steps]) of one greedy decode."""
    import mlx.core as mx

    from mlxq.random_models import random_model

    model, _ = random_model(args.arch, args.size, seed=0, num_hidden_layers=args.layers)
    mx.random.seed(1)
    prompt = mx.random.randint(0, 256, (args.prompt,)).tolist()
    kv = {}
    if args.kv_bits:
        kv = dict(kv_bits=args.kv_bits, kv_group_size=64, quantized_kv_start=0)
    if args.mode.startswith("mlxq"):
        import mlxq.mlx_lm

        mlxq.mlx_lm.enable()
    from mlx_lm.generate import generate_step
    from mlx_lm.models import cache as lm_cache

    tokens, chosen, sums = [], [], []
    if args.mode == "mlxq-pipelined":
        steps = generate_step(mx.array(prompt), model, max_tokens=args.steps, **kv)
        for token, logprobs in steps:
            tokens.append(int(token))
            chosen.append(float(logprobs[int(token)]))
            sums.append(float(mx.sum(mx.abs(logprobs.astype(mx.float32)))))
        return tokens, chosen, sums
    if args.mode.startswith("mlxq"):
        import mlxq.mlx_lm

        make_cache = mlxq.mlx_lm.make_prompt_cache
    else:
        make_cache = lm_cache.make_prompt_cache
    cache = make_cache(model)
    if args.kv_bits:
        cache = [c.to_quantized(group_size=64, bits=args.kv_bits) for c in cache]
    logits = model(mx.array(prompt)[None], cache=cache)[:, -1, :]
    for _ in range(args.steps):
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        token = mx.argmax(logprobs, axis=-1)
        mx.eval(token, logprobs)
        t = int(token.item())
        tokens.append(t)
        chosen.append(float(logprobs[0, t]))
        sums.append(float(mx.sum(mx.abs(logprobs.astype(mx.float32)))))
        logits = model(token[:, None], cache=cache)[:, -1, :]
    return tokens, chosen, sums


def child(args) -> None:
    tokens, chosen, sums = decode(args)
    np.savez(args.child, tokens=np.array(tokens), chosen=np.array(chosen), sums=np.array(sums))


def first_difference(a, b):
    differs = np.nonzero(a != b)[0]
    return (int(differs[0]), float(np.max(np.abs(a - b)))) if len(differs) else (None, 0.0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--processes", type=int, default=10)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    p.add_argument("--mode", choices=MODES, default="mlxq-eager")
    p.add_argument("--kv-bits", type=int, default=0, help="0: unquantized")
    p.add_argument("--arch", default="llama")
    p.add_argument("--size", default="small")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--child", help="run one decode and write OUT.npz")
    args = p.parse_args()
    if args.child:
        child(args)
        return 0
    flags = [
        f"--{k.replace('_', '-')}={v}"
        for k, v in vars(args).items()
        if k not in ("processes", "child")
    ]
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"p{i}") for i in range(args.processes)]
        start = time.perf_counter()
        procs = [
            subprocess.Popen([sys.executable, __file__, "--child", out, *flags]) for out in outs
        ]
        codes = [proc.wait() for proc in procs]
        wall = time.perf_counter() - start
        if any(codes):
            print(f"child exit codes: {codes}")
            return 2
        runs = [np.load(out + ".npz") for out in outs]
    print(
        f"{args.processes} processes x {args.steps} steps, mode {args.mode}, kv_bits "
        f"{args.kv_bits or 'none'}, {wall:.0f} s"
    )
    differing = 0
    for i, run in enumerate(runs[1:], 1):
        step, worst = first_difference(runs[0]["chosen"], run["chosen"])
        sum_step, _ = first_difference(runs[0]["sums"], run["sums"])
        token_step, _ = first_difference(runs[0]["tokens"], run["tokens"])
        same = step is None and sum_step is None and token_step is None
        differing += not same
        print(
            f"  process {i}: "
            + (
                "identical"
                if same
                else f"log-prob differs from step {step} (max {worst:.3g}); logits' "
                f"checksum from step {sum_step}; tokens from step {token_step}"
            )
        )
    print(f"{differing} of {args.processes - 1} processes differ from process 0")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
