"""`python -m kvfleet.operator`: run the operator (the entrypoint of the kvfleet/operator image)."""

from __future__ import annotations

import argparse
import logging
import sys

import kopf

import kvfleet.operator.handlers  # noqa: F401 - registers the handlers with kopf


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvfleet-operator", description=__doc__.splitlines()[0])
    parser.add_argument("--namespace", action="append", default=[], help="watch only these namespaces (repeatable)")
    parser.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", help="kopf liveness endpoint URL")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # One replica with a Recreate rollout for now: kopf peering is not leader election (FIELD-NOTES).
    kopf.run(standalone=True, clusterwide=not args.namespace, namespaces=args.namespace,
             liveness_endpoint=args.liveness)
    return 0


if __name__ == "__main__":
    sys.exit(main())
