"""Worker-to-worker byte transport for migrations: framed messages over authenticated TCP.

A KV migration moves megabytes to gigabytes between two worker pods while both keep serving, so the
bytes go on a connection of their own rather than through the HTTP API: no HTTP framing or parsing
on the path, a payload lands straight in the tensor that receives it, and a long copy competes with
no client request for aiohttp's connection handling. It listens on a second port on the pod IP
(`MIGRATION_PORT`, 8001; docs/migration.md says why not an HTTP upgrade).

Everything the copy could carry is private (a request's prompt and its KV), and whoever can talk to
the port can make a worker allocate KV, so both ends prove they hold the pool's migration key before
any frame is read: a mutual HMAC-SHA256 challenge-response over fresh nonces (the key never crosses
the wire; digests are compared in constant time). A peer that fails it is disconnected. While the
pool's Secret rotates, the previous key is accepted for a grace period (kvfleet.serving.credentials).

On the CPU the transport is asyncio's own socket calls on non-blocking TCP sockets
(`loop.sock_recv_into` into the destination buffer, `loop.sock_sendall` from the source tensor's
memory): bench/migration.py measures it against a raw blocking socket copy of the same bytes.
`Transport` is the seam for others (NCCL or NIXL between GPUs): the executor only needs
`connect`/`listen` and a `Channel` that sends and receives frames.

Frame: 12 bytes `!IQ` (header length, payload length), a JSON header, then the payload.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
import socket
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from kvfleet.serving.credentials import PoolCredentials

log = logging.getLogger(__name__)

MIGRATION_PORT = 8001
_MAGIC = b"KVFLEET1"
_NONCE_BYTES = 32
_PREFIX = struct.Struct("!IQ")
# Larger headers are a broken or hostile peer: headers carry ids and token lists, never KV.
MAX_HEADER_BYTES = 64 * 1024 * 1024
HANDSHAKE_TIMEOUT_S = 5.0
# Kernel socket buffers: large enough that a multi-MiB stage does not stall on every 200 KiB.
_SOCKET_BUFFER_BYTES = 4 * 1024 * 1024


class TransportError(Exception):
    """The peer is unreachable, refused us, closed the connection, or spoke nonsense."""


class AuthenticationError(TransportError):
    """The peer did not prove it holds the pool's migration key."""


@dataclass(frozen=True)
class Frame:
    header: dict[str, Any]
    payload_nbytes: int


class Channel(Protocol):
    """One authenticated, ordered, reliable connection between two workers."""

    @property
    def peer(self) -> str: ...

    async def send(self, header: dict[str, Any], payload: memoryview | bytes | None = None) -> None:
        """One frame; returns once the payload is handed to the kernel (the caller may reuse it)."""
        ...

    async def recv(self, timeout_s: float | None = None) -> Frame:
        """The next frame's header; its payload must then be read with `read_payload`."""
        ...

    async def read_payload(self, nbytes: int, into: memoryview | None = None) -> memoryview:
        """The payload of the frame just received, into `into` (exactly nbytes long) or a new buffer."""
        ...

    def close(self) -> None: ...


Handler = Callable[[Channel], Awaitable[None]]


class Listener(Protocol):
    @property
    def port(self) -> int: ...

    async def close(self) -> None: ...


class Transport(Protocol):
    async def connect(self, address: str, timeout_s: float) -> Channel: ...

    async def listen(self, host: str, port: int, handler: Handler) -> Listener: ...


