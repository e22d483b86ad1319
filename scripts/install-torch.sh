#!/usr/bin/env bash
# Installs torch and triton into a venv for CPU use (the Triton interpreter and the torch references
# of kernels/kvfleet/kernels), from PyPI only, without the several GB of CUDA libraries.
# Usage: install-torch.sh VENV        (called by install-python-deps.sh; idempotent)
#
# Why this is not `pip install torch`: PyPI's Linux wheel of torch 2.13.0 requires cuda-toolkit 13 and
# nvidia-* (cudnn, cublas, nccl, nvshmem, ...): 4.7 GB installed, and a CPU machine never runs them.
# `pip install --no-deps torch` alone does not import: libtorch.so, libtorch_cpu.so and
# libtorch_python.so are linked against libcudart, libcupti, libcudnn, libnccl, ... (DT_NEEDED), and
# nearly every nvidia-* package is needed for the loader to succeed, so no smaller real subset exists.
# What works: the wheel without its dependencies, then one small stand-in library per missing CUDA
# library, built here with cc from the symbols torch imports (every entry returns
# cudaErrorNoDevice). torch then imports, computes on the CPU and says torch.cuda.is_available() ==
# False. The stand-ins live in torch/lib, the last directory of torch's RPATH, so real nvidia-*
# packages installed later (the vLLM path) take precedence over them. Without a C compiler the
# script falls back to the full wheel with its CUDA dependencies.
set -euo pipefail
venv=${1:?usage: install-torch.sh VENV}
py="$venv/bin/python"
[ -x "$py" ] || { echo "install-torch.sh: no python at $py" >&2; exit 2; }

# The versions are pinned together: torch 2.13.0 pins triton 3.7.1; the rest are torch's pure-python
# requirements plus numpy, which the Triton interpreter computes with.
TORCH_VERSION=2.13.0
TRITON_VERSION=3.7.1
PURE_DEPS=(filelock==4.2.11 "typing-extensions==4.16.0" sympy==1.14.0 mpmath==1.3.0 networkx==3.6.1
           jinja2==3.1.6 markupsafe==3.0.4 fsspec==2026.9.0 "setuptools>=77.0.3" numpy==2.4.6)

# Imports torch and runs one kernel through the interpreter: the check that the install is usable,
# not only present.
works() {
    # triton.jit reads the kernel's source, so the check runs from a file, not from stdin.
    local check rc=0
    check=$(mktemp --suffix=.py)
    cat >"$check" <<'EOF'
import sys
import torch, triton, triton.language as tl
assert torch.__version__.split("+")[0] == sys.argv[1], torch.__version__
assert triton.__version__ == sys.argv[2], triton.__version__

@triton.jit
def _add_one(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1.0, mask=offs < n)

x = torch.zeros(3)
_add_one[(1,)](x, 3, BLOCK=4)
assert x.tolist() == [1.0, 1.0, 1.0]
EOF
    TRITON_INTERPRET=1 "$py" "$check" "$TORCH_VERSION" "$TRITON_VERSION" >/dev/null 2>&1 || rc=$?
    rm -f "$check"
    return $rc
}

if works; then
    echo "install-torch.sh: torch $TORCH_VERSION and triton $TRITON_VERSION already work in $venv"
    exit 0
fi

pip_install() { "$py" -m pip install --quiet --disable-pip-version-check "$@"; }

have_version() {  # have_version DIST VERSION
    "$py" - "$1" "$2" <<'EOF' 2>/dev/null
import sys
from importlib.metadata import version
sys.exit(0 if version(sys.argv[1]).split("+")[0] == sys.argv[2] else 1)
EOF
}

if ! command -v cc >/dev/null || ! command -v nm >/dev/null || ! command -v readelf >/dev/null; then
    echo "install-torch.sh: no cc/binutils here, installing torch with its CUDA libraries (~4.7 GB)" >&2
    pip_install "torch==$TORCH_VERSION" "triton==$TRITON_VERSION" "${PURE_DEPS[@]}"
    works || { echo "install-torch.sh: torch/triton installed but do not work" >&2; exit 1; }
    exit 0
fi

have_version torch "$TORCH_VERSION" || pip_install --no-deps "torch==$TORCH_VERSION"
have_version triton "$TRITON_VERSION" || pip_install --no-deps "triton==$TRITON_VERSION"
# pip reports torch's CUDA requirements as unmet here: expected, that is the point of this script.
pip_install "${PURE_DEPS[@]}" 2>&1 | { grep -v -E "dependency resolver does not|torch $TORCH_VERSION requires" || true; }
[ "${PIPESTATUS[0]}" -eq 0 ]

