"""The OpenAI-compatible request and response shapes the workers and the router speak.

Clients are OpenAI SDKs and tools built for vLLM's OpenAI server (its own benchmark client among
them), so a request model here has every field the pinned vLLM's request model has
(tests/unit/test_openai_vllm_parity.py compares the two, so a vLLM upgrade that adds a field fails a
test instead of clients). A field kvfleet's engines do not serve yet is accepted at a value that asks
for nothing (vLLM's default, or one that leaves sampling as it is: `repetition_penalty: 1.0`,
`top_k: -1`) and refused at any other with a 400 in OpenAI's error format that names it: a silently
ignored parameter (say `n: 3` or `logprobs`) would give a client something other than what it asked
for. Unknown fields are refused too. `null` means the default, as in vLLM.
"""

from __future__ import annotations

import importlib.metadata
import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

# Longest request body a worker or the router reads; prompts beyond the model's context are refused anyway.
MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_STOP_STRINGS = 4


# vLLM's parameters that kvfleet's engines do not serve yet (the `_VLLMParameters` fields and each
# endpoint's own), with the values that ask for nothing besides the field's default (vLLM's, declared
# once, on the field). Both endpoints take these; each endpoint adds its own below.
_NOT_SERVED: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (), "top_k": (0, -1), "min_p": (0.0,), "repetition_penalty": (1.0,),
    "watermarking": (False,), "length_penalty": (), "include_stop_str_in_output": (), "min_tokens": (),
    "skip_special_tokens": (), "spaces_between_special_tokens": (), "truncate_prompt_tokens": (),
    "truncation_side": (), "allowed_token_ids": (), "prompt_logprobs": (), "logprob_token_ids": (), "bad_words": (),
    "logit_bias": ({},), "response_format": ({"type": "text"},), "structured_outputs": (), "priority": (),
    "request_id": (), "session_id": (), "return_tokens_as_token_ids": (False,), "return_token_ids": (False,),
    "routed_experts_prompt_start": (), "return_token_offsets": (None,), "mm_payload": (), "return_mm_kwargs": (False,),
    "cache_salt": (), "kv_transfer_params": (), "ec_transfer_params": (), "vllm_xargs": (), "repetition_detection": (),
    "thinking_token_budget": (), "stream_interval": (),
}
_NOT_SERVED_COMPLETION: dict[str, tuple[Any, ...]] = {**_NOT_SERVED, "add_special_tokens": (), "prompt_embeds": ()}
_NOT_SERVED_CHAT: dict[str, tuple[Any, ...]] = {
    **_NOT_SERVED, "add_special_tokens": (), "top_logprobs": (None,), "tools": ([],), "tool_choice": (None,),
    "reasoning_effort": (), "include_reasoning": (), "parallel_tool_calls": (None,), "add_generation_prompt": (),
    "continue_final_message": (), "documents": (), "chat_template": (), "chat_template_kwargs": ({},),
    "media_io_kwargs": (), "mm_processor_kwargs": (), "return_prompt_text": (False,)}


def _asks_nothing(value: Any, neutral: tuple[Any, ...]) -> bool:
    # bool is an int in Python: `top_k: false` is not `top_k: 0`, and `min_tokens: true` not 1.
    return any(value == n and isinstance(value, bool) == isinstance(n, bool) for n in neutral)


class _VLLMParameters(BaseModel):
    """The fields of vLLM's request models that both endpoints share and kvfleet does not serve yet
    (their values checked against `NOT_SERVED`)."""

    use_beam_search: Any = False
    top_k: Any = None
    min_p: Any = None
    repetition_penalty: Any = None
    watermarking: Any = None
    length_penalty: Any = 1.0
    include_stop_str_in_output: Any = False
    min_tokens: Any = 0
    skip_special_tokens: Any = True
    spaces_between_special_tokens: Any = True
    truncate_prompt_tokens: Any = None
    truncation_side: Any = None
    allowed_token_ids: Any = None
    prompt_logprobs: Any = None
    logprob_token_ids: Any = None
    bad_words: Any = Field(default_factory=list)
    logit_bias: Any = None
    response_format: Any = None
    structured_outputs: Any = None
    priority: Any = 0
    request_id: Any = None
    session_id: Any = None
    return_tokens_as_token_ids: Any = None
    return_token_ids: Any = None
    routed_experts_prompt_start: Any = 0
    return_token_offsets: Any = False
    mm_payload: Any = "tensors"
    return_mm_kwargs: Any = None
    cache_salt: Any = None
    kv_transfer_params: Any = None
    ec_transfer_params: Any = None
    vllm_xargs: Any = None
    repetition_detection: Any = None
    thinking_token_budget: Any = None
    stream_interval: Any = None


