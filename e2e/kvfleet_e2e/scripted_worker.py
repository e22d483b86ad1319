"""A stand-in worker for operator e2e tests: the worker pod's contract without an engine.

The operator is tested before (and independently of) the real worker runtime: this process serves
the same health endpoints on the pod's IP and port from the environment the operator gives every
worker pod, and exits cleanly on SIGTERM, so pods become Ready and drain like real workers.
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import sys
import threading


def main() -> int:
    address = (os.environ["POD_IP"], int(os.environ.get("KVFLEET_PORT", "8000")))
    identity = {k: os.environ.get(k, "") for k in ("POD_NAME", "KVFLEET_POOL", "KVFLEET_MODEL_NAME", "KVFLEET_KV_CAPACITY_BYTES")}
    identity["token_present"] = str(bool(os.environ.get("KVFLEET_POOL_TOKEN")))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            if self.path in ("/healthz", "/readyz", "/identity"):
                body = json.dumps(identity).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body)
            else:
                self.send_error(404)

        def log_message(self, *_: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(address, Handler)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    print(f"scripted worker {identity['POD_NAME']} serving on {address[0]}:{address[1]}", flush=True)
    server.serve_forever()
    print("scripted worker stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
