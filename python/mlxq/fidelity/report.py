"""The fidelity tool's table, JSON and plot."""

import json
import os
from typing import Optional


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:+.2f}%"


def table(result: dict) -> str:
    """The settings (and per-layer sensitivity) as aligned text."""
    head = (
        "setting",
        "bits/element",
        "x 16-bit",
        "perplexity",
        "change",
        "KL mean",
        "KL p99",
        "flips",
    )
    rows = [head]
    for r in result["settings"]:
        rows.append(
            (
                r["setting"],
                f"{r['bits_per_element']:.2f}",
                f"{r['bits_per_element'] / 16:.3f}",
                f"{r['perplexity']:.3f}",
                _pct(r.get("perplexity_change")),
                "-" if "kl_mean" not in r else f"{r['kl_mean']:.5f}",
                "-" if "kl_p99" not in r else f"{r['kl_p99']:.4f}",
                "-" if "flip_rate" not in r else f"{100 * r['flip_rate']:.1f}%",
            )
        )
    lines = _aligned(rows)
    layers = result.get("per_layer")
    if layers:
        lines.append("")
        lines.append(f"per layer, {layers['setting']} on one layer at a time:")
        sub = [("layer", "KL mean", "perplexity change", "flips")]
        for r in layers["layers"]:
            sub.append(
                (
                    str(r["layer"]),
                    f"{r['kl_mean']:.5f}",
                    _pct(r["perplexity_change"]),
                    f"{100 * r['flip_rate']:.1f}%",
                )
            )
        lines.extend(_aligned(sub))
    return "\n".join(lines)


def _aligned(rows) -> list:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for j, r in enumerate(rows):
        out.append(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))
            )
        )
        if j == 0:
            out.append("-" * len(out[-1]))
    return out


def save_json(path: str, result: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")


def plot(path: str, result: dict) -> Optional[str]:
    """KL divergence against KV bytes per setting, and per layer when
    measured, as a PNG at ``path``; returns why not when it cannot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib)"
    layers = result.get("per_layer")
    fig, axes = plt.subplots(1, 2 if layers else 1, figsize=(11 if layers else 6, 4.2))
    ax = axes[0] if layers else axes
    points = [r for r in result["settings"] if "kl_mean" in r]
    ax.scatter([r["bits_per_element"] for r in points], [r["kl_mean"] for r in points])
    for r in points:
        ax.annotate(
            r["setting"],
            (r["bits_per_element"], r["kl_mean"]),
            fontsize=8,
            xytext=(3, 3),
            textcoords="offset points",
        )
    ax.set_xlabel("KV bits per element (scales, biases and window included)")
    ax.set_ylabel("mean KL divergence from unquantized (nats)")
    ax.set_yscale("log")
    ax.set_title(result.get("model", ""), fontsize=9)
    if layers:
        ks = [r["kl_mean"] for r in layers["layers"]]
        axes[1].bar(range(len(ks)), ks)
        axes[1].set_xlabel("layer (cache index)")
        axes[1].set_ylabel("mean KL, that layer alone quantized")
        axes[1].set_title(f"{layers['setting']} on one layer at a time", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
