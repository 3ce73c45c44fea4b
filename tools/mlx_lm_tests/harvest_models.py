"""A pytest plugin: record every model mlx-lm's ``tests/test_models.py``
builds (its module, ``model_type`` and ``ModelArgs``) into the JSON file
``$MLXQ_HARVEST`` (``python -m pytest -p harvest_models``; see run.sh)."""

import json
import numbers
import os

_models = []


_SKIP = object()  # a value JSON cannot hold


def _plain(v):
    """``v`` if JSON can hold it (nested lists, dicts and config dataclasses,
    the last as dicts), else ``_SKIP``."""
    if v is None or isinstance(v, (bool, str, numbers.Integral, numbers.Real)):
        return v
    if isinstance(v, (list, tuple)):
        items = [_plain(x) for x in v]
        return _SKIP if any(x is _SKIP for x in items) else items
    if isinstance(v, dict):
        items = {str(k): _plain(x) for k, x in v.items()}
        return _SKIP if any(x is _SKIP for x in items.values()) else items
    if hasattr(v, "__dataclass_fields__"):  # a nested config (a VLM's text_config)
        return _plain(dict(vars(v)))
    return _SKIP


def pytest_configure(config):
    try:
        import test_models  # noqa: F401  (mlx-lm's tests/test_models.py, on sys.path)
    except ImportError:
        return


def pytest_collection_modifyitems(session, config, items):
    for item in items:
        cls = getattr(item, "cls", None)
        if cls is None or not hasattr(cls, "model_test_runner"):
            continue
        runner = cls.model_test_runner
        if getattr(runner, "_harvesting", False):
            continue

        def harvesting(self, model, model_type, vocab_size, num_layers, _runner=runner):
            args = getattr(model, "args", None) or getattr(model, "config", None)
            fields = {k: _plain(v) for k, v in vars(args).items()} if args is not None else {}
            _models.append(
                {
                    "test": self.id().rsplit(".", 1)[-1],
                    "module": type(model).__module__,
                    "model_type": model_type,
                    "args": {k: v for k, v in fields.items() if v is not _SKIP},
                    "vocab_size": vocab_size,
                    "num_layers": num_layers,
                }
            )
            return _runner(self, model, model_type, vocab_size, num_layers)

        harvesting._harvesting = True
        cls.model_test_runner = harvesting


def pytest_unconfigure(config):
    out = os.environ.get("MLXQ_HARVEST")
    if out and _models:
        with open(out, "w") as f:
            json.dump(_models, f, indent=1)
