"""The borrower's side of a lease: the request's worker writes its newest KV into blocks a creditor
lent it and ships its queries there for the micro-attention over them (Infinite-LLM §4.3, §4.6).

One `RemoteLease` is one lease at one lender over one channel. Its calls run on the worker's event
loop; the engine's forward runs on its tensor thread and reaches a lease through the `*_blocking`
forms, which hand the call to the loop and wait (the loop is free meanwhile: the step awaits its
thread). Calls on a lease are sequential, as its channel is.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from kvfleet.worker.distkv.wire import REPLY_TIMEOUT_S, LendingRefused, empty_like_header, tensor_header, unpack_partial
from kvfleet.worker.migration.transport import Channel, Transport, TransportError
from kvfleet.worker.migration.wire import as_bytes

CONNECT_TIMEOUT_S = 5.0


class RemoteLease:
    """Blocks lent by the worker at `address` (its migration port) to this worker's request."""

    def __init__(self, transport: Transport, address: str, lease_id: str) -> None:
        self.address, self.lease_id = address, lease_id
        self._transport = transport
        self._channel: Channel | None = None
        self._lock = asyncio.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.blocks = 0
        self.block_size_tokens = 0
        self.bytes_sent = self.bytes_received = 0

    async def lend(self, num_blocks: int) -> None:
        """Open the lease (first call) or grow it by `num_blocks`; LendingRefused if the lender has no room."""
        async with self._lock:
            if self._channel is None:
                self._loop = asyncio.get_running_loop()
                try:
                    self._channel = await self._transport.connect(self.address, CONNECT_TIMEOUT_S)
                except TransportError as err:
                    raise LendingRefused(f"cannot reach the lender {self.address}: {err}") from err
            reply = await self._call({"op": "lend", "lease": self.lease_id, "blocks": num_blocks})
            self.blocks += num_blocks
            self.block_size_tokens = int(reply["block_size_tokens"])

    async def write(self, start_token: int, kv: torch.Tensor) -> None:
        """Store kv [layers, 2, tokens, kv_heads, head_dim] as the lease's tokens from `start_token`."""
        kv = kv.detach().cpu().contiguous()
        async with self._lock:
            await self._call({"op": "lend-write", "lease": self.lease_id, "start": start_token, **tensor_header(kv)},
                             as_bytes(kv))

    async def attend(self, layer: int, q: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """q [rows, q_heads, dim] over the lease's first `num_tokens` tokens -> (out, lse) in float32."""
        q = q.detach().cpu().contiguous()
        async with self._lock:
            reply = await self._call({"op": "lend-attend", "lease": self.lease_id, "layer": layer, "tokens": num_tokens,
                                      **tensor_header(q)}, as_bytes(q), payload=True)
        rows, heads, dim = (int(d) for d in reply["shape"])
        return unpack_partial(reply.get("payload"), rows, heads, dim)

    async def read(self, start_token: int, num_tokens: int) -> torch.Tensor:
        """The lease's tokens [start, start + n) back, as kv [layers, 2, n, kv_heads, head_dim] (DGFM's recall)."""
        async with self._lock:
            reply = await self._call({"op": "lend-read", "lease": self.lease_id, "start": start_token,
                                      "tokens": num_tokens}, payload=True, typed=True)
        kv = reply.get("payload")
        if not isinstance(kv, torch.Tensor) or kv.dim() != 5 or kv.shape[2] != num_tokens:
            raise LendingRefused(f"the lender answered {None if kv is None else list(kv.shape)} for {num_tokens} tokens")
        return kv

    async def trim(self, num_tokens: int) -> None:
        """Keep the lease's first `num_tokens` tokens; the lender gives back the blocks past them."""
        async with self._lock:
            reply = await self._call({"op": "lend-trim", "lease": self.lease_id, "tokens": num_tokens})
            self.blocks = int(reply["blocks"])

    async def free(self) -> None:
        """Give the blocks back and close; a lender that is gone has freed them already."""
        async with self._lock:
            channel, self._channel = self._channel, None
            if channel is None:
                return
            try:
                await self._call({"op": "lend-free", "lease": self.lease_id}, channel=channel)
            except (LendingRefused, TransportError):
                pass
            finally:
                channel.close()
                self.blocks = 0

    def attend_blocking(self, layer: int, q: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`attend` from the engine's tensor thread."""
        out, lse = self._blocking(self.attend(layer, q, num_tokens))
        return out, lse

    def write_blocking(self, start_token: int, kv: torch.Tensor) -> None:
        """`write` from the engine's tensor thread."""
        self._blocking(self.write(start_token, kv))

    def _blocking(self, call: Any) -> Any:
        if self._loop is None:
            call.close()
            raise LendingRefused("the lease is not open")
        return asyncio.run_coroutine_threadsafe(call, self._loop).result(REPLY_TIMEOUT_S + 5)

    async def _call(self, header: dict[str, Any], body: memoryview | None = None, *, payload: bool = False,
                    typed: bool = False, channel: Channel | None = None) -> dict[str, Any]:
        channel = channel or self._channel
        if channel is None:
            raise LendingRefused("the lease is closed")
        try:
            await channel.send(header, body)
            self.bytes_sent += 0 if body is None else body.nbytes
            frame = await channel.recv(REPLY_TIMEOUT_S)
            reply = dict(frame.header)
            if payload and frame.payload_nbytes:
                # float32 partials (attend), or a tensor of the shape and dtype its header gives (read).
                data = empty_like_header(reply) if typed else torch.empty(frame.payload_nbytes // 4, dtype=torch.float32)
                if data.numel() * data.element_size() != frame.payload_nbytes:
                    raise LendingRefused(f"a {list(data.shape)} {data.dtype} payload is not {frame.payload_nbytes} bytes")
                await channel.read_payload(frame.payload_nbytes, as_bytes(data))
                self.bytes_received += frame.payload_nbytes
                reply["payload"] = data
        except BaseException:
            # A call cut short (timed out, cancelled, a reply of the wrong size) leaves its reply, or part
            # of it, in the channel: the next call would read it as its own. The lease ends here instead.
            channel.close()
            if self._channel is channel:
                self._channel = None
            raise
        if not reply.get("ok"):
            room = reply.get("room", 0)
            raise LendingRefused(str(reply.get("error", "refused")), room if isinstance(room, int) and room > 0 else 0)
        return reply
