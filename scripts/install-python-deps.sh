#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment from the project's own files only.
# Usage: install-python-deps.sh VENV PYTHON
set -euo pipefail
venv=${1:-.venv}
python=${2:-python3}
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet -e '.[dev]'
# torch (CPU use only) and triton: installed by their own script because PyPI's torch wheel pulls
# several GB of CUDA libraries that a CPU machine never loads.
if [ -f scripts/install-torch.sh ]; then bash scripts/install-torch.sh "$venv"; fi