class _Request(_VLLMParameters):
    model_config = ConfigDict(extra="forbid", frozen=True)
    NOT_SERVED: ClassVar[dict[str, tuple[Any, ...]]] = _NOT_SERVED

    model: Annotated[str, StringConstraints(min_length=1, max_length=256)]
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: Literal[1] = 1
    stream: bool = False
    stream_options: dict[str, bool] | None = None
    stop: str | list[Annotated[str, StringConstraints(min_length=1)]] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # kvfleet extensions (vLLM spells them the same way).
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    ignore_eos: bool = False

    @field_validator("temperature", "top_p", "presence_penalty", "frequency_penalty", "stream", "echo", "logprobs",
                     "n", mode="before", check_fields=False)
    @classmethod
    def _null_is_default(cls, value: Any, info: ValidationInfo) -> Any:
        # vLLM's fields are Optional and null means its default; kvfleet's defaults are the same values.
        if value is None and info.field_name is not None:
            return cls.model_fields[info.field_name].get_default(call_default_factory=True)
        return value

    @field_validator("*", mode="after")
    @classmethod
    def _served(cls, value: Any, info: ValidationInfo) -> Any:
        name = info.field_name or ""
        no_ops = cls.NOT_SERVED.get(name)
        if no_ops is None:
            return value
        neutral = (cls.model_fields[name].get_default(call_default_factory=True), *no_ops)
        if not _asks_nothing(value, neutral):
            raise PydanticCustomError(
                "unsupported_parameter",
                "{value} is not served by kvfleet's engines yet: leave it out or send {neutral}",
                {"value": json.dumps(value, default=str)[:80],
                 "neutral": " or ".join(json.dumps(n) for n in neutral)})
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _neutral(cls, value: float) -> float:
        if value != 0:
            raise ValueError("only 0 is supported (kvfleet does not implement penalties)")
        return value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences")
        if value == "":
            raise ValueError("a stop sequence must not be empty")
        return value

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(_Request):
    """POST /v1/completions: one prompt, as text or as token ids."""

    NOT_SERVED: ClassVar[dict[str, tuple[Any, ...]]] = _NOT_SERVED_COMPLETION

    prompt: Annotated[str, StringConstraints(min_length=1)] | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    echo: Literal[False] = False
    add_special_tokens: Any = True
    prompt_embeds: Any = None
    logprobs: None = None
    suffix: None = None
    max_tokens: int | None = Field(default=16, ge=1)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict[str, Any]]
    name: str | None = None

    def text(self) -> str:
        """The message's text; content parts other than text are refused (no multimodal models here)."""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


def text_messages(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
    """The messages as `{"role", "content"}` with text content, or the 400 for a part that is not text."""
    try:
        return [{"role": m.role, "content": m.text()} for m in messages]
    except ValueError as err:
        raise APIError(400, str(err), param="messages") from None


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions: messages rendered with the model's chat template."""

    NOT_SERVED: ClassVar[dict[str, tuple[Any, ...]]] = _NOT_SERVED_CHAT

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: Literal[False] = False
    echo: Literal[False] = False
    add_special_tokens: Any = False
    top_logprobs: Any = 0
    tools: Any = None
    tool_choice: Any = "none"
    reasoning_effort: Any = None
    include_reasoning: Any = True
    parallel_tool_calls: Any = True
    add_generation_prompt: Any = True
    continue_final_message: Any = False
    documents: Any = None
    chat_template: Any = None
    chat_template_kwargs: Any = None
    media_io_kwargs: Any = None
    mm_processor_kwargs: Any = None
    return_prompt_text: Any = None

    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def text_messages(self) -> list[dict[str, str]]:
        return text_messages(self.messages)


RequestT = TypeVar("RequestT", bound=BaseModel)


class APIError(Exception):
    """A client error with everything the OpenAI error body needs."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 error_type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


def validated(model: type[RequestT], raw: dict[str, Any]) -> RequestT:
    """The request body as `model`, or the OpenAI-format 400 that names the first problem."""
    try:
        return model.model_validate(raw)
    except ValidationError as err:
        raise validation_error(err) from None


def validation_error(err: ValidationError) -> APIError:
    """The first problem pydantic found, with the field path OpenAI clients show."""
    first = err.errors()[0]
    param = ".".join(str(p) for p in first["loc"]) or None
    message = first["msg"]
    if first["type"] == "extra_forbidden":
        message = f"unknown field {param!r}"
    elif first["type"] == "missing":
        message = f"missing required field {param!r}"
    elif first["type"] in ("literal_error",) and param:
        message = f"{param}: {first['msg']} (kvfleet does not implement other values)"
    else:
        message = f"{param}: {message}" if param else message
    return APIError(400, message, param=param, code=first["type"])


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object, or the client error that says what is wrong with it."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {err.start})", code="invalid_encoding") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as err:
        raise APIError(400, f"malformed JSON: {err.msg} at line {err.lineno} column {err.colno}",
                       code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "malformed JSON: nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    where = _lone_surrogate(body)
    if where is not None:
        # JSON may escape half a surrogate pair ("\ud800"); no text is made of one, and the tokenizers raise on it.
        raise APIError(400, f"{where or 'the request body'}: a lone UTF-16 surrogate escape is not text", param=where or None,
                       code="invalid_encoding")
    return body


def _lone_surrogate(body: dict[str, Any]) -> str | None:
    """The dotted path of a string (key or value) holding a lone surrogate ("" for a key at the top), or None."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path
        elif isinstance(value, dict):
            for key, item in value.items():
                child = f"{path}.{key}" if path else str(key)
                try:
                    key.encode("utf-8")
                except UnicodeEncodeError:
                    return path
                stack.append((child, item))
        elif isinstance(value, list):
            stack.extend((f"{path}.{i}" if path else str(i), item) for i, item in enumerate(value))
    return None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def model_list(model_id: str, max_model_len: int) -> dict[str, Any]:
    """GET /v1/models: the pool's one model with the fields vLLM's server fills (its ModelCard: the
    context length, `root`, a permission), which clients built for vLLM read."""
    created = now_s()
    permission = {"id": new_id("modelperm"), "object": "model_permission", "created": created,
                  "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                  "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False, "organization": "*",
                  "group": None, "is_blocking": False}
    return {"object": "list", "data": [
        {"id": model_id, "object": "model", "created": created, "owned_by": "kvfleet", "root": model_id,
         "parent": None, "max_model_len": max_model_len, "permission": [permission]}]}


def version() -> dict[str, str]:
    """GET /version, as vLLM's server answers it: kvfleet's version (the installed distribution's)."""
    try:
        return {"version": importlib.metadata.version("kvfleet")}
    except importlib.metadata.PackageNotFoundError:  # run from a source tree without an install
        return {"version": "unknown"}


class TokenizeCompletionRequest(BaseModel):
    """POST /tokenize with a prompt (vLLM's TokenizeCompletionRequest)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(BaseModel):
    """POST /tokenize with messages, rendered by the model's chat template (vLLM's TokenizeChatRequest)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    return_token_strs: bool | None = False
    continue_final_message: Literal[False] = False
    add_special_tokens: Literal[False] = False
    chat_template: None = None
    chat_template_kwargs: None = None
    media_io_kwargs: None = None
    mm_processor_kwargs: None = None
    tools: None = None

    def text_messages(self) -> list[dict[str, str]]:
        return text_messages(self.messages)


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's DetokenizeRequest)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


