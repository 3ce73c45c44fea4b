"""Sharded generation over ``mx.distributed``: ``python -m mlxq.sharded``.

Every process (rank) of a distributed group loads the same mlx-lm model,
keeps its shard of it and runs mlx-lm's greedy ``generate_step`` with
:mod:`mlxq.mlx_lm` enabled, so each rank's KV caches are mlxq's quantized
caches holding that rank's share of the keys and values only:

* ``--shard tensor``: the model's own ``shard(group)`` (mlx-lm's llama, qwen2,
  qwen3...). Every layer keeps ``n_kv_heads / size`` of its KV heads (and as
  many query heads), and two ``all_sum`` per layer rebuild the hidden state.
* ``--shard pipeline``: ``model.model.pipeline(group)`` (mlx-lm's
  ``PipelineMixin`` models: qwen2, qwen3_moe, deepseek_v3...). Each rank keeps
  a block of consecutive layers and their caches; rank ``size - 1`` runs the
  first layers and the hidden state goes down the ranks by send/recv.

Two processes on this machine, over MLX's ring backend (mlx.launch sets
``MLX_HOSTFILE`` and ``MLX_RANK`` for each)::

    mlx.launch --backend ring -n 2 -- \\
        python -m mlxq.sharded --random-arch llama --shard tensor --max-tokens 16

``--model`` takes an mlx-lm model directory or Hugging Face repo, loaded by
mlx-lm's ``sharded_load`` (which fetches only the rank's own weight files
when pipelining); ``--random-arch`` a random-weight model of
:mod:`mlxq.random_models`, the same on every rank for the same ``--seed``.
Each rank prints one JSON line: its rank, the generated token ids (the same
on every rank) and, for each of its layers, the cache's class and how many
KV heads it holds.
"""

import argparse
import importlib
import json
import sys
import time
from typing import List, Optional, Tuple

import mlx.core as mx

from . import mlx_lm as mlxq_lm
from .kv_format import BITS, GROUP_SIZES
from .random_models import ARCHITECTURES, model_args, random_model

SHARDINGS = ("tensor", "pipeline")
BACKENDS = ("ring", "nccl", "jaccl", "mpi", "any")
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m mlxq.sharded",
        description="Greedy generation with an mlx-lm model sharded over mx.distributed "
        "(run under mlx.launch), with mlxq's quantized KV caches on every rank.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--model", default=None, help="An mlx-lm model directory or Hugging Face repo."
    )
    src.add_argument(
        "--random-arch",
        choices=ARCHITECTURES,
        default=None,
        help="A random-weight model of this mlx-lm class (mlxq.random_models, size tiny).",
    )
    p.add_argument("--seed", type=int, default=0, help="Seed of the --random-arch weights.")
    p.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        default=None,
        help="Weight dtype of the --random-arch model (default: random_model's).",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "gpu"),
        default=None,
        help="Device to run on (default: MLX's). Tested on the CPU.",
    )
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default="ring",
        help="mx.distributed backend (default: ring, the one tested here; GPUs "
        "want nccl on CUDA, or MLX_METAL_FAST_SYNCH=1 for the ring on Metal).",
    )
    p.add_argument("--shard", choices=SHARDINGS, required=True, help="How to split the model.")
    p.add_argument("--prompt", default="hello", help="The prompt (no chat template).")
    p.add_argument("--max-tokens", type=int, default=32, help="How many tokens to generate.")
    p.add_argument("--kv-bits", type=int, default=4, help=f"KV-cache bits {BITS}.")
    p.add_argument("--kv-group-size", type=int, default=64, help=f"KV group size {GROUP_SIZES}.")
    return p