torch_dir=$("$py" -c 'import importlib.util, os; print(os.path.dirname(importlib.util.find_spec("torch").origin))')
"$py" - "$torch_dir" <<'EOF'
"""Builds one stand-in shared library per CUDA library that torch's binaries need but cannot find."""
import os
import pathlib
import re
import subprocess
import sys
import tempfile

torch_dir = pathlib.Path(sys.argv[1])
lib_dir = torch_dir / "lib"
binaries = [p for p in sorted(lib_dir.glob("*.so*")) + sorted(torch_dir.glob("_C*.so")) if p.is_file()]


def run(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


# libcuda.so.1 (the driver) is left out: only lazily loaded NVRTC code links it, and a stand-in
# would mislead Triton's own driver detection.
missing_by_binary = {
    p: [m for m in re.findall(r"^\s*(\S+) => not found", run("ldd", str(p)), re.M) if m != "libcuda.so.1"]
    for p in binaries
}
missing = sorted({m for ms in missing_by_binary.values() for m in ms})
if not missing:
    sys.exit(0)

# Versioned imports name their library through the "Version needs" section (NVSHMEM -> libnvshmem_host).
version_to_lib: dict[str, str] = {}
for p in binaries:
    current = None
    for line in run("readelf", "-V", "-W", str(p)).splitlines():
        if m := re.search(r"File: (\S+)", line):
            current = m.group(1)
        elif (m := re.search(r"Name: (\S+)", line)) and current in missing:
            version_to_lib[m.group(1)] = current

# Unversioned imports that nothing else defines (torch's own libraries, the system libraries they
# load, the python executable) must come from a missing library: give them to each one it needs.
found_libs = {m for p in binaries for m in re.findall(r"=> (/\S+)", run("ldd", str(p)))}
defined = set()
for p in [*binaries, *sorted(found_libs), pathlib.Path(os.path.realpath(sys.executable))]:
    for line in run("nm", "-D", "--defined-only", str(p)).splitlines():
        defined.add(line.split()[-1].split("@")[0])

symbols: dict[str, dict[str, str]] = {lib: {} for lib in missing}  # lib -> symbol -> version node
for p in binaries:
    for line in run("nm", "-D", "--undefined-only", str(p)).splitlines():
        kind, sym = line.split()[-2:]
        name, _, version = sym.partition("@")
        version = version.lstrip("@")
        if kind != "U":
            continue
        if version in version_to_lib:
            symbols[version_to_lib[version]][name] = version
        elif not version and name not in defined:
            for lib in missing_by_binary[p]:
                symbols[lib].setdefault(name, lib)

# Functions returning a message are read as char pointers by torch's error paths.
returns_message = re.compile(r"ErrorString|GetErrorName|StatusString|GetStatusName")
work = pathlib.Path(tempfile.mkdtemp(prefix="kvfleet-cuda-stubs-"))
for lib in missing:
    c_lines = ['static const char msg[] = "kvfleet CPU install: stand-in CUDA library, no CUDA device";']
    nodes: dict[str, list[str]] = {}
    for i, (name, node) in enumerate(sorted(symbols[lib].items())):
        nodes.setdefault(node, []).append(name)
        if returns_message.search(name):
            c_lines.append(f'const char *s{i}(void) __asm__("{name}"); const char *s{i}(void) {{ return msg; }}')
        else:  # 100 is cudaErrorNoDevice; the other libraries read any non-zero status as failure
            c_lines.append(f'long s{i}(void) __asm__("{name}"); long s{i}(void) {{ return 100; }}')
    (work / f"{lib}.c").write_text("\n".join(c_lines) + "\n")
    (work / f"{lib}.map").write_text(
        "".join(f"{node} {{\n  global:\n" + "".join(f"    {n};\n" for n in names) + "};\n" for node, names in nodes.items())
    )
    subprocess.run(
        ["cc", "-shared", "-fPIC", "-o", str(lib_dir / lib), f"-Wl,-soname,{lib}",
         f"-Wl,--version-script={work / (lib + '.map')}", str(work / f"{lib}.c")],
        check=True,
    )
print(f"install-torch.sh: {len(missing)} stand-in CUDA libraries in {lib_dir}")
EOF

works || { echo "install-torch.sh: torch/triton installed but do not work (try: $py -c 'import torch')" >&2; exit 1; }
echo "install-torch.sh: torch $TORCH_VERSION (CPU) and triton $TRITON_VERSION ready in $venv"
