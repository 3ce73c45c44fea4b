"""Generate text with mlx-lm running on mlxq: ``python -m mlxq.generate``.

mlx-lm's main generation options, plus ``--kv-bits``/``--kv-group-size``,
with :mod:`mlxq.mlx_lm` enabled so that a quantized KV cache works for every
model (sliding-window and attention-sink ones included)::

    python -m mlxq.generate --model path/to/mlx-model --prompt "Hello" --kv-bits 4
    python -m mlxq.generate --random-model gemma3 --prompt-tokens 8192 --kv-bits 4

``--random-model llama|qwen2|qwen3|gemma3|gpt_oss|gemma4`` builds a model of mlx-lm's
own class with random weights and a byte-level tokenizer (no downloads; the
text it writes is noise). A progress bar runs during long prefills; at the
end it prints prompt and generation tokens/s and peak memory.
"""

import argparse
import importlib
import json
import sys
import time

import mlx.core as mx

from . import mlx_lm as mlxq_lm
from .kv_format import BITS, GROUP_SIZES
from .random_models import ARCHITECTURES, random_model

DEFAULT_PREFILL_STEP_SIZE = 2048


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m mlxq.generate",
        description="Generate with mlx-lm, using mlxq's fused quantized-KV attention and caches.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--model",
        type=str,
        default=None,
        help="Path to a local mlx-lm model directory (or a Hugging Face repo mlx-lm can fetch).",
    )
    src.add_argument(
        "--random-model",
        choices=ARCHITECTURES,
        default=None,
        help="Build a model of this mlx-lm class with random weights "
        "(no download; the output is noise).",
    )
    p.add_argument(
        "--random-size",
        choices=("tiny", "small"),
        default="tiny",
        help="Size of the --random-model: 'tiny' (tests) or 'small' "
        "(hidden 1024, 12 layers, GQA 4, head dim 128).",
    )
    p.add_argument("--prompt", "-p", default="hello", help="Prompt ('-' reads it from stdin).")
    p.add_argument(
        "--prompt-tokens",
        type=int,
        default=None,
        help="Repeat the tokenized prompt to exactly this many tokens (long-context runs).",
    )
    p.add_argument("--system-prompt", default=None, help="System prompt for the chat template.")
    p.add_argument(
        "--ignore-chat-template",
        action="store_true",
        help="Use the raw prompt without the tokenizer's chat template.",
    )
    p.add_argument(
        "--max-tokens", "-m", type=int, default=100, help="Maximum number of tokens to generate."
    )
    p.add_argument("--temp", type=float, default=0.0, help="Sampling temperature.")
    p.add_argument("--top-p", type=float, default=1.0, help="Sampling top-p.")
    p.add_argument("--min-p", type=float, default=0.0, help="Sampling min-p.")
    p.add_argument("--top-k", type=int, default=0, help="Sampling top-k.")
    p.add_argument(
        "--seed", type=int, default=None, help="PRNG seed (sampling and random weights)."
    )
    p.add_argument(
        "--max-kv-size",
        type=int,
        default=None,
        help="Maximum KV-cache size (a rotating cache; with --kv-bits, mlxq's "
        "RotatingQuantizedKVCache).",
    )
    p.add_argument(
        "--prefill-step-size",
        type=int,
        default=DEFAULT_PREFILL_STEP_SIZE,
        help="Prompt tokens processed per step.",
    )
    p.add_argument(
        "--prompt-cache-file",
        type=str,
        default=None,
        help="A prompt-cache file (mlx-lm's format, e.g. from mlx_lm.cache_prompt "
        "or mlxq) to start from.",
    )
    p.add_argument(
        "--kv-bits",
        type=int,
        default=None,
        help=f"Bits for KV-cache quantization {BITS}. Default: none.",
    )
    p.add_argument(
        "--kv-group-size",
        type=int,
        default=64,
        help=f"Group size for KV-cache quantization {GROUP_SIZES}.",
    )
    p.add_argument(
        "--k-bits",
        type=int,
        default=None,
        help="With --kv-bits: the keys' own bits (--kv-bits is then the values'). Default: "
        "8 at --kv-bits 4 without --v-bits (the recipe: retrieval at 32k tokens equal to "
        "bf16's, docs/results/accuracy.md), else --kv-bits; --k-bits 4 keeps 4-bit keys.",
    )
    p.add_argument(
        "--v-bits",
        type=int,
        default=None,
        help="With --kv-bits: the values' own bits (--kv-bits is then the keys'; "
        "--kv-bits 8 --v-bits 4 is 8-bit keys with 4-bit values). Default: --kv-bits.",
    )
    p.add_argument(
        "--v-group-size",
        type=int,
        default=None,
        help="With --kv-bits: the values' own group size. Default: --kv-group-size.",
    )
    p.add_argument(
        "--kv-hadamard",
        "--kv-rotate",  # the deprecated name
        dest="kv_hadamard",
        action="store_true",
        help="With --kv-bits: quantize K/V in a Walsh-Hadamard basis (mlxq.hadamard; "
        "measured per model in docs/results/accuracy.md).",
    )
    p.add_argument(
        "--kv-recent",
        "--kv-keep-recent",  # the deprecated name
        dest="kv_recent",
        type=int,
        default=None,
        help="With --kv-bits: also keep the last N tokens' K/V exact (mlxq.cache.recent). "
        "Default: 128 at 4 bits or fewer (the recipe: 4-bit values near-lossless on the "
        "packaged models, docs/results/accuracy.md), 0 above; 0 turns it off.",
    )
    p.add_argument(
        "--kv-layers",
        default=None,
        metavar="JSON",
        help='With --kv-bits: a JSON file {"kv_layers": {index: setting}} quantizing those '
        "caches otherwise (mlxq-fidelity --write-layers writes one; docs/usage/mlx-lm.md).",
    )
    p.add_argument(
        "--quantized-kv-start",
        type=int,
        default=0,
        help="With --kv-bits, quantize the cache from this many tokens on. "
        "Default 0: quantized from the first token (mlx-lm's default is 5000, "
        "because its quantized attention is slower than bf16; mlxq's is not).",
    )
    p.add_argument("--no-mlxq", action="store_true", help="Run stock mlx-lm (for comparison).")
    p.add_argument(
        "--verbose",
        type=lambda s: s.lower() in ("1", "true", "t", "yes"),
        default=True,
        help="Stream text and print statistics (default: True).",
    )
    return p