def _digest(key: bytes, role: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(key, role + server_nonce + client_nonce, hashlib.sha256).digest()


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected host:port, got {address!r}")
    return host.strip("[]"), int(port)


class TCPChannel:
    """A Channel over a non-blocking TCP socket, driven by the event loop's socket calls."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self._sock = sock
        self._peer = peer
        self._loop = asyncio.get_running_loop()
        self._prefix = bytearray(_PREFIX.size)

    @property
    def peer(self) -> str:
        return self._peer

    async def _recv_exactly(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            n = await self._loop.sock_recv_into(self._sock, view[got:])
            if n == 0:
                raise TransportError(f"{self._peer} closed the connection")
            got += n

    async def _recv_bytes(self, nbytes: int) -> bytes:
        buf = bytearray(nbytes)
        await self._recv_exactly(memoryview(buf))
        return bytes(buf)

    async def _send_raw(self, data: bytes | memoryview) -> None:
        try:
            await self._loop.sock_sendall(self._sock, data)
        except OSError as err:
            raise TransportError(f"sending to {self._peer}: {err}") from err

    async def send(self, header: dict[str, Any], payload: memoryview | bytes | None = None) -> None:
        body = json.dumps(header, separators=(",", ":")).encode()
        nbytes = 0 if payload is None else memoryview(payload).nbytes
        await self._send_raw(_PREFIX.pack(len(body), nbytes) + body)
        if payload is not None and nbytes:
            await self._send_raw(memoryview(payload).cast("B"))

    async def recv(self, timeout_s: float | None = None) -> Frame:
        try:
            async with asyncio.timeout(timeout_s):
                await self._recv_exactly(memoryview(self._prefix))
                header_nbytes, payload_nbytes = _PREFIX.unpack(self._prefix)
                if header_nbytes > MAX_HEADER_BYTES:
                    raise TransportError(f"{self._peer} sent a {header_nbytes}-byte header")
                raw = await self._recv_bytes(header_nbytes)
        except TimeoutError:
            raise TransportError(f"nothing from {self._peer} in {timeout_s} s") from None
        except OSError as err:
            raise TransportError(f"receiving from {self._peer}: {err}") from err
        try:
            header = json.loads(raw)
        except ValueError:
            raise TransportError(f"{self._peer} sent a header that is not JSON") from None
        if not isinstance(header, dict):
            raise TransportError(f"{self._peer} sent a header that is not an object")
        return Frame(header, payload_nbytes)

    async def read_payload(self, nbytes: int, into: memoryview | None = None) -> memoryview:
        view = memoryview(bytearray(nbytes)) if into is None else into.cast("B")
        if view.nbytes != nbytes:
            raise TransportError(f"payload of {nbytes} bytes into a buffer of {view.nbytes}")
        try:
            await self._recv_exactly(view)
        except OSError as err:
            raise TransportError(f"receiving from {self._peer}: {err}") from err
        return view

    def close(self) -> None:
        self._sock.close()

    # -- the handshake: both sides prove the migration key over the other's fresh nonce --------------------

    async def client_handshake(self, key: bytes) -> None:
        try:
            async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
                hello = await self._recv_bytes(len(_MAGIC) + _NONCE_BYTES)
                if not hello.startswith(_MAGIC):
                    raise TransportError(f"{self._peer} is not a kvfleet migration port")
                server_nonce = hello[len(_MAGIC):]
                client_nonce = os.urandom(_NONCE_BYTES)
                await self._send_raw(client_nonce + _digest(key, b"client", server_nonce, client_nonce))
                verdict = await self._recv_bytes(1)
                if verdict != b"\x01":
                    raise AuthenticationError(f"{self._peer} refused our migration key")
                proof = await self._recv_bytes(hashlib.sha256().digest_size)
        except TimeoutError:
            raise TransportError(f"no handshake from {self._peer} in {HANDSHAKE_TIMEOUT_S} s") from None
        except OSError as err:
            raise TransportError(f"handshake with {self._peer}: {err}") from err
        if not hmac.compare_digest(proof, _digest(key, b"server", server_nonce, client_nonce)):
            raise AuthenticationError(f"{self._peer} does not hold the pool's migration key")

    async def server_handshake(self, credentials: PoolCredentials) -> None:
        server_nonce = os.urandom(_NONCE_BYTES)
        try:
            async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
                await self._send_raw(_MAGIC + server_nonce)
                answer = await self._recv_bytes(_NONCE_BYTES + hashlib.sha256().digest_size)
                client_nonce, proof = answer[:_NONCE_BYTES], answer[_NONCE_BYTES:]
                key = _key_of(credentials, proof, server_nonce, client_nonce)
                if key is None and await credentials.refresh_after_miss():  # the peer may know of a rotation first
                    key = _key_of(credentials, proof, server_nonce, client_nonce)
                if key is None:
                    await self._send_raw(b"\x00")
                    raise AuthenticationError(f"{self._peer} does not hold the pool's migration key")
                # Proven with the key the client used, so a client one rotation behind still checks it.
                await self._send_raw(b"\x01" + _digest(key, b"server", server_nonce, client_nonce))
        except TimeoutError:
            raise TransportError(f"no handshake from {self._peer} in {HANDSHAKE_TIMEOUT_S} s") from None
        except OSError as err:
            raise TransportError(f"handshake with {self._peer}: {err}") from err


def _key_of(credentials: PoolCredentials, proof: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes | None:
    """The migration key (current, or previous within its grace) the client's proof was made with."""
    matched = None
    for key in credentials.migration_keys():  # every key is tried: the time taken does not say which matched
        if hmac.compare_digest(proof, _digest(key, b"client", server_nonce, client_nonce)):
            matched = key
    return matched


def _tune(sock: socket.socket) -> None:
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, option, _SOCKET_BUFFER_BYTES)


