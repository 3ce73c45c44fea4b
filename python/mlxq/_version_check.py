"""Refuses, before the extension is loaded, to run against another MLX.

The compiled extension links against the exact libmlx and nanobind ABI that it
was built with; loading it into a different MLX fails with obscure symbol or
type errors, or worse, runs with mismatched object layouts.
"""

import mlx.core as mx


def check_mlx_version() -> None:
    try:
        from ._build_info import MLX_VERSION as built
    except ImportError as e:  # pragma: no cover - a broken install
        raise ImportError(
            "mlxq's compiled extension is missing; reinstall mlxq with "
            "`pip install .` from its checkout."
        ) from e
    if built != mx.__version__:
        raise ImportError(
            f"mlxq was built against MLX {built} but MLX {mx.__version__} is "
            f"installed. Rebuild mlxq against this MLX (`pip install "
            f"--no-build-isolation --force-reinstall .` from its checkout) or "
            f"install mlx=={built}."
        )
