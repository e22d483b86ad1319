"""The pipe between the worker's agent and vLLM's EngineCore: one authenticated local socket, both ways.

kvfleet's KV connector (connector.py) runs inside vLLM's EngineCore process; the agent that asks it
to suspend, export, stage and release a request's KV (migration.py) runs in the worker's process. This
is the channel between the two: a Unix socket in a folder only this user can enter, authenticated
with a key only the two processes know (multiprocessing's HMAC handshake), carrying a header dict
and, where a message has one, a tensor's raw bytes. It holds no vLLM import, so the agent's half
loads without vllm's EngineCore code.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import torch

log = logging.getLogger(__name__)

# Asks the loop thread carries out (the rest the pipe's reader answers itself).
LOOP_OPS = frozenset({"suspend", "export", "release", "lend", "lend-trim", "lend-free"})


class Pipe:
    """One authenticated connection carrying (header dict, optional tensor) messages, both ways.

    Headers are pickled (the peer is authenticated and local); a tensor goes as its raw bytes after a
    header that says its shape and dtype, read straight into a tensor of that shape. A writer thread
    sends, so a caller never waits for the peer to read; a reader thread hands each message to
    `on_message`. `on_close` runs once when the connection ends (either side).
    """

    def __init__(self, conn: Connection, on_message: Callable[[dict[str, Any], torch.Tensor | None], None],
                 on_close: Callable[[], None], name: str) -> None:
        self._conn = conn
        self._on_message = on_message
        self._on_close = on_close
        self._outbox: queue.SimpleQueue[tuple[dict[str, Any], torch.Tensor | None] | None] = queue.SimpleQueue()
        self.closed = threading.Event()
        threading.Thread(target=self._write, name=f"{name}-writer", daemon=True).start()
        threading.Thread(target=self._read, name=f"{name}-reader", daemon=True).start()

    def send(self, header: dict[str, Any], tensor: torch.Tensor | None = None) -> None:
        if tensor is not None:
            tensor = tensor.detach().to("cpu").contiguous()
            header = {**header, "shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch.")}
        self._outbox.put((header, tensor))

    def close(self) -> None:
        self._outbox.put(None)

    def _write(self) -> None:
        try:
            while (item := self._outbox.get()) is not None:
                header, tensor = item
                self._conn.send(header)
                if tensor is not None:
                    self._conn.send_bytes(_bytes_of(tensor))
        except OSError:
            pass
        finally:
            self._finish()

    def _read(self) -> None:
        try:
            while True:
                header = self._conn.recv()
                tensor = None
                if "shape" in header:
                    tensor = torch.empty([int(d) for d in header["shape"]], dtype=getattr(torch, str(header["dtype"])))
                    self._conn.recv_bytes_into(_bytes_of(tensor))
                self._on_message(header, tensor)
        except (EOFError, OSError, TypeError):
            # TypeError: the writer closed the connection (`_finish`) while this thread was blocked in
            # recv, and multiprocessing then reads from the handle it set to None. Closed either way.
            pass
        finally:
            self._finish()

    def _finish(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        self._outbox.put(None)
        try:
            self._conn.close()
        except OSError:
            pass
        self._on_close()


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    array: Any = tensor.view(-1).view(torch.uint8).numpy()
    return memoryview(array)


def connect(socket_path: str, authkey: bytes) -> Connection:
    """The agent's end of the pipe (the EngineCore listens)."""
    return Client(socket_path, family="AF_UNIX", authkey=authkey)


def accept_agent(listener: Listener, current: Callable[[], Pipe | None], connected: Callable[[Connection], None],
                 name: str) -> None:
    """The EngineCore's accept loop on `listener`, until it is closed (run it on a thread of its own): a
    peer without the key is refused and listening goes on; while `current()` is an open pipe, another
    connection is closed (one agent per engine); else `connected` takes it."""
    while True:
        try:
            conn = listener.accept()
        except OSError:
            return  # closed
        except Exception as err:  # a peer without the key: refuse it, keep listening
            log.warning("%s: refused a connection: %s", name, err)
            continue
        pipe = current()
        if pipe is not None and not pipe.closed.is_set():
            conn.close()
            continue
        connected(conn)


def listen(socket_path: str, authkey: bytes) -> Listener:
    """The EngineCore's end of the pipe: it listens, the agent connects."""
    return Listener(socket_path, family="AF_UNIX", authkey=authkey)


def new_socket_path(folder: str) -> str:
    """A socket path in a folder only this user can enter."""
    os.makedirs(folder, mode=0o700, exist_ok=True)
    return os.path.join(folder, "kv.sock")
