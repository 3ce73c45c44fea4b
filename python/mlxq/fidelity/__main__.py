"""``mlxq-fidelity`` / ``python -m mlxq.fidelity``: what KV settings cost a model.

mlxq-fidelity smollm2-135m
mlxq-fidelity gemma3-270m --kv 4 4+recent128 recipe --per-layer 4 --tokens 2048
mlxq-fidelity path/to/mlx-model --text book.txt --out fidelity.json
"""

import argparse
import os
import sys

from . import DEFAULT_TEXT, GRAMMAR, default_dtype, load, measure, parse_spec, text_ids
from .report import plot, save_json, table

DEFAULT_SETTINGS = ("8", "4", "4+hadamard", "8/4", "4+recent128", "recipe")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlxq-fidelity",
        description="Measure what quantized KV settings cost a model against its unquantized "
        "KV cache: perplexity, KL divergence of the next-token distribution (mean, p99), "
        "top-1 flip rate, KV bytes, and per-layer sensitivity.",
    )
    p.add_argument(
        "model",
        help="a packaged model (smollm2-135m, gemma3-270m), a .gguf file or an mlx-lm model folder",
    )
    p.add_argument(
        "--kv",
        nargs="+",
        default=list(DEFAULT_SETTINGS),
        metavar="SETTING",
        help=f"KV settings to measure: {GRAMMAR} (default: {' '.join(DEFAULT_SETTINGS)})",
    )
    p.add_argument(
        "--per-layer",
        default=None,
        metavar="SETTING",
        help="also apply this setting to one layer at a time (one pass per layer)",
    )
    p.add_argument(
        "--layers",
        type=int,
        nargs="+",
        default=None,
        metavar="I",
        help="the cache indices --per-layer measures (default: every one)",
    )
    p.add_argument(
        "--write-layers",
        default=None,
        metavar="PATH",
        help='with --per-layer: write {"kv_layers": ...} giving the --protect most sensitive '
        "caches --protect-with, for mlxq.mlx_lm.enable(kv_layers=PATH)",
    )
    p.add_argument("--protect", type=int, default=2, help="caches --write-layers protects (2)")
    p.add_argument(
        "--protect-with", default="8", metavar="SETTING", help="their setting (default 8)"
    )
    p.add_argument(
        "--kv-layers",
        default=None,
        metavar="PATH",
        help='also measure --kv-layers-base with the per-cache settings of a {"kv_layers": ...} '
        "JSON file (as --write-layers writes it), at its mean bits per element",
    )
    p.add_argument(
        "--kv-layers-base",
        default="4",
        metavar="SETTING",
        help="the other caches' setting with --kv-layers (default 4)",
    )
    p.add_argument(
        "--text", default=DEFAULT_TEXT, help="a UTF-8 text file (default: the Apache License 2.0)"
    )
    p.add_argument(
        "--tokens", type=int, default=1024, help="tokens of the text to read (default 1024)"
    )
    p.add_argument("--chunk", type=int, default=64, help="tokens per forward pass (default 64)")
    p.add_argument("--out", default=None, help="JSON path (default fidelity_<model>.json here)")
    p.add_argument("--plot", default=None, help="PNG path (default: the JSON's, as .png)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        specs = [parse_spec(s) for s in args.kv]
        per_layer = parse_spec(args.per_layer) if args.per_layer else None
        protect_with = parse_spec(args.protect_with)
        if args.write_layers and per_layer is None:
            raise ValueError("--write-layers needs --per-layer (the sensitivity it ranks by).")
        mixed = None
        if args.kv_layers:
            from ..mlx_lm.settings import layers_from

            own = dict(layers_from(args.kv_layers, "mlxq-fidelity --kv-layers"))
            mixed = (parse_spec(args.kv_layers_base), own)
        model, tokenizer = load(args.model, dtype=default_dtype())
        ids = text_ids(tokenizer, args.text, args.tokens)
    except (ValueError, OSError) as e:
        print(f"mlxq-fidelity: {e}", file=sys.stderr)
        return 2
    layers = 0 if per_layer is None else len(args.layers or model.layers)
    passes = 1 + len(specs) + layers + (mixed is not None)
    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=len(ids) - 1, unit="tok", desc=f"{passes} passes", file=sys.stderr)
    try:
        result = measure(
            model,
            ids,
            specs,
            chunk=args.chunk,
            per_layer=per_layer,
            layers=args.layers,
            mixed=mixed,
            progress=bar.update if bar is not None else None,
        )
    except ValueError as e:
        print(f"mlxq-fidelity: {e}", file=sys.stderr)
        return 2
    finally:
        if bar is not None:
            bar.close()
    name = os.path.basename(os.path.normpath(args.model)).removesuffix(".gguf")
    result = dict(model=args.model, text=args.text, tokens=len(ids), chunk=args.chunk, **result)
    print(table(result))
    out = args.out or f"fidelity_{name}.json"
    save_json(out, result)
    print(f"saved {out}")
    if args.write_layers:
        ranked = sorted(result["per_layer"]["layers"], key=lambda r: -r["kl_mean"])
        chosen = {str(r["layer"]): protect_with.label for r in ranked[: max(args.protect, 0)]}
        save_json(args.write_layers, {"kv_layers": chosen, "ranked_by": per_layer.label})
        print(f"saved {args.write_layers}: {chosen}")
    png = args.plot or os.path.splitext(out)[0] + ".png"
    why = plot(png, result)
    print(f"no plot: {why}" if why else f"saved {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