def check_args(parser: argparse.ArgumentParser, args) -> None:
    """Bad options fail here, on every rank alike, before any communication."""
    if args.max_tokens < 1:
        parser.error(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.kv_bits not in BITS:
        parser.error(f"--kv-bits must be one of {BITS}, got {args.kv_bits}")
    if args.kv_group_size not in GROUP_SIZES:
        parser.error(f"--kv-group-size must be one of {GROUP_SIZES}, got {args.kv_group_size}")
    if args.model is not None and args.dtype is not None:
        parser.error("--dtype applies to --random-arch models only")
    if not args.prompt:
        parser.error("--prompt must not be empty")
    if args.device == "gpu" and not mx.is_available(mx.gpu):
        parser.error("--device gpu: this MLX has no GPU")


def check_shardable(model, config: dict, how: str, size: int, name: str) -> None:
    """Why ``model`` (made from ``config``) cannot be split ``how`` over
    ``size`` ranks, as a ValueError.

    mlx-lm's ``shard`` divides the head counts with ``//=`` and would run a
    wrong model on a count that ``size`` does not divide; a pipeline needs a
    layer per rank at least.
    """
    if how == "tensor":
        if not hasattr(model, "shard"):
            raise ValueError(f"{name} has no tensor sharding in mlx-lm (no Model.shard)")
        config = config.get("text_config", config)
        for key in ("num_attention_heads", "num_key_value_heads"):
            n = config.get(key)
            if isinstance(n, int) and n % size:
                raise ValueError(f"{name}: {key}={n} does not split over {size} ranks")
    else:
        if not hasattr(getattr(model, "model", None), "pipeline"):
            raise ValueError(
                f"{name} has no pipeline sharding in mlx-lm (no model.pipeline, "
                f"mlx_lm.models.pipeline.PipelineMixin); try --random-arch qwen2"
            )
        if len(model.layers) < size:
            raise ValueError(f"{name}: {len(model.layers)} layers for {size} pipeline ranks")


def load_sharded(args, group) -> Tuple[object, object]:
    """The rank's shard of the model, and the tokenizer."""
    if args.model is not None:
        from mlx_lm.utils import sharded_load

        tensor = group if args.shard == "tensor" else None
        pipeline = group if args.shard == "pipeline" else None
        model, tokenizer, config = sharded_load(
            args.model, pipeline_group=pipeline, tensor_group=tensor, return_config=True
        )
        # After the fact (sharded_load shards as it loads), but before any use.
        check_shardable(model, config, args.shard, group.size(), args.model)
        return model, tokenizer
    dtype = None if args.dtype is None else DTYPES[args.dtype]
    model, tokenizer = random_model(args.random_arch, seed=args.seed, dtype=dtype)
    config = vars(model_args(args.random_arch)[1])
    check_shardable(model, config, args.shard, group.size(), f"random {args.random_arch}")
    if args.shard == "tensor":
        model.shard(group)
    else:
        model.model.pipeline(group)
    mx.eval(model.parameters())
    return model, tokenizer


def greedy_tokens(
    model, prompt: List[int], max_tokens: int, kv_bits: int, kv_group_size: int = 64
) -> Tuple[List[int], List[float], list]:
    """Greedy tokens of mlx-lm's ``generate_step`` on mlxq's quantized caches,
    each token's log-probability, and the caches.

    The caches are made quantized from the first token (``make_prompt_cache``
    with ``kv_bits``, as ``generate_step`` does with ``quantized_kv_start=0``)
    and passed in, so they can be looked at afterwards. Sharded or not, the
    same calls: the tests' unsharded reference runs this too.
    """
    # Modules, not functions: enable() replaces their attributes. (The mlx_lm
    # package's own `generate` attribute is the function, not the module.)
    lm_generate = importlib.import_module("mlx_lm.generate")
    from mlx_lm.models import cache as lm_cache

    with mlxq_lm.enabled():
        cache = lm_cache.make_prompt_cache(model, kv_bits=kv_bits, kv_group_size=kv_group_size)
        mlxq_lm.mark_private(cache)
        steps = lm_generate.generate_step(
            mx.array(prompt),
            model,
            max_tokens=max_tokens,
            prompt_cache=cache,
            kv_bits=kv_bits,
            kv_group_size=kv_group_size,
            quantized_kv_start=0,
        )
        tokens, logprobs = [], []
        for token, lp in steps:
            tokens.append(int(token))
            logprobs.append(lp[token].item())
        # generate_step leaves one step in flight (it runs a step ahead): a
        # rank that exited with it pending would cut its peers' connections.
        mx.synchronize(lm_generate.generation_stream)
    return tokens, logprobs, cache


def kv_heads(cache) -> Optional[int]:
    """KV heads a cache holds: axis 1 of its keys (a ``(codes, scales, biases)``
    triple when quantized), None while empty."""
    keys = cache.keys
    if keys is None:
        return None
    return (keys if isinstance(keys, mx.array) else keys[0]).shape[1]


def layer_range(model) -> Tuple[int, int]:
    """The model layers this rank runs: ``[start, end)`` (all of them unless pipelined)."""
    inner = getattr(model, "model", None)
    start = getattr(inner, "start_idx", 0)
    return start, start + len(model.layers)


def report(group, args, model, tokens, logprobs, cache, seconds: float) -> dict:
    start, _ = layer_range(model)
    return {
        "rank": group.rank(),
        "size": group.size(),
        "shard": args.shard,
        "model": args.model or f"random {args.random_arch} (seed {args.seed})",
        "layers": list(layer_range(model)),
        "tokens": tokens,
        "logprobs": logprobs,
        "caches": [
            {
                "layer": start + i,
                "class": type(c).__name__,
                "module": type(c).__module__,
                "bits": getattr(c, "bits", None),
                "v_bits": getattr(c, "v_bits", None),
                "kv_heads": kv_heads(c),
                "offset": int(c.offset),
            }
            for i, c in enumerate(cache)
        ],
        "seconds": round(seconds, 3),
    }


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    start = time.perf_counter()
    if args.device is not None:  # before mlx_lm.generate makes its stream on the default device
        mx.set_default_device(mx.cpu if args.device == "cpu" else mx.gpu)
    # The ring reads MLX_HOSTFILE and MLX_RANK; without them, a group of one.
    group = mx.distributed.init(backend=args.backend)
    try:
        model, tokenizer = load_sharded(args, group)
    except (ValueError, FileNotFoundError) as e:
        print(f"python -m mlxq.sharded: error: {e}", file=sys.stderr)
        return 2
    prompt = tokenizer.encode(args.prompt)
    tokens, logprobs, cache = greedy_tokens(
        model, prompt, args.max_tokens, args.kv_bits, args.kv_group_size
    )
    # Every rank is done with the others before any of them exits.
    mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu))
    line = json.dumps(
        report(group, args, model, tokens, logprobs, cache, time.perf_counter() - start)
    )
    # One write per line: mlx.launch relays the ranks' output chunk by chunk.
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
