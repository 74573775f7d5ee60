#!/usr/bin/env bash
# Lightning's public-behaviour tests against this checkout's polytrain: run.sh LIGHTNING_CHECKOUT WORK_DIR
# (README.md in this folder). Prints pytest's summary, then score.py's figure.
set -euo pipefail
lightning=$(realpath "$1")
work=$(realpath -m "$2")
here=$(dirname "$(realpath "$0")")
repo=$(realpath "${POLYTRAIN_REPO:-$here/../..}")  # POLYTRAIN_REPO: measure another checkout
python=${PYTHON:-$here/../../.venv/bin/python}  # this checkout's venv
rm -rf "$work" && mkdir -p "$work"
cp -r "$lightning/tests/tests_pytorch" "$work/"
cp "$lightning/src/lightning/pytorch/demos/boring_classes.py" "$work/tests_pytorch/boring_classes.py"
cd "$work/tests_pytorch"
# polytrain's seed variable beside Lightning's in the conftest's list of variables a test may leave set
sed -i 's/^\( *\)"PL_GLOBAL_SEED",/\1"PL_GLOBAL_SEED",\n\1"POLYTRAIN_SEED",/' conftest.py
mapfile -t files < "$here/files.txt"
helpers=(helpers/simple_models.py helpers/advanced_models.py helpers/datamodules.py
         helpers/deterministic_model.py boring_classes.py)
for f in "${files[@]}" "${helpers[@]}"; do
    sed -i -E -e 's/lightning\.pytorch\.demos\.boring_classes/tests_pytorch.boring_classes/g' \
        -e 's/\blightning\.pytorch\b/polytrain/g' -e 's/\bpytorch_lightning\b/polytrain/g' "$f"
done
# The helpers are scaffolding, not a user's project: they take the two base classes from the top.
for f in "${helpers[@]}"; do
    sed -i -E -e 's/^from polytrain\.core\.(module|datamodule) import/from polytrain import/' \
        -e 's/^from polytrain\.core\.optimizer import LightningOptimizer/LightningOptimizer = ()/' \
        -e 's/^from polytrain\.utilities\.types import STEP_OUTPUT/from typing import Any as STEP_OUTPUT/' "$f"
done
"$python" "$here/wrap_imports.py" "${files[@]}"
cd "$work"
status=0
PYTHONPATH="$work:$repo" timeout 3600 "$python" -m pytest -p no:cacheprovider -q -n 2 --timeout 120 \
    --junitxml="$work/result.xml" "${files[@]/#/tests_pytorch/}" > "$work/pytest.log" 2>&1 || status=$?
tail -1 "$work/pytest.log"
"$python" "$here/score.py" "$work" "$lightning/tests/tests_pytorch" "$here/files.txt"
exit 0
