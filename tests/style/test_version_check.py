"""mlxq refuses, with a clear ImportError, to run against another MLX."""

import mlx.core as mx
import pytest

from mlxq import _build_info, _ext
from mlxq._version_check import check_mlx_version


def test_extension_was_built_against_the_installed_mlx():
    assert _build_info.MLX_VERSION == mx.__version__ == _ext.mlx_version


def test_other_mlx_version_is_refused(monkeypatch):
    monkeypatch.setattr(mx, "__version__", "0.0.1")
    with pytest.raises(
        ImportError, match=r"mlxq was built against MLX .* but MLX 0\.0\.1 is installed"
    ):
        check_mlx_version()
