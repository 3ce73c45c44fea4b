"""A pytest plugin: mlxq.mlx_lm.enable() before mlx-lm's own tests run
(``python -m pytest -p mlxq_enabled``; see run.sh)."""

import mlxq.mlx_lm


def pytest_configure(config):
    mlxq.mlx_lm.enable()


def pytest_report_header(config):
    return "mlxq.mlx_lm enabled for every test"