def tokenize_request(raw: dict[str, Any]) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """A /tokenize body: with `messages` a chat, otherwise a prompt (as vLLM tells them apart)."""
    if "messages" in raw:
        return validated(TokenizeChatRequest, raw)
    return validated(TokenizeCompletionRequest, raw)


def token_meta(index: int, token_ids: Sequence[int], prompt_token_ids: Sequence[int] | None = None) -> dict[str, Any]:
    """A router-mode chunk's `kvfleet` field (httpapi.TOKEN_STREAM_HEADER): the output index of its first
    token and the token ids it covers; the stream's first chunk also carries the prompt's ids."""
    meta: dict[str, Any] = {"index": index, "token_ids": list(token_ids)}
    if prompt_token_ids is not None:
        meta["prompt_token_ids"] = list(prompt_token_ids)
    return meta


@dataclass(frozen=True)
class ResponseShape:
    """The response bodies of one request, completion or chat, whole or as stream chunks.

    The worker and the router both answer in these shapes, and a worker's continuation of a request
    handed over to it streams them too; one definition keeps a client's view the same whichever of
    them it talks to. A chunk's `kvfleet` argument is its `token_meta` (router mode only).
    """

    request_id: str
    created: int
    model: str
    chat: bool

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def chunk(self, text: str | None, finish: str | None, kvfleet: dict[str, Any] | None = None) -> dict[str, Any]:
        """One stream chunk: `text` (None or "" for none) and the finish reason on the last."""
        choice: dict[str, Any]
        if self.chat:
            choice = {"index": 0, "delta": {"content": text} if text else {}, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return self._chunk([choice], kvfleet)

    def first_chunk(self, kvfleet: dict[str, Any] | None = None) -> dict[str, Any]:
        """The chunk a stream opens with (chat: the assistant's role, as OpenAI sends it)."""
        if not self.chat:
            return self.chunk("", None, kvfleet)
        return self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}], kvfleet)

    def usage_chunk(self, counts: dict[str, int]) -> dict[str, Any]:
        """The last chunk before [DONE] when the client asked for `stream_options.include_usage`."""
        return {**self._chunk([], None), "usage": counts}

    def _chunk(self, choices: list[dict[str, Any]], kvfleet: dict[str, Any] | None) -> dict[str, Any]:
        body = {"id": self.request_id, "object": self.chunk_object, "created": self.created, "model": self.model,
                "choices": choices}
        if kvfleet is not None:
            body["kvfleet"] = kvfleet
        return body

    def whole(self, text: str, finish: str, counts: dict[str, int]) -> dict[str, Any]:
        """The whole response of a request that did not ask to be streamed."""
        if self.chat:
            return {"id": self.request_id, "object": "chat.completion", "created": self.created, "model": self.model,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                                 "finish_reason": finish}], "usage": counts}
        return {**self.chunk(text, finish), "usage": counts}
