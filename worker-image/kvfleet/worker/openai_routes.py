"""The worker's OpenAI endpoints: `/v1/models`, `/v1/completions`, `/v1/chat/completions`.

A request is validated (kvfleet.serving.openai_api) and checked against this worker's model and
context before it becomes a `Job`, so bad input gets an OpenAI-format 4xx and never reaches the
engine. The answer is whole JSON or server-sent events; with `X-Kvfleet-Stream: tokens` (the router)
every chunk also carries its token ids, and a migration ends the stream with a hand-off event
instead of `[DONE]` (docs/migration.md). A client that goes away aborts its request at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from aiohttp import web

from kvfleet.serving import httpapi
from kvfleet.serving.openai_api import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ResponseShape,
    TokenizeChatRequest,
    model_list,
    token_meta,
    tokenize_request,
    usage,
    validated,
    version,
)
from kvfleet.worker.engines.base import EngineInfo, SamplingParams
from kvfleet.worker.migration.handoff import Moved, RequestMoved
from kvfleet.worker.streams import Delta, Job, RequestStreams
from kvfleet.worker.text import Tokenizer

log = logging.getLogger(__name__)


class OpenAIRoutes:
    """The handlers of the OpenAI endpoints, over the agent's engine (via `require_engine`) and streams."""

    def __init__(self, model_name: str, tokenizer: Tokenizer, require_engine: Callable[[], EngineInfo],
                 streams: RequestStreams) -> None:
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.require_engine = require_engine
        self.streams = streams

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/version", self.version)

    async def models(self, _: web.Request) -> web.Response:
        info = self.require_engine()
        return web.json_response(model_list(self.model_name, info.max_model_len))

    async def tokenize(self, request: web.Request) -> web.Response:
        """POST /tokenize as vLLM's server answers it: the prompt's (or the rendered chat's) token ids."""
        info = self.require_engine()
        body = tokenize_request(await httpapi.read_json(request))
        self._check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            ids = self._chat_ids(body.text_messages(), body.add_generation_prompt)
        else:
            ids = self.tokenizer.encode(body.prompt, body.add_special_tokens)
        return web.json_response({"count": len(ids), "max_model_len": info.max_model_len, "tokens": ids,
                                  "token_strs": self.tokenizer.token_strs(ids) if body.return_token_strs else None})

    async def detokenize(self, request: web.Request) -> web.Response:
        """POST /detokenize as vLLM's server answers it: the text of token ids."""
        self.require_engine()
        body = validated(DetokenizeRequest, await httpapi.read_json(request))
        self._check_model(body.model)
        vocab = self.tokenizer.vocab_size
        if any(t >= vocab for t in body.tokens):
            raise APIError(400, f"token ids must be below the vocabulary size {vocab}", param="tokens")
        return web.json_response({"prompt": self.tokenizer.decode(body.tokens)})

    async def version(self, _: web.Request) -> web.Response:
        return web.json_response(version())

    def _chat_ids(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """The messages rendered by the model's chat template, or the 400 when it has none."""
        try:
            return self.tokenizer.encode_chat(messages, add_generation_prompt)
        except ValueError as err:
            raise APIError(400, str(err), param="messages") from None

    def _check_model(self, model: str | None) -> None:
        """A request naming another model is a 404, as on the completions routes (None: this one)."""
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist here; this pool serves {self.model_name!r}",
                           param="model", code="model_not_found")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        info = self.require_engine()
        body = validated(CompletionRequest, await httpapi.read_json(request))
        prompt_ids = self.tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        job = self._job(info, httpapi.request_id(request, "cmpl"), body, prompt_ids, body.max_tokens)
        return await self._respond(request, job, body, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        info = self.require_engine()
        body = validated(ChatCompletionRequest, await httpapi.read_json(request))
        prompt_ids = self._chat_ids(body.text_messages())
        job = self._job(info, httpapi.request_id(request, "chatcmpl"), body, prompt_ids, body.output_limit())
        return await self._respond(request, job, body, chat=True)

    def _job(self, info: EngineInfo, request_id: str, body: CompletionRequest | ChatCompletionRequest,
             prompt_ids: list[int], max_tokens: int | None) -> Job:
        self._check_model(body.model)
        vocab = self.tokenizer.vocab_size
        if any(t >= vocab for t in prompt_ids):
            raise APIError(400, f"prompt token ids must be below the vocabulary size {vocab}", param="prompt")
        if max_tokens is None:
            max_tokens = info.max_model_len - len(prompt_ids)
        if len(prompt_ids) + max_tokens > info.max_model_len:
            raise APIError(400, f"This model's maximum context length is {info.max_model_len} tokens. However, you "
                           f"requested {len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the prompt, "
                           f"{max_tokens} for the completion). Please reduce the prompt or max_tokens.",
                           param="max_tokens" if len(prompt_ids) < info.max_model_len else "prompt",
                           code="context_length_exceeded")
        params = SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, seed=body.seed,
                                stop_token_ids=tuple(body.stop_token_ids), ignore_eos=body.ignore_eos)
        return Job(request_id, prompt_ids, params, body.stop_strings(), body.model)

    async def _respond(self, request: web.Request, job: Job, body: CompletionRequest | ChatCompletionRequest,
                       chat: bool) -> web.StreamResponse:
        shape = ResponseShape(job.request_id, job.created, body.model, chat)
        if body.stream:
            return await self._stream(request, job, shape, body.include_usage_in_stream())
        text, finish, completion_tokens = await self.streams.collect(job)
        return web.json_response(shape.whole(text, finish, usage(len(job.prompt_token_ids), completion_tokens)))

    async def _stream(self, request: web.Request, job: Job, shape: ResponseShape, include_usage: bool
                      ) -> web.StreamResponse:
        with_tokens = request.headers.get(httpapi.TOKEN_STREAM_HEADER, "").lower() == httpapi.TOKEN_STREAM_MODE
        # A router follows a migration itself; a direct client gets the continuation relayed.
        deltas = self.streams.deltas(job, follow_moves=not with_tokens)
        # Errors the engine raises before its first output still become a plain 4xx, not a broken stream.
        moved: Moved | None = None
        head: Delta = ("", None, ())
        try:
            head = await anext(deltas)
        except StopAsyncIteration:
            head = ("", "abort", ())
        except RequestMoved as err:  # handed over before its first token
            moved = err.moved
        response = web.StreamResponse(headers=httpapi.SSE_HEADERS)
        await response.prepare(request)
        tokens = 0

        async def send_step(text: str, reason: str | None, ids: tuple[int, ...]) -> None:
            nonlocal tokens
            if with_tokens:
                await response.write(httpapi.sse_data(shape.chunk(text, reason, token_meta(tokens, ids))))
            elif text or reason is not None:
                await response.write(httpapi.sse_data(shape.chunk(text, reason)))
            tokens += len(ids)

        try:
            meta = token_meta(0, (), job.prompt_token_ids) if with_tokens else None
            await response.write(httpapi.sse_data(shape.first_chunk(meta)))
            if moved is None:
                await send_step(*head)
                if head[1] is None:
                    try:
                        async for text, reason, ids in deltas:
                            await send_step(text, reason, ids)
                    except RequestMoved as err:
                        moved = err.moved
            if moved is not None:
                # The router reads the rest from the target; no [DONE] here (docs/migration.md).
                await response.write(moved.event())
                return response
            if include_usage:
                await response.write(httpapi.sse_data(shape.usage_chunk(usage(len(job.prompt_token_ids), tokens))))
            await response.write(httpapi.SSE_DONE)
        except (ConnectionResetError, asyncio.CancelledError):
            log.info("client of %s went away; aborting it", job.request_id)
            raise
        finally:
            await deltas.aclose()
        return response
