#!/bin/bash
# mlx-lm's own tests, from the source distribution of the installed mlx-lm,
# run with mlxq.mlx_lm.enable() in force (and, with --stock, without it).
#
#   bash tools/mlx_lm_tests/run.sh                        # tests/test_models.py
#   bash tools/mlx_lm_tests/run.sh tests/test_generate.py tests/test_prompt_cache.py
#   bash tools/mlx_lm_tests/run.sh --stock                # the same tests, stock mlx-lm
#
# The source distribution comes from the package index (pip download), once
# per version, into ${MLX_LM_SRC:-/tmp/mlx-lm-src}.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
plugin=(-p mlxq_enabled)
if [[ "${1:-}" == "--stock" ]]; then plugin=(); shift; fi
tests=("$@")
[[ ${#tests[@]} -eq 0 ]] && tests=(tests/test_models.py)
version=$(python3 -c "import mlx_lm; print(mlx_lm.__version__)")
src=${MLX_LM_SRC:-/tmp/mlx-lm-src}/$version
if [[ ! -d "$src/mlx_lm-$version/tests" ]]; then
  mkdir -p "$src"
  python3 -m pip download -q --no-deps --no-binary :all: "mlx-lm==$version" -d "$src"
  tar xzf "$src/mlx_lm-$version.tar.gz" -C "$src"
fi
cd "$src/mlx_lm-$version"
echo "mlx-lm $version's ${tests[*]}, ${plugin[*]:+with mlxq enabled}${plugin[*]:-stock}"
# The installed mlx_lm (not the source tree's copy) is what runs: -P keeps the
# current directory off sys.path.
PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" python3 -P -m pytest -q -p no:cacheprovider \
  "${plugin[@]}" "${tests[@]}"
