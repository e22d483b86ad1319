"""What each of the project's images runs, and a container's command line built from it.

images.yaml (beside this module) is the one place that says what an image runs: the node agent runs
those entrypoints as local processes, and the Dockerfiles take their ENTRYPOINT and CMD from it
(tests/unit/test_images.py checks that they agree).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import yaml

IMAGES_FILE = Path(__file__).resolve().parent / "images.yaml"


def image_name(image: str) -> str:
    """`registry/kvfleet/worker:tag@sha` -> `kvfleet/worker` (the key of images.yaml)."""
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    if ":" in last:
        name = name[: len(name) - len(last)] + last.split(":", 1)[0]
    parts = name.split("/")
    return "/".join(parts[-2:]) if len(parts) >= 2 else name


def load_images(path: Path = IMAGES_FILE) -> dict[str, dict[str, list[str]]]:
    data = yaml.safe_load(path.read_text())
    return {name: {"entrypoint": list(v.get("entrypoint") or []), "cmd": list(v.get("cmd") or [])} for name, v in data.items()}


def container_argv(container: dict[str, Any], images: dict[str, dict[str, list[str]]], env: dict[str, str]) -> list[str]:
    """Docker/Kubernetes semantics: `command` replaces the entrypoint, `args` replace the cmd."""
    spec = images[image_name(container["image"])]
    command = container.get("command")
    args = container.get("args")
    if command:
        argv = list(command) + list(args or [])
    else:
        argv = spec["entrypoint"] + (list(args) if args is not None else spec["cmd"])
    return local_python([expand_env_refs(a, env) for a in argv])


def local_python(argv: list[str]) -> list[str]:
    """`python` as the first word means the Python of the environment the agent runs in (images.yaml)."""
    if argv and argv[0] in ("python", "python3"):
        return [sys.executable, *argv[1:]]
    return argv


_ENV_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)|\$\$")


def expand_env_refs(text: str, env: dict[str, str]) -> str:
    """$(VAR) expansion of command and args as the kubelet does it ($$ escapes, unknown refs stay)."""

    def repl(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return _ENV_REF.sub(repl, text)