class ProgressBar:
    """Prefill progress on stderr: shown once a prompt needs more than one step."""

    def __init__(self, step: int, stream=None, width: int = 30):
        # sys.stderr when the bar is made, not when this module was imported
        # (a test's captured stream may be closed by then).
        self.step, self.width = step, width
        self.stream = sys.stderr if stream is None else stream
        self.start = None
        self.shown = False

    def __call__(self, done: int, total: int) -> None:
        if self.start is None:
            self.start = time.perf_counter()
        if total <= self.step:
            return
        elapsed = time.perf_counter() - self.start
        filled = int(self.width * done / max(total, 1))
        rate = f"{done / elapsed:8.1f} tok/s" if elapsed > 0 and done else " " * 14
        self.stream.write(
            f"\rprefill [{'#' * filled}{'.' * (self.width - filled)}] "
            f"{done:>{len(str(total))}}/{total} tokens {rate}"
        )
        self.shown = True
        if done >= total:
            self.stream.write("\n")
        self.stream.flush()


def load_model(args):
    if args.random_model is not None:
        seed = 0 if args.seed is None else args.seed
        return random_model(args.random_model, args.random_size, seed=seed), None
    from mlx_lm.utils import load

    model, tokenizer, config = load(
        args.model or "mlx-community/Llama-3.2-3B-Instruct-4bit", return_config=True
    )
    return (model, tokenizer), config


