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
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from typing import Any

import jinja2
from aiohttp import web

from kvfleet.serving import httpapi
from kvfleet.serving.aio import gather_all, merged
from kvfleet.serving.openai_api import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LogprobsLayout,
    ResponseShape,
    TemplateArguments,
    TokenizeChatRequest,
    TokenLogprob,
    ToolReplies,
    model_list,
    token_meta,
    tokenize_request,
    usage,
    validated,
    version,
)
from kvfleet.worker.engines.base import EngineInfo, SamplingParams, StructuredOutput
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
        # Hands a request prefilled here to the decode worker its router named (disaggregation.py);
        # None: this worker cannot (no pool token), and such a request decodes here.
        self.hand_over: Callable[[str, tuple[httpapi.DecodeTarget, ...]], None] | None = None
        # Before its prefill (by-layer layout: the prompt's KV streams out as it is computed), and when
        # it ends before a hand-over.
        self.prepare_hand_over: Callable[[str, list[int], tuple[httpapi.DecodeTarget, ...]], None] | None = None
        self.no_hand_over: Callable[[str], None] | None = None

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post(httpapi.RESUME_PATH, self.resume)
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
            ids = self._chat_ids(body.text_messages(), body.template_arguments())
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

    def _chat_ids(self, messages: list[dict[str, Any]], template: TemplateArguments) -> list[int]:
        """The messages rendered by the model's chat template with the request's arguments, or the 400
        when it has none or the template refuses them (a template may raise on what it cannot render)."""
        try:
            return self.tokenizer.encode_chat(messages, template.add_generation_prompt, template.tools,
                                              continue_final_message=template.continue_final_message,
                                              documents=template.documents, extra=template.extra)
        except ValueError as err:  # no template
            raise APIError(400, str(err), param="messages") from None
        except (TypeError, jinja2.TemplateError) as err:
            raise APIError(400, f"the chat template cannot render this chat: {err}", param="messages") from None

    def _check_model(self, model: str | None) -> None:
        """A request naming another model is a 404, as on the completions routes (None: this one)."""
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist here; this pool serves {self.model_name!r}",
                           param="model", code="model_not_found")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        info = self.require_engine()
        body = validated(CompletionRequest, await httpapi.read_json(request))
        prompt_ids = self.tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        request_id = httpapi.request_id(request, "cmpl")
        jobs = self._jobs(info, request_id, body, prompt_ids, body.max_tokens)
        # vLLM echoes a text prompt as given and a token prompt decoded.
        echo = (body.prompt if isinstance(body.prompt, str) else self.tokenizer.decode(prompt_ids)) if body.echo else ""
        return await self._respond(request, request_id, jobs, body, chat=False, echo=echo)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        info = self.require_engine()
        body = validated(ChatCompletionRequest, await httpapi.read_json(request))
        prompt_ids = self._chat_ids(body.text_messages(), body.template_arguments())
        request_id = httpapi.request_id(request, "chatcmpl")
        jobs = self._jobs(info, request_id, body, prompt_ids, body.output_limit())
        return await self._respond(request, request_id, jobs, body, chat=True)

    async def resume(self, request: web.Request) -> web.StreamResponse:
        """POST /internal/resume?output=N (the pool token required): a router's request continued here
        after the worker it ran on died. Its body is a completion whose prompt is the prompt's ids and
        then the N output tokens already sent, `max_tokens` the rest of the budget and the sampling
        fields the original's (`resume_fields`): the request continues after its output, with penalties,
        min_tokens and a grammar counting it (as a migration continues one), in router mode."""
        info = self.require_engine()
        body = validated(CompletionRequest, await httpapi.read_json(request))
        try:
            carried = int(request.query.get("output", ""))
        except ValueError:
            raise APIError(400, "output: the number of output tokens the prompt ends with is required",
                           param="output") from None
        if not isinstance(body.prompt, list) or not 0 < carried < len(body.prompt) or body.n != 1 or not body.stream:
            raise APIError(400, "a resume is one streamed sample whose prompt is token ids ending with its output",
                           param="prompt")
        if request.headers.get(httpapi.TOKEN_STREAM_HEADER, "").lower() != httpapi.TOKEN_STREAM_MODE:
            raise APIError(400, f"a resume is read in router mode ({httpapi.TOKEN_STREAM_HEADER})")
        [job] = self._jobs(info, httpapi.request_id(request, "cmpl"), body, list(body.prompt), body.max_tokens,
                           carried=carried)
        return await self._router_stream(request, job, ResponseShape(job.request_id, job.created, body.model, False), "")

    def _jobs(self, info: EngineInfo, request_id: str, body: CompletionRequest | ChatCompletionRequest,
              prompt_ids: list[int], max_tokens: int | None, carried: int = 0) -> list[Job]:
        """The request's samples as jobs for the engine (one unless `n`), or the 4xx that says why not.
        `carried`: the prompt's last ids are that many output tokens already generated (a resume), and
        `max_tokens` what is left of the budget."""
        self._check_model(body.model)
        vocab = self.tokenizer.vocab_size
        if any(t >= vocab for t in prompt_ids):
            raise APIError(400, f"prompt token ids must be below the vocabulary size {vocab}", param="prompt")
        biases = body.logit_biases()
        if any(t >= vocab for t, _ in biases):
            raise APIError(400, f"logit_bias: token ids must be below the vocabulary size {vocab}", param="logit_bias")
        if max_tokens is None:
            max_tokens = info.max_model_len - len(prompt_ids)
        if len(prompt_ids) + max_tokens > info.max_model_len:
            raise APIError(400, f"This model's maximum context length is {info.max_model_len} tokens. However, you "
                           f"requested {len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the prompt, "
                           f"{max_tokens} for the completion). Please reduce the prompt or max_tokens.",
                           param="max_tokens" if len(prompt_ids) < info.max_model_len else "prompt",
                           code="context_length_exceeded")
        if body.min_tokens > max_tokens:
            raise APIError(400, f"min_tokens: {body.min_tokens} is more than the {max_tokens} tokens the context leaves",
                           param="min_tokens")
        # A resume's min_tokens and max_tokens are what is left of them; the engine counts the output.
        min_tokens = body.min_tokens + carried if body.min_tokens else 0
        output_ids = prompt_ids[len(prompt_ids) - carried:]
        prompt_ids = prompt_ids[:len(prompt_ids) - carried]
        max_tokens += carried
        structured = body.structured()
        # vLLM's structured_outputs.disable_any_whitespace (response_format has no such option).
        any_whitespace = body.structured_outputs is None or not body.structured_outputs.disable_any_whitespace
        jobs = []
        for index in range(body.n):
            params = SamplingParams(
                max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=max(0, body.top_k),
                min_p=body.min_p, presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                repetition_penalty=body.repetition_penalty, logit_bias=biases, min_tokens=min_tokens,
                seed=body.sample_seed(index), stop_token_ids=tuple(body.stop_token_ids), ignore_eos=body.ignore_eos,
                logprobs=body.top_logprobs_wanted(),
                structured=None if structured is None else StructuredOutput(*structured, any_whitespace=any_whitespace))
            # The samples are separate engine requests; a lone one keeps the request's id.
            sample_id = request_id if body.n == 1 else f"{request_id}-{index}"
            jobs.append(Job(sample_id, prompt_ids, params, body.stop_strings(), body.model,
                            include_stop=body.include_stop_str_in_output, output_token_ids=output_ids))
        return jobs

    async def _respond(self, request: web.Request, request_id: str, jobs: list[Job],
                       body: CompletionRequest | ChatCompletionRequest, chat: bool, echo: str = "") -> web.StreamResponse:
        shape = ResponseShape(request_id, jobs[0].created, body.model, chat)
        wants_logprobs = body.top_logprobs_wanted() is not None
        prompt_tokens = len(jobs[0].prompt_token_ids)
        if body.stream:
            if request.headers.get(httpapi.TOKEN_STREAM_HEADER, "").lower() == httpapi.TOKEN_STREAM_MODE:
                if len(jobs) > 1:
                    raise APIError(400, "n: a router asks for one sample per request", param="n")
                return await self._router_stream(request, jobs[0], shape, echo)
            return await self._stream(request, jobs, shape, body.include_usage_in_stream(), echo, wants_logprobs,
                                      ToolReplies(body))
        texts = [""] * len(jobs)
        finishes = ["abort"] * len(jobs)
        tokens = [0] * len(jobs)
        logprobs: list[list[TokenLogprob]] = [[] for _ in jobs]
        async with aclosing(self._samples(jobs)) as samples:
            async for index, delta in samples:
                texts[index] += delta.text
                tokens[index] += len(delta.token_ids)
                logprobs[index].extend(delta.logprobs)
                finishes[index] = delta.finish_reason or finishes[index]
        replies = ToolReplies(body)
        choices = [replies.whole(echo + texts[i], finishes[i], LogprobsLayout(chat).of(logprobs[i]) if wants_logprobs
                                 else None) for i in range(len(jobs))]
        return web.json_response(shape.whole(choices, usage(prompt_tokens, sum(tokens))))

    async def _samples(self, jobs: list[Job]) -> AsyncGenerator[tuple[int, Delta], None]:
        """(sample index, delta) of every sample as they come, a direct client's (migrations followed).

        Every sample's first delta is awaited before any is yielded, so an engine's refusal is still
        a plain 4xx. With a prefix cache the first sample runs alone until its first token, so that the
        others find its prompt's KV cached and share it (MemServe's context caching) instead of each
        prefilling and holding the prompt."""
        streams = [self.streams.deltas(job, follow_moves=True) for job in jobs]
        try:
            if len(streams) > 1 and self.streams.engine.capabilities.prefix_cache is not None:
                first = await _head(streams[0])
                heads = [first, *await gather_all(_head(stream) for stream in streams[1:])]
            else:
                heads = await gather_all(_head(stream) for stream in streams)
            rest = []
            for index, (head, stream) in enumerate(zip(heads, streams, strict=True)):
                if head is not None:
                    yield index, head
                    if head.finish_reason is None:
                        rest.append((index, stream))
            async for item in merged(rest):
                yield item
        finally:
            for stream in streams:
                await stream.aclose()

    async def _stream(self, request: web.Request, jobs: list[Job], shape: ResponseShape, include_usage: bool,
                      echo: str, wants_logprobs: bool, replies: ToolReplies) -> web.StreamResponse:
        """A direct client's stream: every sample's chunks as they come, each with its choice index."""
        samples = self._samples(jobs)
        try:
            first = await anext(samples, None)
            response = web.StreamResponse(headers=httpapi.SSE_HEADERS)
            await response.prepare(request)
            layouts = [LogprobsLayout(shape.chat) for _ in jobs]
            tool_streams = [replies.stream() for _ in jobs]
            tokens = 0

            async def send(index: int, delta: Delta) -> None:
                nonlocal tokens
                tokens += len(delta.token_ids)
                logprobs = layouts[index].of(delta.logprobs) if wants_logprobs and delta.logprobs else None
                if replies.calls_tools:
                    for part, finish in tool_streams[index].step(delta.text, delta.finish_reason):
                        await response.write(httpapi.sse_data(shape.chunk(None, finish, index=index, logprobs=logprobs,
                                                                          delta=part)))
                        logprobs = None
                elif delta.text or delta.finish_reason is not None or logprobs is not None:
                    await response.write(httpapi.sse_data(shape.chunk(delta.text, delta.finish_reason, index=index,
                                                                      logprobs=logprobs)))

            for index in range(len(jobs)):
                await response.write(httpapi.sse_data(shape.first_chunk(index=index, text=echo)))
            if first is not None:
                await send(*first)
                async for index, delta in samples:
                    await send(index, delta)
            if include_usage:
                await response.write(httpapi.sse_data(shape.usage_chunk(usage(len(jobs[0].prompt_token_ids), tokens))))
            await response.write(httpapi.SSE_DONE)
        except (ConnectionResetError, asyncio.CancelledError):
            log.info("client of %s went away; aborting it", shape.request_id)
            raise
        finally:
            await samples.aclose()
        return response

    async def _router_stream(self, request: web.Request, job: Job, shape: ResponseShape, echo: str) -> web.StreamResponse:
        """A router's stream (X-Kvfleet-Stream: tokens): every step's token ids and log-probabilities
        with its text, and a hand-off event instead of [DONE] when the request moves (docs/migration.md).
        A request naming a decode worker (a disaggregated pool) is handed to it once its first token is
        out (docs/disaggregation.md)."""
        decode = _decode_target(request)
        if decode is None or self.prepare_hand_over is None or job.output_token_ids:
            return await self._relay_steps(request, job, shape, echo, decode)
        self.prepare_hand_over(job.request_id, job.prompt_token_ids, decode)
        try:
            return await self._relay_steps(request, job, shape, echo, decode)
        finally:
            if self.no_hand_over is not None:
                self.no_hand_over(job.request_id)  # closes a by-layer stream no hand-over took up

    async def _relay_steps(self, request: web.Request, job: Job, shape: ResponseShape, echo: str,
                           decode: tuple[httpapi.DecodeTarget, ...] | None) -> web.StreamResponse:
        deltas = self.streams.deltas(job, follow_moves=False)
        # Errors the engine raises before its first output still become a plain 4xx, not a broken stream.
        moved: Moved | None = None
        head = Delta("", None, ())
        try:
            head = await anext(deltas)
        except StopAsyncIteration:
            head = Delta("", "abort", ())
        except RequestMoved as err:  # handed over before its first token
            moved = err.moved
        response = web.StreamResponse(headers=httpapi.SSE_HEADERS)
        await response.prepare(request)
        # Output indices count the request's whole output, a resume's carried tokens included, as a
        # migration's continuation does (the router checks them against what it has relayed).
        tokens = len(job.output_token_ids)

        async def send_step(delta: Delta) -> None:
            nonlocal tokens
            meta = token_meta(tokens, delta.token_ids, logprobs=delta.logprobs)
            await response.write(httpapi.sse_data(shape.chunk(delta.text, delta.finish_reason, meta)))
            tokens += len(delta.token_ids)

        try:
            await response.write(httpapi.sse_data(shape.first_chunk(token_meta(0, (), job.prompt_token_ids), text=echo)))
            if moved is None:
                await send_step(head)
                if head.finish_reason is None and decode is not None and self.hand_over is not None:
                    self.hand_over(job.request_id, decode)
                if head.finish_reason is None:
                    try:
                        async for delta in deltas:
                            await send_step(delta)
                    except RequestMoved as err:
                        moved = err.moved
            if moved is not None:
                # The router reads the rest from the target; no [DONE] here (docs/migration.md).
                await response.write(moved.event())
                return response
            await response.write(httpapi.SSE_DONE)
        except (ConnectionResetError, asyncio.CancelledError):
            log.info("client of %s went away; aborting it", job.request_id)
            raise
        finally:
            await deltas.aclose()
        return response


def _decode_target(request: web.Request) -> tuple[httpapi.DecodeTarget, ...] | None:
    """The decode workers the router named, best first (the pool token was checked with the header), or None."""
    value = request.headers.get(httpapi.DECODE_TARGET_HEADER)
    if value is None:
        return None
    try:
        return httpapi.DecodeTarget.parse(value)
    except ValueError as err:
        raise APIError(400, str(err), param=httpapi.DECODE_TARGET_HEADER) from None


async def _head(stream: AsyncGenerator[Delta, None]) -> Delta | None:
    return await anext(stream, None)
