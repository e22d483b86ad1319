"""A stand-in worker for operator e2e tests: the worker pod's contract without an engine.

The operator is tested before (and independently of) the real worker runtime. This process does
what a worker does towards the control plane, with scripted requests instead of a model:
- serves /healthz and /readyz on the pod's IP and port from the environment the operator sets;
- takes requests (POST /script/requests: id, KV bytes, growth per second, duration), grows their KV
  over time and finishes them, like decoding would (POST /script/finish: id ends one now);
- writes its KV-load report in its own KVLoad (the worker's own writer, kvfleet.worker.reporter.kvload_writer)
  when a request arrives, finishes or changes size class, at most once per report interval;
- executes the KVMigrations naming it as source: hands the request to the target's
  POST /internal/adopt (authenticated with the pool token) and writes the migration's status; a
  transfer takes $KVFLEET_SCRIPTED_MOVE_S seconds (default 0), with the request on neither worker's
  report meanwhile, as a long live KV copy would look from outside;
- on SIGTERM, prints how many requests it still held, so a test can prove none was dropped.
It talks to the API server with its pod's ServiceAccount, so the operator's worker RBAC is exercised.
"""

from __future__ import annotations

import asyncio
import http.client
import http.server
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from kubernetes import client, config
from kubernetes.client.rest import ApiException

from kvfleet.api.models import GROUP, VERSION
from kvfleet.api.reports import KVLoadReport, RequestLoad, size_class_name
from kvfleet.worker.reporter import kvload_writer

log = logging.getLogger("scripted-worker")
BYTES_PER_TOKEN = 1024


@dataclass
class Request:
    request_id: str
    kv_bytes: float
    grow_bytes_per_s: float
    ends_at_s: float

    def as_dict(self, now_s: float) -> dict[str, Any]:
        return {"id": self.request_id, "kvBytes": int(self.kv_bytes), "growBytesPerS": self.grow_bytes_per_s,
                "durationS": max(0.0, self.ends_at_s - now_s)}