def encode_prompt(args, tokenizer):
    prompt = args.prompt.replace("\\n", "\n").replace("\\t", "\t")
    if prompt == "-":
        prompt = sys.stdin.read()
    use_chat = (
        args.random_model is None and not args.ignore_chat_template and tokenizer.has_chat_template
    )
    if use_chat:
        messages = (
            []
            if args.system_prompt is None
            else [{"role": "system", "content": args.system_prompt}]
        )
        messages.append({"role": "user", "content": prompt})
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        tokens = tokenizer.encode(prompt, add_special_tokens=False)
    else:
        tokens = tokenizer.encode(prompt)
    if args.prompt_tokens is not None:
        if not tokens:
            raise SystemExit("--prompt-tokens needs a non-empty prompt to repeat.")
        reps = -(-args.prompt_tokens // len(tokens))
        tokens = (tokens * reps)[: args.prompt_tokens]
    return tokens


def describe_cache(cache) -> str:
    kinds = {}
    for c in cache:
        name = type(c).__name__
        if hasattr(c, "bits"):
            vgs, vbits = (
                c.format.side(values=True) if hasattr(c, "format") else (c.group_size, c.bits)
            )
            if (vgs, vbits) == (c.group_size, c.bits):
                name += f"({c.bits}-bit, group {c.group_size})"
            else:
                name += f"(K {c.bits}-bit group {c.group_size}, V {vbits}-bit group {vgs})"
        kinds[name] = kinds.get(name, 0) + 1
    nbytes = sum(getattr(c, "nbytes", 0) for c in cache)
    parts = ", ".join(f"{n} x {k}" for k, n in kinds.items())
    return f"{nbytes / 1e6:.1f} MB in {parts}"


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.kv_hadamard and (args.kv_bits is None or args.no_mlxq):
        parser.error("--kv-hadamard needs --kv-bits, and mlxq (not --no-mlxq)")
    separate = any(x is not None for x in (args.k_bits, args.v_bits, args.v_group_size))
    if separate and (args.kv_bits is None or args.no_mlxq):
        parser.error(
            "--k-bits / --v-bits / --v-group-size need --kv-bits, and mlxq (not --no-mlxq)"
        )
    if args.kv_recent is not None and (args.kv_bits is None or args.no_mlxq):
        parser.error("--kv-recent needs --kv-bits, and mlxq (not --no-mlxq)")
    if args.kv_layers is not None and (args.kv_bits is None or args.no_mlxq):
        parser.error("--kv-layers needs --kv-bits, and mlxq (not --no-mlxq)")
    if args.seed is not None:
        mx.random.seed(args.seed)
    lm_generate = importlib.import_module("mlx_lm.generate")
    from mlx_lm.models import cache as lm_cache
    from mlx_lm.sample_utils import make_sampler

    handle = (
        None
        if args.no_mlxq
        else mlxq_lm.enable(
            kv_hadamard=args.kv_hadamard,
            k_bits=args.k_bits,
            v_bits=args.v_bits,
            v_group_size=args.v_group_size,
            kv_recent=args.kv_recent,
            kv_layers=args.kv_layers,
        )
    )
    try:
        metadata = {}
        if args.prompt_cache_file is not None:
            prompt_cache, metadata = lm_cache.load_prompt_cache(
                args.prompt_cache_file, return_metadata=True
            )
            if args.model is None and args.random_model is None and "model" in metadata:
                args.model = metadata["model"]
        (model, tokenizer), _ = load_model(args)
        tokens = encode_prompt(args, tokenizer)
        if args.prompt_cache_file is None:
            at_start = args.kv_bits is not None and args.quantized_kv_start == 0 and handle
            prompt_cache = lm_cache.make_prompt_cache(
                model,
                args.max_kv_size,
                **(
                    {"kv_bits": args.kv_bits, "kv_group_size": args.kv_group_size}
                    if at_start
                    else {}
                ),
            )
        # This run alone holds its cache (made or loaded here): its state reads
        # are mlx-lm's evaluations, which may leave the writes in place.
        mlxq_lm.mark_private(prompt_cache)
        sampler = make_sampler(args.temp, args.top_p, args.min_p, top_k=args.top_k)
        backend = "stock mlx-lm" if args.no_mlxq else "mlx-lm + mlxq"
        if args.kv_bits is None:
            kv = "bf16 KV"
        elif args.no_mlxq:
            kv = f"{args.kv_bits}-bit KV (group {args.kv_group_size})"
        else:
            # (--max-kv-size makes rings of models without their own caches.)
            rings = None if hasattr(model, "make_cache") else args.max_kv_size
            kv = "KV cache " + mlxq_lm.settings().describe(
                args.kv_bits, args.kv_group_size, cli=True, max_kv_size=rings
            )
        name = (
            f"random {args.random_model} ({args.random_size})" if args.random_model else args.model
        )
        if args.verbose:
            print(f"[{backend}] {name}, {len(tokens)} prompt tokens, {kv}", file=sys.stderr)
            print("=" * 10)
        mx.reset_peak_memory()
        response = None
        for response in lm_generate.stream_generate(
            model,
            tokenizer,
            tokens,
            max_tokens=args.max_tokens,
            sampler=sampler,
            prompt_cache=prompt_cache,
            prefill_step_size=args.prefill_step_size,
            kv_bits=args.kv_bits,
            kv_group_size=args.kv_group_size,
            quantized_kv_start=args.quantized_kv_start,
            prompt_progress_callback=ProgressBar(args.prefill_step_size),
        ):
            print(response.text, end="", flush=True)
        print()
        if args.verbose and response is not None:
            print("=" * 10)
            print(
                f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.3f} tokens-per-sec"
            )
            print(
                f"Generation: {response.generation_tokens} tokens, "
                f"{response.generation_tps:.3f} tokens-per-sec"
            )
            print(f"Peak memory: {response.peak_memory:.3f} GB")
            print(f"KV cache: {describe_cache(prompt_cache)}")
            if handle is not None:
                print(f"Attention calls: {json.dumps(mlxq_lm.counters())}")
    finally:
        if handle is not None:
            mlxq_lm.disable()
    return 0


if __name__ == "__main__":
    sys.exit(main())
