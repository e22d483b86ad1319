"""A real Kubernetes control plane on loopback: etcd, kube-apiserver, kube-scheduler, kube-controller-manager.

Tests and `make demo` need the real API server (CRD schemas, CEL, subresources), the real scheduler
(extended resources, Pending reasons) and the real garbage collector, not a mock. The binaries come
from build-controlplane.sh (beside this module); this module makes the PKI, picks free ports, starts the processes,
waits for `/readyz`, writes a kubeconfig, and tears everything down. Every child runs in its own
process group with PR_SET_PDEATHSIG, so even a killed test run leaves no orphan behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime as dt
import ipaddress
import logging
import os
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

log = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
# The checkout this runs from (operator/kvfleet/localcluster/../../..): the cache and the CRDs live there.
REPO_ROOT = HERE.parents[2]
BUILD_SCRIPT = HERE / "build-controlplane.sh"
VERSIONS_FILE = HERE / "versions.env"
SERVICE_CLUSTER_IP_RANGE = "10.96.0.0/24"
_PR_SET_PDEATHSIG = 1


def cache_dir() -> Path:
    return Path(os.environ.get("KVFLEET_CACHE", REPO_ROOT / ".cache"))


def binaries_dir() -> Path:
    """The folder of cached control-plane binaries, building them first if the cache is cold."""
    current = cache_dir() / "bin" / "current"
    needed = ("etcd", "kube-apiserver", "kube-scheduler", "kube-controller-manager", "kubectl")
    if not all((current / b).exists() for b in needed):
        subprocess.run(["bash", str(BUILD_SCRIPT)], check=True)
    return current.resolve()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGKILL when the process that started it dies (no orphans)."""
    os.setsid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


# --------------------------------------------------------------------------------------------- PKI


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def _pem_cert(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _issue(
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate | None,
    subject: x509.Name,
    key: ec.EllipticCurvePrivateKey,
    *,
    is_ca: bool = False,
    server_names: Sequence[str] = (),
    client: bool = False,
) -> x509.Certificate:
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_cert.subject if ca_cert else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True)
    )
    if is_ca:
        builder = builder.add_extension(
            x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
        )
    else:
        usages = [ExtendedKeyUsageOID.CLIENT_AUTH] if client else [ExtendedKeyUsageOID.SERVER_AUTH]
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    if server_names:
        alt: list[x509.GeneralName] = []
        for name in server_names:
            try:
                alt.append(x509.IPAddress(ipaddress.ip_address(name)))
            except ValueError:
                alt.append(x509.DNSName(name))
        builder = builder.add_extension(x509.SubjectAlternativeName(alt), critical=False)
    return builder.sign(ca_key, hashes.SHA256())


@dataclass(frozen=True)
class Pki:
    """Files of the cluster CA, the API server's serving cert, an admin client cert and the SA key."""

    ca_cert: Path
    ca_key: Path
    serving_cert: Path
    serving_key: Path
    admin_cert: Path
    admin_key: Path
    sa_key: Path
    sa_pub: Path


def make_pki(directory: Path) -> Pki:
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = _key()
    ca_cert = _issue(ca_key, None, x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvfleet-e2e-ca")]), ca_key, is_ca=True)
    srv_key = _key()
    srv_cert = _issue(
        ca_key,
        ca_cert,
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]),
        srv_key,
        server_names=("127.0.0.1", "localhost", "10.96.0.1", "kubernetes", "kubernetes.default.svc"),
    )
    admin_key = _key()
    admin_cert = _issue(
        ca_key,
        ca_cert,
        x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, "system:masters"),
                x509.NameAttribute(NameOID.COMMON_NAME, "kvfleet-e2e-admin"),
            ]
        ),
        admin_key,
        client=True,
    )
    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    files = {
        "ca.crt": _pem_cert(ca_cert),
        "ca.key": _pem_key(ca_key),
        "apiserver.crt": _pem_cert(srv_cert),
        "apiserver.key": _pem_key(srv_key),
        "admin.crt": _pem_cert(admin_cert),
        "admin.key": _pem_key(admin_key),
        "sa.key": sa_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
        ),
        "sa.pub": sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        ),
    }
    for name, data in files.items():
        path = directory / name
        path.write_bytes(data)
        path.chmod(0o600)
    return Pki(*(directory / n for n in files))


