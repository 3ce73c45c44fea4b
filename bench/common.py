"""Helpers shared by the bench scripts: timing, machine info, tables, JSON.

Bench scripts are plain scripts, not a package; they put bench/ on ``sys.path``
and ``import common``.
"""

import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import time

import mlx.core as mx

import mlxq


def time_fn(fn, *, warmup=2, repeats=10):
    """Time ``fn()`` (evaluated with ``mx.eval``): ``warmup`` untimed calls, then
    ``repeats`` timed ones. Returns a dict of milliseconds: median, min, all."""
    return time_interleaved({"fn": fn}, warmup=warmup, repeats=repeats)["fn"]


def time_interleaved(fns, *, warmup=2, repeats=10):
    """Like time_fn for several functions, called in turn (a, b, c, a, b, c,
    ...) so that a shared machine's slow and fast phases fall on all of them
    alike. ``fns``: name -> function. Returns name -> time_fn's dict."""
    for _ in range(warmup):
        for fn in fns.values():
            mx.eval(fn())
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            mx.eval(fn())
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {
        name: {"median_ms": statistics.median(t), "min_ms": min(t), "times_ms": t}
        for name, t in times.items()
    }


@contextlib.contextmanager
def cpu_int(flag):
    """Within the block, ``MLXQ_CPU_INT=flag`` ("0": the CPU kernel's f32
    products, "1": its integer ones), set through mlxq's environment hook."""
    previous = mlxq._ext._environment()["MLXQ_CPU_INT"]
    mlxq._ext._set_environment("MLXQ_CPU_INT", flag)
    try:
        yield
    finally:
        mlxq._ext._set_environment("MLXQ_CPU_INT", previous)


def cpu_int_path(flag, fn):
    """``fn()`` evaluated with ``MLXQ_CPU_INT=flag`` (see cpu_int). The kernel
    reads the switch when it runs, so the output is evaluated under it."""
    with cpu_int(flag):
        out = fn()
        mx.eval(out)
        return out


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit():
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            cwd=os.path.dirname(os.path.abspath(__file__)),
            timeout=10,
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def machine_info():
    """What the numbers depend on: CPU, cores, MLX version, mlxq threads."""
    env_threads = os.environ.get("MLXQ_NUM_THREADS")
    return {
        "cpu": cpu_model(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "mlx_version": mx.__version__,
        "mlx_device": str(mx.default_device()),
        "mlxq_threads": int(env_threads) if env_threads else os.cpu_count(),
        "mlxq_threads_source": "MLXQ_NUM_THREADS" if env_threads else "os.cpu_count()",
        "python": platform.python_version(),
        "git_commit": git_commit(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }


def print_machine(info):
    print(f"machine : {info['cpu']} ({info['cpu_count']} cores), {info['platform']}")
    print(f"mlx     : {info['mlx_version']} on {info['mlx_device']}")
    print(
        f"mlxq    : {info['mlxq_threads']} threads ({info['mlxq_threads_source']}), "
        f"commit {info['git_commit']}"
    )
    print(f"date    : {info['date']}")


class Table:
    """A table printed row by row as results arrive.

    ``columns`` is a list of ``(header, key, fmt)``, fmt like ``"{:.2f}"``; a
    missing or ``None`` value prints as ``-``.
    """

    def __init__(self, columns, min_width=7):
        self.columns = columns
        self.widths = [max(len(h), min_width) for h, _, _ in columns]

    def header(self):
        line = "  ".join(h.rjust(w) for (h, _, _), w in zip(self.columns, self.widths))
        print(line)
        print("-" * len(line), flush=True)

    def row(self, r):
        cells = [fmt.format(r[k]) if r.get(k) is not None else "-" for _, k, fmt in self.columns]
        print("  ".join(c.rjust(w) for c, w in zip(cells, self.widths)), flush=True)


BENCH = os.path.dirname(os.path.abspath(__file__))


def results_path(name, quick=False, record=False):
    """Default JSON path: bench/out/<name>.json (untracked), or the tracked
    bench/results/<name>.json with ``record``; <name>_quick.json for --quick."""
    folder = "results" if record else "out"
    return os.path.join(BENCH, folder, f"{name}{'_quick' if quick else ''}.json")


def add_output_args(parser):
    """``--out PATH`` and ``--record`` (write to bench/results/ instead of the
    untracked bench/out/)."""
    parser.add_argument("--out", default=None, help="JSON output path (default bench/out/)")
    parser.add_argument(
        "--record",
        action="store_true",
        help="write the JSON (and plot) to the tracked bench/results/ instead of bench/out/",
    )


def output_path(args, name, quick=False):
    """Where a script run with add_output_args' options writes ``name``."""
    return args.out or results_path(name, quick, getattr(args, "record", False))


def save_json(path, payload, quiet=False):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")
    if not quiet:
        print(f"saved {path}")


class MarkdownTable:
    """A markdown table printed row by row, like :class:`Table`.

    ``columns`` is a list of ``(header, key, fmt)``; a missing or ``None``
    value prints as ``-``, a string value as it is.
    """

    def __init__(self, columns):
        self.columns = columns

    def header(self):
        print("| " + " | ".join(h for h, _, _ in self.columns) + " |")
        print("|" + "|".join("---" for _ in self.columns) + "|", flush=True)

    def row(self, r):
        cells = []
        for _, k, fmt in self.columns:
            v = r.get(k)
            cells.append("-" if v is None else v if isinstance(v, str) else fmt.format(v))
        print("| " + " | ".join(cells) + " |", flush=True)


def slug(name):
    """``"NVIDIA H200"`` -> ``"nvidia_h200"``: lower case, runs of other characters
    as one underscore."""
    out = "".join(c if c.isalnum() else "_" for c in name.lower())
    while "__" in out:
        out = out.replace("__", "_")
    return out.strip("_")
