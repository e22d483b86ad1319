"""`python -m kvfleet.operator`: run the operator (the entrypoint of the kvfleet/operator image)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import kopf

import kvfleet.operator.handlers  # noqa: F401 - registers the handlers with kopf
from kvfleet.api.incluster import load_config
from kvfleet.operator import metrics
from kvfleet.operator.kube import Kube, WriteFence
from kvfleet.operator.leader import LeaderElector
from kvfleet.operator.runtime import MEMO_KEY, Operator

log = logging.getLogger("kvfleet.operator")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvfleet-operator", description=__doc__.splitlines()[0])
    parser.add_argument("--namespace", action="append", default=[], help="watch only these namespaces (repeatable)")
    parser.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", help="kopf's liveness endpoint URL")
    parser.add_argument("--metrics-address", default="0.0.0.0", help="address of the Prometheus /metrics endpoint")
    parser.add_argument("--metrics-port", type=int, default=9090, help="port of /metrics; 0 disables it")
    parser.add_argument("--leader-election", action=argparse.BooleanOptionalAction, default=True,
                        help="act only while holding the Lease (on by default; replicas never both act)")
    parser.add_argument("--leader-election-namespace", default=os.environ.get("POD_NAMESPACE", "default"))
    parser.add_argument("--lease-duration", type=float, default=15.0, help="seconds a silent leader keeps the Lease")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    load_config()
    if args.metrics_port:
        metrics.serve(args.metrics_address, args.metrics_port)
    write_fence: WriteFence | None = None
    if args.leader_election:
        elector = LeaderElector(args.leader_election_namespace, lease_duration_s=args.lease_duration)
        elector.acquire()
        # Losing the lease ends the process at once: acting on after another replica took over is
        # the one thing leader election exists to prevent. The Deployment restarts it as a follower.
        elector.keep(on_lost=lambda: os._exit(1))
        # The renewal thread may be the last to notice a lost lease (a process frozen past it wakes
        # all threads at once): every write checks the lease's age itself.
        write_fence = elector.ensure_leading
    # The process's one Operator (kvfleet.operator.runtime): kopf hands it to every handler in its memo.
    operator = Operator(Kube(write_fence))
    kopf.run(standalone=True, clusterwide=not args.namespace, namespaces=args.namespace, liveness_endpoint=args.liveness,
             memo=kopf.Memo({MEMO_KEY: operator}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