def kubeconfig_text(server: str, ca_file: Path, *, cert: Path | None = None, key: Path | None = None,
                    token: str | None = None, user: str = "admin", namespace: str = "default") -> str:
    """A kubeconfig with one cluster, one user (client cert or bearer token) and one context."""
    lines = [
        "apiVersion: v1",
        "kind: Config",
        "clusters:",
        "- name: kvfleet-e2e",
        "  cluster:",
        f"    server: {server}",
        f"    certificate-authority: {ca_file}",
        "users:",
        f"- name: {user}",
        "  user:",
    ]
    if token is not None:
        lines.append(f"    token: {token}")
    else:
        lines += [f"    client-certificate: {cert}", f"    client-key: {key}"]
    lines += [
        "contexts:",
        "- name: kvfleet-e2e",
        "  context:",
        "    cluster: kvfleet-e2e",
        f"    user: {user}",
        f"    namespace: {namespace}",
        "current-context: kvfleet-e2e",
        "",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- processes


@dataclass
class Process:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    def tail(self, num_lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])
        except OSError:
            return ""


def start_process(name: str, argv: Sequence[str], log_dir: Path, env: dict[str, str] | None = None) -> Process:
    log_path = log_dir / f"{name}.log"
    log_file = open(log_path, "ab")  # noqa: SIM115 - the child owns it for its lifetime
    popen = subprocess.Popen(
        list(argv),
        stdout=log_file,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
        preexec_fn=die_with_parent,
    )
    log_file.close()
    return Process(name, popen, log_path)


def stop_process(proc: Process, grace_s: float = 10.0) -> None:
    """SIGTERM the process group, SIGKILL after the grace period; always reaps."""
    if proc.popen.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.popen.pid, signal.SIGTERM)
        try:
            proc.popen.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.popen.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.popen.wait(5)


# ------------------------------------------------------------------------------------ control plane