class TCPListener:
    def __init__(self, sock: socket.socket, task: asyncio.Task[None], sessions: set[asyncio.Task[None]]) -> None:
        self._sock = sock
        self._task = task
        self._sessions = sessions

    @property
    def port(self) -> int:
        return int(self._sock.getsockname()[1])

    async def close(self) -> None:
        self._task.cancel()
        for session in list(self._sessions):
            session.cancel()
        await asyncio.gather(self._task, *self._sessions, return_exceptions=True)
        self._sock.close()


class TCPTransport:
    """Migration frames over TCP, every connection authenticated with the pool's migration key first."""

    def __init__(self, credentials: PoolCredentials) -> None:
        self._credentials = credentials

    async def connect(self, address: str, timeout_s: float = 5.0) -> TCPChannel:
        host, port = split_address(address)
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as err:
            raise TransportError(f"cannot resolve {address}: {err}") from err
        family, kind, proto, _, sockaddr = infos[0]
        sock = socket.socket(family, kind, proto)
        _tune(sock)
        try:
            async with asyncio.timeout(timeout_s):
                await loop.sock_connect(sock, sockaddr)
        except (OSError, TimeoutError) as err:
            sock.close()
            raise TransportError(f"cannot connect to {address}: {err or 'timed out'}") from err
        channel = TCPChannel(sock, address)
        try:
            await channel.client_handshake(self._credentials.migration_key)
        except AuthenticationError:
            channel.close()
            # The peer may know of a rotation before us: one more try if the Secret holds new values.
            if await self._credentials.refresh_after_miss():
                return await self.connect(address, timeout_s)
            raise
        except BaseException:
            channel.close()
            raise
        return channel

    async def listen(self, host: str, port: int, handler: Handler) -> TCPListener:
        sock = socket.create_server((host, port), reuse_port=False, backlog=64)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        sessions: set[asyncio.Task[None]] = set()

        async def session(conn: socket.socket, peer: str) -> None:
            channel = TCPChannel(conn, peer)
            try:
                await channel.server_handshake(self._credentials)
            except TransportError as err:
                log.warning("migration connection from %s refused: %s", peer, err)
                channel.close()
                return
            try:
                await handler(channel)
            except TransportError as err:
                log.warning("migration session with %s ended: %s", peer, err)
            except Exception:
                log.exception("migration session with %s failed", peer)
            finally:
                channel.close()

        async def accept() -> None:
            while True:
                conn, addr = await loop.sock_accept(sock)
                _tune(conn)
                task = asyncio.create_task(session(conn, f"{addr[0]}:{addr[1]}"))
                sessions.add(task)
                task.add_done_callback(sessions.discard)

        return TCPListener(sock, asyncio.create_task(accept(), name="kvfleet-migration-accept"), sessions)
