"""`python -m kvfleet.router`: the pool's router (the `kvfleet/router` image; docs/router.md).

Configured by the environment the operator puts in the router's Deployment
(operator/kvfleet/operator/resources.py); every variable has a flag of the same meaning:

    python -m kvfleet.router --pool tiny --namespace default --port 8000

Without a pool (`--worker ADDRESS` instead) it routes to fixed workers and needs no API server: a
router by hand in front of workers started by hand.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from kvfleet.router.locality import LOCALITIES

# Pending connections the listening socket queues (the kernel caps it at net.core.somaxconn).
LISTEN_BACKLOG = 4096


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    parser = argparse.ArgumentParser(prog="python -m kvfleet.router", description=__doc__.splitlines()[0])
    parser.add_argument("--pool", default=env("KVFLEET_POOL"), help="the LLMPool this router serves")
    parser.add_argument("--namespace", default=env("POD_NAMESPACE"), help="the pool's namespace")
    parser.add_argument("--worker", action="append", default=[], metavar="ADDRESS",
                        help="ip:port of a worker, instead of a pool (repeatable)")
    parser.add_argument("--host", default=env("POD_IP", "0.0.0.0"))
    parser.add_argument("--port", type=int, default=int(env("KVFLEET_PORT", "8000")))
    parser.add_argument("--max-in-flight", type=int, default=int(env("KVFLEET_ROUTER_MAX_IN_FLIGHT", "1024")),
                        help="requests relayed at once; more get 429")
    parser.add_argument("--connect-timeout-s", type=float, default=float(env("KVFLEET_ROUTER_CONNECT_TIMEOUT_S", "5")))
    parser.add_argument("--first-token-timeout-s", type=float,
                        default=float(env("KVFLEET_ROUTER_FIRST_TOKEN_TIMEOUT_S", "120")))
    parser.add_argument("--idle-timeout-s", type=float, default=float(env("KVFLEET_ROUTER_IDLE_TIMEOUT_S", "30")))
    parser.add_argument("--locality", choices=LOCALITIES, default=env("KVFLEET_ROUTER_LOCALITY", "none"),
                        help="with --worker: how to weigh the workers' cached prefixes (a pool's router reads "
                             "its LLMPool's prefixCaching instead)")
    parser.add_argument("--max-held", type=int, default=int(env("KVFLEET_ROUTER_MAX_HELD", "256")),
                        help="requests held while the pool has no Ready worker (scale from zero); more get 429")
    parser.add_argument("--hold-timeout-s", type=float, default=float(env("KVFLEET_ROUTER_HOLD_TIMEOUT_S", "300")),
                        help="how long a held request waits for a Ready worker before its 503")
    parser.add_argument("--log-level", default=env("KVFLEET_LOG_LEVEL", "INFO"))
    args = parser.parse_args(argv)
    if not args.worker and not (args.pool and args.namespace):
        parser.error("name the pool (KVFLEET_POOL and POD_NAMESPACE, or --pool and --namespace) or give --worker")
    if args.max_in_flight < 1:
        parser.error("--max-in-flight must be at least 1")
    if args.max_held < 0 or args.hold_timeout_s <= 0:
        parser.error("--max-held must be at least 0 and --hold-timeout-s above 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvloop
    from aiohttp import web

    from kvfleet.api.incluster import SecretReader
    from kvfleet.router.app import Router, RouterConfig
    from kvfleet.router.placement import PoolSnapshot, WorkerState
    from kvfleet.router.pool import KubePoolApi, KubePoolView, PoolView, StaticPoolView
    from kvfleet.router.relay import Timeouts
    from kvfleet.serving.credentials import PoolCredentials

    view: PoolView
    if args.worker:
        workers = tuple(WorkerState(f"worker-{i}", address, True, i, None) for i, address in enumerate(args.worker))
        view = StaticPoolView(PoolSnapshot(workers, {}, locality=args.locality))
    else:
        view = KubePoolView(args.namespace, args.pool, KubePoolApi.connect(args.namespace, args.pool))
    config = RouterConfig(pool_name=args.pool or "", namespace=args.namespace or "",
                          credentials=PoolCredentials.from_env(os.environ, SecretReader), max_in_flight=args.max_in_flight,
                          max_held=args.max_held, hold_timeout_s=args.hold_timeout_s,
                          timeouts=Timeouts(args.connect_timeout_s, args.first_token_timeout_s, args.idle_timeout_s))
    web.run_app(Router(config, view).app(), host=args.host, port=args.port, print=None, access_log=None, shutdown_timeout=30,
                # A burst of clients (bench/load.py: 1,000 at once) overflows aiohttp's default backlog of 128:
                # each dropped SYN costs its client a second or more.
                backlog=LISTEN_BACKLOG,
                # uvloop's event loop and transports: the relay is a socket read and a write per token.
                loop=uvloop.new_event_loop())
    return 0


if __name__ == "__main__":
    sys.exit(main())
