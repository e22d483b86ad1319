"""The `kvfleet` command: one entry point whose subcommands live next to the code they drive.

Subcommands are imported lazily so that `kvfleet simulate` never pays for (or needs) the Kubernetes
client, and `kvfleet model make-tiny` never needs the simulator's plotting stack.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# name -> (module, one-line help). Each module defines `add_arguments(parser)` and `run(args) -> int`.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "crds": ("kvfleet.api.generate", "write crds/*.yaml from the pydantic models (or --check them)"),
    "simulate": ("kvfleet.sim.cli", "replay a trace under MELL and the baselines; print GPUs needed"),
    "replay": ("kvfleet.replay.cli", "send a trace slice through a pool's router; record GPUs, moves and latency"),
    "model": ("kvfleet.worker.model.cli", "build a small local model (make-tiny) for tests and the demo"),
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvfleet", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    modules = {}
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:  # an optional extra is not installed
            sub_parser.set_defaults(_missing=f"`kvfleet {name}` needs {err.name}: pip install 'kvfleet[dev]'")
            continue
        module.add_arguments(sub_parser)
        modules[name] = module
    args = parser.parse_args(argv)
    missing = getattr(args, "_missing", None)
    if missing:
        print(missing, file=sys.stderr)
        return 2
    return int(modules[args.command].run(args))


if __name__ == "__main__":
    sys.exit(main())
