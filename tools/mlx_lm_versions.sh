#!/usr/bin/env bash
# Runs the mlx-lm-facing tests (tests/lm, tests/caches) against each mlx-lm
# release in the supported range, each in a fresh venv that sees this
# environment's mlxq, MLX and test dependencies (--system-site-packages) and
# shadows its mlx-lm with the release under test. CI runs the installed
# release; this script covers the others.
#
#   bash tools/mlx_lm_versions.sh                 # 0.32.0 0.32.1 0.32.2
#   bash tools/mlx_lm_versions.sh 0.32.1          # one release
#   MARK="lm and not slow" bash tools/mlx_lm_versions.sh
set -euo pipefail
cd "$(dirname "$0")/.."
versions=("$@")
[[ ${#versions[@]} -gt 0 ]] || versions=(0.32.0 0.32.1 0.32.2)
mark=${MARK:-not slow}
root=${MLX_LM_VENVS:-build/mlx_lm_versions}
status=0
for v in "${versions[@]}"; do
  venv="$root/$v"
  if [[ ! -x "$venv/bin/python" ]]; then
    python3 -m venv --system-site-packages "$venv"
    "$venv/bin/python" -m pip install -q --no-deps "mlx-lm==$v"
  fi
  found=$("$venv/bin/python" -c "import mlx_lm; print(mlx_lm.__version__)")
  echo "== mlx-lm $found ($venv)"
  if ! "$venv/bin/python" -m pytest -q -p no:cacheprovider -m "$mark" tests/lm tests/caches; then
    status=1
  fi
done
exit $status
