"""`kvfleet model make-tiny DIR`: write the tiny local Llama (tokenizer included) that tests and the demo serve.

A command rather than a test fixture only, so the demo, the e2e harness and the vLLM engine's tests
build the very same model from one line of shell, with no model hub.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvfleet.worker.model.tiny import TinyModelError, make_tiny


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    tiny = actions.add_parser(
        "make-tiny",
        help="write a 2-layer random-weight Llama and its BPE tokenizer into DIR (idempotent)",
        description="Write a 2-layer random-weight Llama (HF format, float32) and its byte-level BPE "
        "tokenizer into DIR. The same seed always writes the same bytes; a DIR that already holds "
        "that model is left alone.",
    )
    tiny.add_argument("directory", type=Path, metavar="DIR", help="created if missing; must be empty or hold this model")
    tiny.add_argument("--seed", type=int, default=0, help="seed of the random weights (0)")


def run(args: argparse.Namespace) -> int:
    if args.model_command != "make-tiny":  # argparse only lets known actions through
        raise AssertionError(args.model_command)
    directory: Path = args.directory
    try:
        make_tiny(directory, seed=args.seed)
    except TinyModelError as err:
        print(f"kvfleet model make-tiny: {err}", file=sys.stderr)
        return 2
    print(f"tiny model (seed {args.seed}) in {directory}:")
    for path in sorted(directory.iterdir()):
        print(f"  {path.name:<26} {path.stat().st_size:>10,} bytes")
    return 0