@dataclass
class ControlPlane:
    """A running control plane; use `ControlPlane.start()` as a context manager or call `stop()`."""

    work_dir: Path
    api_port: int
    pki: Pki
    kubeconfig: Path
    bin_dir: Path
    processes: list[Process] = field(default_factory=list)
    _owns_work_dir: bool = False
    # etcd's client and peer ports, kept so that a restarted etcd serves the same data at the same place.
    etcd_ports: tuple[int, int] | None = None

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.api_port}"

    @property
    def kubectl(self) -> Path:
        return self.bin_dir / "kubectl"

    @classmethod
    @contextlib.contextmanager
    def running(cls, work_dir: Path | None = None) -> Iterator[ControlPlane]:
        plane = cls.start(work_dir)
        try:
            yield plane
        finally:
            plane.stop()

    @classmethod
    def start(cls, work_dir: Path | None = None) -> ControlPlane:
        bin_dir = binaries_dir()
        owns = work_dir is None
        work = Path(tempfile.mkdtemp(prefix="kvfleet-cp-")) if work_dir is None else work_dir
        work.mkdir(parents=True, exist_ok=True)
        pki = make_pki(work / "pki")
        api_port = free_port()
        kubeconfig = work / "admin.kubeconfig"
        kubeconfig.write_text(kubeconfig_text(f"https://127.0.0.1:{api_port}", pki.ca_cert, cert=pki.admin_cert, key=pki.admin_key))
        plane = cls(work, api_port, pki, kubeconfig, bin_dir, _owns_work_dir=owns)
        try:
            plane._start_all()
        except BaseException:
            plane.stop()
            raise
        return plane

    def _start_all(self) -> None:
        """etcd, then the API server on it; the scheduler and the controller manager once it is ready."""
        logs = self.work_dir / "logs"
        logs.mkdir(exist_ok=True)
        etcd_port = self._start_etcd(logs)
        self._start_apiserver(logs, etcd_port)
        self._wait_ready()
        self._start_scheduler(logs)
        self._start_controller_manager(logs)

    def _start_etcd(self, logs: Path) -> int:
        if self.etcd_ports is None:
            self.etcd_ports = (free_port(), free_port())
        etcd_port, etcd_peer_port = self.etcd_ports
        self.processes.append(
            start_process(
                "etcd",
                [
                    str(self.bin_dir / "etcd"),
                    "--data-dir", str(self.work_dir / "etcd"),
                    "--listen-client-urls", f"http://127.0.0.1:{etcd_port}",
                    "--advertise-client-urls", f"http://127.0.0.1:{etcd_port}",
                    "--listen-peer-urls", f"http://127.0.0.1:{etcd_peer_port}",
                    "--initial-advertise-peer-urls", f"http://127.0.0.1:{etcd_peer_port}",
                    "--initial-cluster", f"default=http://127.0.0.1:{etcd_peer_port}",
                    "--unsafe-no-fsync",  # throwaway data: fsync only slows tests down
                    "--log-level", "warn",
                ],
                logs,
            )
        )
        self._wait_http(f"http://127.0.0.1:{etcd_port}/health", "etcd", timeout_s=60)
        return etcd_port

    def _start_apiserver(self, logs: Path, etcd_port: int) -> None:
        pki = self.pki
        self.processes.append(
            start_process(
                "kube-apiserver",
                [
                    str(self.bin_dir / "kube-apiserver"),
                    f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                    f"--cert-dir={self.work_dir / 'apiserver-certs'}",
                    f"--secure-port={self.api_port}",
                    "--bind-address=127.0.0.1",
                    "--advertise-address=127.0.0.1",
                    f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
                    "--allow-privileged=true",
                    "--authorization-mode=Node,RBAC",
                    f"--client-ca-file={pki.ca_cert}",
                    f"--tls-cert-file={pki.serving_cert}",
                    f"--tls-private-key-file={pki.serving_key}",
                    f"--service-account-issuer=https://127.0.0.1:{self.api_port}",
                    f"--service-account-key-file={pki.sa_pub}",
                    f"--service-account-signing-key-file={pki.sa_key}",
                    "--enable-priority-and-fairness=false",
                    "--profiling=false",
                    "-v=1",
                ],
                logs,
            )
        )

    def _start_scheduler(self, logs: Path) -> None:
        scheduler_cfg = self.work_dir / "scheduler.yaml"
        scheduler_cfg.write_text(
            "apiVersion: kubescheduler.config.k8s.io/v1\n"
            "kind: KubeSchedulerConfiguration\n"
            f"clientConnection:\n  kubeconfig: {self.kubeconfig}\n"
            "leaderElection:\n  leaderElect: false\n"
        )
        self.processes.append(
            start_process(
                "kube-scheduler",
                [
                    str(self.bin_dir / "kube-scheduler"),
                    f"--config={scheduler_cfg}",
                    f"--secure-port={free_port()}",
                    "--bind-address=127.0.0.1",
                    f"--authentication-kubeconfig={self.kubeconfig}",
                    f"--authorization-kubeconfig={self.kubeconfig}",
                    "-v=1",
                ],
                logs,
            )
        )

    def _start_controller_manager(self, logs: Path) -> None:
        pki = self.pki
        self.processes.append(
            start_process(
                "kube-controller-manager",
                [
                    str(self.bin_dir / "kube-controller-manager"),
                    f"--kubeconfig={self.kubeconfig}",
                    f"--authentication-kubeconfig={self.kubeconfig}",
                    f"--authorization-kubeconfig={self.kubeconfig}",
                    "--leader-elect=false",
                    f"--secure-port={free_port()}",
                    "--bind-address=127.0.0.1",
                    f"--service-account-private-key-file={pki.sa_key}",
                    f"--root-ca-file={pki.ca_cert}",
                    f"--cluster-signing-cert-file={pki.ca_cert}",
                    f"--cluster-signing-key-file={pki.ca_key}",
                    "--use-service-account-credentials=true",
                    # The node agent keeps its nodes' leases fresh, but a test machine may stall for
                    # longer than the grace period; evicting every pod then helps no test.
                    "--controllers=*,-node-lifecycle-controller",
                    "-v=1",
                ],
                logs,
            )
        )

    def restart_apiserver_and_etcd(self, timeout_s: float = 120) -> float:
        """SIGKILL kube-apiserver and etcd, start them again on the same data dir and ports, wait for
        `/readyz`; returns the seconds the API server was away.

        This is the chaos test's "the control plane lost its API": everything that talks to the API
        server (the scheduler, the controller manager, the node agent, the operator, routers,
        workers) sees its connections drop and must reconnect by itself. The scheduler and the
        controller manager are not restarted: they are clients like the others (client-go retries
        their watches), so check_alive() still says whether they survived. Call it from the thread
        that started the plane: the new children die with the thread that starts them (PR_SET_PDEATHSIG).
        """
        started_s = time.monotonic()
        start_order = [p.name for p in self.processes]
        for proc in [p for p in self.processes if p.name in ("kube-apiserver", "etcd")]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.popen.pid, signal.SIGKILL)
            proc.popen.wait(30)
            # Out of the list while they are down, so that check_alive() (called while waiting) judges the others.
            self.processes.remove(proc)
        logs = self.work_dir / "logs"
        etcd_port = self._start_etcd(logs)
        self._start_apiserver(logs, etcd_port)
        # stop() stops them in reverse start order: the API server's clients first, etcd last.
        self.processes.sort(key=lambda p: start_order.index(p.name))
        self._wait_ready(timeout_s)
        return time.monotonic() - started_s

    def _ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.pki.ca_cert))
        ctx.load_cert_chain(str(self.pki.admin_cert), str(self.pki.admin_key))
        return ctx

    def _wait_http(self, url: str, what: str, timeout_s: float, ctx: ssl.SSLContext | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                with urllib.request.urlopen(url, timeout=5, context=ctx) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError) as err:
                last = str(err)
            time.sleep(0.2)
        raise TimeoutError(f"{what} not ready after {timeout_s}s at {url}: {last}\n{self.logs_tail()}")

    def _wait_ready(self, timeout_s: float = 120) -> None:
        self._wait_http(f"{self.server}/readyz", "kube-apiserver", timeout_s, self._ssl_context())

    def get(self, path: str) -> bytes:
        """GET a path of the API server as the admin (used for /version and health checks)."""
        with urllib.request.urlopen(f"{self.server}{path}", timeout=10, context=self._ssl_context()) as resp:
            data: bytes = resp.read()
            return data

    def check_alive(self) -> None:
        for proc in self.processes:
            code = proc.popen.poll()
            if code is not None:
                raise RuntimeError(f"{proc.name} exited with {code}:\n{proc.tail()}")

    def logs_tail(self) -> str:
        return "\n".join(f"--- {p.name} ---\n{p.tail(15)}" for p in self.processes)

    def kubectl_run(self, *args: str, check: bool = True, input_text: str | None = None,
                    timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.kubectl), f"--kubeconfig={self.kubeconfig}", *args],
            capture_output=True,
            text=True,
            input=input_text,
            check=check,
            timeout=timeout_s,
        )

    def wait_established(self, crd_names: Sequence[str], timeout_s: float = 60) -> None:
        """Wait until each CustomResourceDefinition is Established (its API is served).

        Polled here rather than with `kubectl wait --for=condition=Established`: on a CRD the API
        server has not given conditions yet, that fails at once (".status.conditions accessor error:
        <nil>"), which is what a CRD just applied often is."""
        deadline = time.monotonic() + timeout_s
        for name in crd_names:
            while True:
                result = self.kubectl_run("get", "crd", name, "-o",
                                          'jsonpath={.status.conditions[?(@.type=="Established")].status}', check=False)
                if result.returncode == 0 and result.stdout.strip() == "True":
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"CRD {name} not Established within {timeout_s:.0f} s: "
                                       f"{(result.stderr or result.stdout).strip()}")
                time.sleep(0.2)

    def stop(self) -> None:
        # Reverse order: the API server's clients first, etcd last.
        for proc in reversed(self.processes):
            stop_process(proc)
        self.processes.clear()
        if self._owns_work_dir and os.environ.get("KVFLEET_KEEP_CLUSTER_DIR") != "1":
            subprocess.run(["rm", "-rf", str(self.work_dir)], check=False)


def main() -> int:
    """`python -m kvfleet.localcluster.controlplane`: run a control plane until interrupted (for poking at it)."""
    logging.basicConfig(level=logging.INFO)
    with ControlPlane.running() as plane:
        print(f"export KUBECONFIG={plane.kubeconfig}", flush=True)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    return 0


if __name__ == "__main__":
    sys.exit(main())
