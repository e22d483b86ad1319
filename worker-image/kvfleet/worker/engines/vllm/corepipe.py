"""The EngineCore's second pipe to the agent: DistKV's lent and borrowed KV, off vLLM's step loop.

The connector's pipe (pipe.py, connector.py) is served by its scheduler side, whose asks wait for
vLLM's next step. DistKV needs the KV cache itself (the connector's worker side holds it) and must
not wait for a step: a lender answers a borrower's query whatever vLLM is doing, and a borrowing
forward asks the agent for the attention over its remote KV in the middle of a step. So the worker
side listens on a second socket beside the first (same private folder, same key), and this pipe
carries asks both ways:

- agent -> EngineCore (`on_ask` handlers, run on the pipe's reader thread): a lender's writes into
  and queries over lent blocks (lending.py);
- EngineCore -> agent (`call`, blocking the calling thread until the agent answers): a borrowing
  request's oldest blocks to move into leases, and its queries over them (borrowing.py).

An ask is {"op", "seq", ...} (+ a tensor), its answer {"reply_to": seq, "ok", ...} (+ a tensor).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from typing import Any

import torch

from kvfleet.worker.engines.vllm.pipe import Pipe, accept_agent, listen

CORE_SOCKET = "core.sock"
# A call waits this long for the agent (a remote micro-attention waits behind a lender's step).
CALL_TIMEOUT_S = 40.0

Handler = Callable[[dict[str, Any], torch.Tensor | None], tuple[dict[str, Any], torch.Tensor | None]]


def core_socket_path(connector_socket: str) -> str:
    """Where the EngineCore's second pipe listens: beside the connector's, in the same private folder."""
    return str(Path(connector_socket).parent / CORE_SOCKET)


class CallFailed(RuntimeError):
    """The agent answered a call with an error, or not at all; `lost`: the error was the loss of KV
    other workers held (a lender died or left: borrowing.py)."""

    def __init__(self, message: str, lost: bool = False) -> None:
        super().__init__(message)
        self.lost = lost


class CorePipe:
    """The EngineCore's end (module docstring): one agent at a time."""

    def __init__(self, socket_path: str, authkey: bytes) -> None:
        self._handlers: dict[str, Handler] = {}
        self._pipe: Pipe | None = None
        self._connected = threading.Event()
        self._seq = itertools.count(1)
        self._lock = threading.Lock()
        self._waiting: dict[int, tuple[threading.Event, list[tuple[dict[str, Any], torch.Tensor | None]]]] = {}
        self._listener: Listener = listen(socket_path, authkey)
        threading.Thread(target=accept_agent, args=(self._listener, lambda: self._pipe, self._on_connected, "kvfleet core pipe"),
                         name="kvfleet-core-accept", daemon=True).start()

    def handle(self, op: str, handler: Handler) -> None:
        """Answer the agent's asks `op` with `handler` (on the reader thread; an exception is the error)."""
        self._handlers[op] = handler

    def _on_connected(self, conn: Connection) -> None:
        self._pipe = Pipe(conn, self._on_message, self._on_closed, "kvfleet-core")
        self._connected.set()
        self._pipe.send({"op": "hello"})

    def close(self) -> None:
        self._listener.close()
        if self._pipe is not None:
            self._pipe.close()

    def _on_closed(self) -> None:
        self._connected.clear()
        with self._lock:
            waiting, self._waiting = self._waiting, {}
        for event, answer in waiting.values():
            answer.append(({"ok": False, "error": "the agent's pipe ended"}, None))
            event.set()

    def _on_message(self, msg: dict[str, Any], tensor: torch.Tensor | None) -> None:
        if "reply_to" in msg:
            with self._lock:
                waiter = self._waiting.pop(int(msg["reply_to"]), None)
            if waiter is not None:
                waiter[1].append((msg, tensor))
                waiter[0].set()
            return
        assert self._pipe is not None
        seq, op = int(msg.get("seq", 0)), str(msg.get("op"))
        try:
            handler = self._handlers.get(op)
            if handler is None:
                raise ValueError(f"unknown ask {op!r}")
            header, data = handler(msg, tensor)
            self._pipe.send({"seq": seq, "ok": True, **header}, data)
        except Exception as err:  # the agent's ask fails with the reason; the pipe goes on
            self._pipe.send({"seq": seq, "ok": False, "error": f"{type(err).__name__}: {err}"})

    def notify(self, op: str, **fields: Any) -> None:
        """Ask the agent without waiting for its answer (which is dropped when it comes)."""
        pipe = self._pipe
        if pipe is None or not self._connected.is_set():
            raise CallFailed("no agent is connected to the EngineCore's second pipe")
        pipe.send({"op": op, "seq": next(self._seq), "core_ask": True, **fields})

    def call(self, op: str, tensor: torch.Tensor | None = None, timeout_s: float = CALL_TIMEOUT_S,
             **fields: Any) -> tuple[dict[str, Any], torch.Tensor | None]:
        """Ask the agent and wait for its answer; CallFailed with its error, or when it does not answer."""
        return self.submit(op, tensor, timeout_s, **fields)()

    def submit(self, op: str, tensor: torch.Tensor | None = None, timeout_s: float = CALL_TIMEOUT_S,
               **fields: Any) -> Callable[[], tuple[dict[str, Any], torch.Tensor | None]]:
        """Ask the agent now; the returned call waits for the answer (as `call` does)."""
        pipe = self._pipe
        if pipe is None or not self._connected.is_set():
            raise CallFailed("no agent is connected to the EngineCore's second pipe")
        seq = next(self._seq)
        event = threading.Event()
        answer: list[tuple[dict[str, Any], torch.Tensor | None]] = []
        with self._lock:
            self._waiting[seq] = (event, answer)
        if pipe.closed.is_set():  # closed meanwhile: _on_closed may have woken the waiters before this one
            with self._lock:
                self._waiting.pop(seq, None)
            raise CallFailed("the agent's pipe ended")
        pipe.send({"op": op, "seq": seq, "core_ask": True, **fields}, tensor)

        def wait() -> tuple[dict[str, Any], torch.Tensor | None]:
            if not event.wait(timeout_s):
                with self._lock:
                    self._waiting.pop(seq, None)
                raise CallFailed(f"the agent did not answer {op!r} within {timeout_s:.0f} s")
            header, data = answer[0]
            if not header.get("ok"):
                raise CallFailed(str(header.get("error", f"{op} refused")), bool(header.get("lost")))
            return header, data

        return wait