class Worker:
    def __init__(self) -> None:
        self.pod_name = os.environ["POD_NAME"]
        self.namespace = os.environ["POD_NAMESPACE"]
        self.pool = os.environ["KVFLEET_POOL"]
        self.pod_uid = os.environ["POD_UID"]
        self.token = os.environ["KVFLEET_POOL_TOKEN"]
        self.capacity_bytes = int(os.environ["KVFLEET_KV_CAPACITY_BYTES"])
        self.report_interval_s = float(os.environ.get("KVFLEET_REPORT_INTERVAL_S", "0.5"))
        self.requests: dict[str, Request] = {}
        self.lock = threading.Lock()
        self.sequence = 0
        self.last_written: tuple[Any, ...] | None = None
        self.last_write_s = 0.0
        self.num_finished = 0
        config.load_kube_config()
        self.core = client.CoreV1Api()
        self.custom = client.CustomObjectsApi()
        self.write_report = kvload_writer(self.pod_name, self.namespace, self.pod_uid, self.pool, api_client=self.core.api_client)
        self.stopping = threading.Event()

    # ---------------------------------------------------------------------------------- requests

    def add(self, body: dict[str, Any]) -> None:
        now_s = time.monotonic()
        with self.lock:
            self.requests[body["id"]] = Request(body["id"], float(body["kvBytes"]), float(body.get("growBytesPerS", 0)),
                                                now_s + float(body.get("durationS", 60)))
        log.info("request %s arrived (%s bytes)", body["id"], body["kvBytes"])

    def finish_now(self, request_id: str) -> bool:
        """End a request at the next step, as if its last token were generated now."""
        with self.lock:
            req = self.requests.get(request_id)
            if req is not None:
                req.ends_at_s = time.monotonic()
        return req is not None

    def step(self) -> None:
        now_s = time.monotonic()
        with self.lock:
            for rid, req in list(self.requests.items()):
                if now_s >= req.ends_at_s:
                    del self.requests[rid]
                    self.num_finished += 1
                    log.info("request %s finished", rid)
                else:
                    req.kv_bytes += req.grow_bytes_per_s * 0.1
        self.maybe_report()

    def report(self) -> KVLoadReport:
        with self.lock:
            loads = [
                RequestLoad(id=r.request_id, kv_bytes=int(r.kv_bytes), tokens=int(r.kv_bytes) // BYTES_PER_TOKEN,
                            size_class=size_class_name(int(r.kv_bytes), self.capacity_bytes))
                for r in sorted(self.requests.values(), key=lambda r: r.request_id)
            ]
        return KVLoadReport(capacity_bytes=self.capacity_bytes, used_bytes=sum(r.kv_bytes for r in loads), requests=loads,
                            sequence=self.sequence)

    def maybe_report(self) -> None:
        """Write when the set of requests or a size class changed, never more than once an interval."""
        report = self.report()
        key = tuple((r.id, r.size_class) for r in report.requests)
        if key == self.last_written or time.monotonic() - self.last_write_s < self.report_interval_s:
            return
        self.sequence += 1
        report = report.model_copy(update={"sequence": self.sequence})
        try:
            asyncio.run(self.write_report(report))
            self.last_written = key
            self.last_write_s = time.monotonic()
        except ApiException as err:
            log.warning("report not written: %s", err.reason)

    # -------------------------------------------------------------------------------- migrations

    def migrate_loop(self) -> None:
        while not self.stopping.wait(0.3):
            try:
                listing = self.custom.list_namespaced_custom_object(GROUP, VERSION, self.namespace, "kvmigrations",
                                                                    label_selector=f"kvfleet.dev/pool={self.pool}")
                for obj in listing.get("items", []):
                    if obj["spec"]["sourcePod"] == self.pod_name and (obj.get("status") or {}).get("phase", "Pending") == "Pending":
                        self.migrate(obj)
            except Exception:
                log.exception("migration loop failed")

    def set_status(self, name: str, status: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object_status(GROUP, VERSION, self.namespace, "kvmigrations", name, {"status": status})

    def migrate(self, obj: dict[str, Any]) -> None:
        name, spec = obj["metadata"]["name"], obj["spec"]
        started = time.monotonic()
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        with self.lock:
            req = self.requests.pop(spec["requestId"], None)
        if req is None:
            self.set_status(name, {"phase": "Failed", "startTime": stamp, "completionTime": stamp,
                                   "message": "the request is no longer on the source (finished)"})
            return
        self.set_status(name, {"phase": "Transferring", "startTime": stamp})
        self.last_written = None  # the ticker reports the departure at once
        time.sleep(float(os.environ.get("KVFLEET_SCRIPTED_MOVE_S", "0")))
        body = json.dumps(req.as_dict(time.monotonic())).encode()
        try:
            target = self.core.read_namespaced_pod(spec["targetPod"], self.namespace)
            conn = http.client.HTTPConnection(target.status.pod_ip, int(os.environ.get("KVFLEET_PORT", "8000")), timeout=5)
            conn.request("POST", "/internal/adopt", body, {"Authorization": f"Bearer {self.token}",
                                                            "Content-Type": "application/json"})
            status = conn.getresponse().status
            if status != 200:
                raise RuntimeError(f"target answered {status}")
        except Exception as err:
            with self.lock:
                self.requests[req.request_id] = req  # the source keeps the request: nothing is lost
            self.set_status(name, {"phase": "Failed", "completionTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                   "message": f"target unreachable: {err}"})
            return
        downtime_s = time.monotonic() - started
        self.last_written = None  # report the departure at once
        self.set_status(name, {"phase": "Succeeded", "completionTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                               "bytesMoved": int(req.kv_bytes), "tokensMoved": int(req.kv_bytes) // BYTES_PER_TOKEN,
                               "downtimeSeconds": round(downtime_s, 4), "downtime": f"{downtime_s * 1000:.0f}ms",
                               "message": "handed over"})
        log.info("migrated %s to %s", req.request_id, spec["targetPod"])

    # ------------------------------------------------------------------------------------ serving

    def serve(self) -> None:
        worker = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def reply(self, code: int, payload: Any) -> None:
                body = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                if self.path in ("/healthz", "/readyz"):
                    self.reply(200, {"ok": True})
                elif self.path == "/identity":
                    self.reply(200, {"POD_NAME": worker.pod_name, "KVFLEET_POOL": worker.pool,
                                     "KVFLEET_MODEL_NAME": os.environ.get("KVFLEET_MODEL_NAME", ""),
                                     "KVFLEET_KV_CAPACITY_BYTES": str(worker.capacity_bytes), "token_present": str(bool(worker.token))})
                elif self.path == "/script/state":
                    self.reply(200, {"requests": sorted(worker.requests), "finished": worker.num_finished})
                else:
                    self.reply(404, {"error": "not found"})

            def do_POST(self) -> None:  # noqa: N802
                length = int(self.headers.get("Content-Length", "0"))
                try:
                    body = json.loads(self.rfile.read(length) or b"{}")
                except ValueError:
                    self.reply(400, {"error": "malformed JSON"})
                    return
                if self.path == "/script/requests":
                    worker.add(body)
                    self.reply(200, {"accepted": body.get("id")})
                elif self.path == "/script/finish":
                    self.reply(200 if worker.finish_now(str(body.get("id"))) else 404, {"id": body.get("id")})
                elif self.path == "/internal/adopt":
                    if self.headers.get("Authorization") != f"Bearer {worker.token}":
                        self.reply(401, {"error": "the pool token is required"})
                        return
                    worker.add(body)
                    worker.last_written = None
                    self.reply(200, {"adopted": body.get("id")})
                else:
                    self.reply(404, {"error": "not found"})

            def log_message(self, *_: object) -> None:
                pass

        server = http.server.ThreadingHTTPServer((os.environ["POD_IP"], int(os.environ.get("KVFLEET_PORT", "8000"))), Handler)

        def stop(*_: object) -> None:
            log.info("SIGTERM with %d requests held: %s", len(self.requests), "LOST " + ",".join(sorted(self.requests))
                     if self.requests else "none lost")
            self.stopping.set()
            threading.Thread(target=server.shutdown).start()

        signal.signal(signal.SIGTERM, stop)
        threading.Thread(target=self.migrate_loop, daemon=True).start()

        def ticker() -> None:
            while not self.stopping.wait(0.1):
                self.step()

        threading.Thread(target=ticker, daemon=True).start()
        log.info("scripted worker %s serving on %s:%s", self.pod_name, *server.server_address[:2])
        server.serve_forever()


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    Worker().serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
