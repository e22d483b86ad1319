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
import re
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

# Longest request body a worker or the router reads; prompts beyond the model's context are refused anyway.
MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_STOP_STRINGS = 4


# vLLM's parameters that kvfleet's engines do not serve yet (the `_VLLMParameters` fields and each
# endpoint's own), with the values that ask for nothing besides the field's default (vLLM's, declared
# once, on the field). Both endpoints take these; each endpoint adds its own below.
_NOT_SERVED: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (), "watermarking": (False,), "length_penalty": (), "skip_special_tokens": (),
    "spaces_between_special_tokens": (), "truncate_prompt_tokens": (), "truncation_side": (), "allowed_token_ids": (),
    "prompt_logprobs": (), "logprob_token_ids": (), "bad_words": (), "priority": (), "request_id": (), "session_id": (),
    "return_tokens_as_token_ids": (False,), "return_token_ids": (False,), "routed_experts_prompt_start": (),
    "return_token_offsets": (None,), "mm_payload": (), "return_mm_kwargs": (False,), "cache_salt": (),
    "kv_transfer_params": (), "ec_transfer_params": (), "vllm_xargs": (), "repetition_detection": (),
    "thinking_token_budget": (), "stream_interval": (),
}
_NOT_SERVED_COMPLETION: dict[str, tuple[Any, ...]] = {**_NOT_SERVED, "add_special_tokens": (), "prompt_embeds": ()}
_NOT_SERVED_CHAT: dict[str, tuple[Any, ...]] = {
    **_NOT_SERVED, "add_special_tokens": (), "echo": (), "reasoning_effort": (), "include_reasoning": (),
    "chat_template": (),
    "media_io_kwargs": (), "mm_processor_kwargs": (), "return_prompt_text": (False,)}

# The most samples one request may ask for (`n`), and the most top log-probabilities per token (vLLM's
# default `max_logprobs`).
MAX_N = 16
MAX_LOGPROBS = 20
# vLLM clamps a logit bias to this magnitude (its serving layer); OpenAI documents the same range.
MAX_LOGIT_BIAS = 100.0


def _asks_nothing(value: Any, neutral: tuple[Any, ...]) -> bool:
    # bool is an int in Python: `top_k: false` is not `top_k: 0`, and `min_tokens: true` not 1.
    return any(value == n and isinstance(value, bool) == isinstance(n, bool) for n in neutral)


class _VLLMParameters(BaseModel):
    """The fields of vLLM's request models that both endpoints share and kvfleet does not serve yet
    (their values checked against `NOT_SERVED`)."""

    use_beam_search: Any = False
    watermarking: Any = None
    length_penalty: Any = 1.0
    skip_special_tokens: Any = True
    spaces_between_special_tokens: Any = True
    truncate_prompt_tokens: Any = None
    truncation_side: Any = None
    allowed_token_ids: Any = None
    prompt_logprobs: Any = None
    logprob_token_ids: Any = None
    bad_words: Any = Field(default_factory=list)
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


# The kinds of output constraint (the engines' StructuredOutput.kind spells them the same).
ConstraintKind = Literal["json_object", "json_schema", "regex", "choice", "grammar"]


class JSONSchemaFormat(BaseModel):
    """`response_format.json_schema`: the schema the output must follow."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: text, any JSON object, or JSON that follows a schema."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (its StructuredOutputsParams): one constraint of json, regex, choice,
    grammar or json_object; the backend's tuning options are accepted only at their defaults."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: Literal[False] = False
    disable_any_whitespace: bool = False
    disable_additional_properties: Literal[False] = False
    whitespace_pattern: None = None
    structural_tag: None = None

    def constraint(self) -> tuple[ConstraintKind, str] | None:
        given: list[tuple[ConstraintKind, str]] = []
        if self.json_ is not None:
            given.append(("json_schema", self.json_ if isinstance(self.json_, str) else json.dumps(self.json_)))
        if self.regex is not None:
            given.append(("regex", self.regex))
        if self.choice is not None:
            given.append(("choice", json.dumps(self.choice)))
        if self.grammar is not None:
            given.append(("grammar", self.grammar))
        if self.json_object:
            given.append(("json_object", ""))
        if len(given) > 1:
            raise ValueError("give one of json, regex, choice, grammar, json_object")
        return given[0] if given else None


class _Request(_VLLMParameters):
    model_config = ConfigDict(extra="forbid", frozen=True)
    NOT_SERVED: ClassVar[dict[str, tuple[Any, ...]]] = _NOT_SERVED

    model: Annotated[str, StringConstraints(min_length=1, max_length=256)]
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    # vLLM: -1 and 0 both mean every token.
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: dict[str, bool] | None = None
    stop: str | list[Annotated[str, StringConstraints(min_length=1)]] | None = None
    include_stop_str_in_output: bool = False
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)
    # Token id (as a string, OpenAI's form) -> bias added to its logit.
    logit_bias: dict[str, Annotated[float, Field(allow_inf_nan=False)]] | None = None
    min_tokens: int = Field(default=0, ge=0)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    user: str | None = None
    # kvfleet extensions (vLLM spells them the same way).
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    ignore_eos: bool = False

    @field_validator("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "min_tokens", "n", "stream", "echo", "logprobs", "top_logprobs",
                     "include_stop_str_in_output", mode="before", check_fields=False)
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

    @field_validator("logit_bias")
    @classmethod
    def _biases(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is None:
            return None
        for key in value:
            if not key.isdigit():
                raise ValueError(f"keys are token ids; {key!r} is not one")
        # vLLM clamps rather than refuses (its serving layer); so does kvfleet.
        return {key: max(-MAX_LOGIT_BIAS, min(MAX_LOGIT_BIAS, bias)) for key, bias in value.items()}

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences")
        if value == "":
            raise ValueError("a stop sequence must not be empty")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> _Request:
        limit = self.output_limit()
        if limit is not None and self.min_tokens > limit:
            raise PydanticCustomError("value_error", "min_tokens: must not exceed max_tokens ({limit})", {"limit": limit})
        if self.response_format is not None and self.response_format.type == "json_schema" \
                and self.response_format.json_schema is None:
            raise PydanticCustomError("value_error", "response_format: json_schema is required with type json_schema")
        if self.response_format is not None and self.response_format.type != "text" \
                and self.structured_outputs is not None:
            raise PydanticCustomError("value_error",
                                      "structured_outputs: give either it or response_format, not both")
        if self.structured_outputs is not None:
            try:
                self.structured_outputs.constraint()
            except ValueError as err:
                raise PydanticCustomError("value_error", "structured_outputs: {why}", {"why": str(err)}) from None
        return self

    def output_limit(self) -> int | None:
        return self.max_tokens

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    def structured(self) -> tuple[ConstraintKind, str] | None:
        """The output's constraint as (kind, spec) (engines/base.py's StructuredOutput), or None."""
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            return ("json_object", "")
        if fmt is not None and fmt.type == "json_schema":
            assert fmt.json_schema is not None
            return ("json_schema", json.dumps(fmt.json_schema.json_schema))
        return self.structured_outputs.constraint() if self.structured_outputs is not None else None

    def logit_biases(self) -> tuple[tuple[int, float], ...]:
        return tuple(sorted((int(k), v) for k, v in (self.logit_bias or {}).items()))

    def sample_seed(self, index: int) -> int | None:
        """Sample `index`'s seed: vLLM gives the n samples of a seeded request seed, seed + 1, ..."""
        return None if self.seed is None else self.seed + index


class CompletionRequest(_Request):
    """POST /v1/completions: one prompt, as text or as token ids."""

    NOT_SERVED: ClassVar[dict[str, tuple[Any, ...]]] = _NOT_SERVED_COMPLETION

    prompt: Annotated[str, StringConstraints(min_length=1)] | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    echo: bool = False
    add_special_tokens: Any = True
    prompt_embeds: Any = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    suffix: None = None
    max_tokens: int | None = Field(default=16, ge=1)

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and value and all(isinstance(p, str | list) for p in value):
            # vLLM takes a batch of prompts (one choice each); kvfleet places and moves requests one by one.
            raise PydanticCustomError("unsupported_parameter",
                                      "a list of prompts is not served by kvfleet yet: send one prompt per request")
        return value

    @model_validator(mode="after")
    def _echo_alone(self) -> CompletionRequest:
        if self.echo and self.logprobs is not None:
            # vLLM answers it with the prompt's log-probabilities, which kvfleet's engines do not compute.
            raise PydanticCustomError("unsupported_parameter",
                                      "echo: not served together with logprobs by kvfleet's engines yet")
        return self

    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs


class FunctionCall(BaseModel):
    """An assistant's call of a tool: its name and its arguments as JSON text (OpenAI's form)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Annotated[str, StringConstraints(min_length=1)]
    arguments: str


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    # An assistant's earlier tool calls, and a tool message's answer to one of them.
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _shape(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise PydanticCustomError("missing", "content is required (only an assistant's tool calls may go without)")
        if self.tool_calls is not None and self.role != "assistant":
            raise PydanticCustomError("value_error", "tool_calls: only an assistant message has tool calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise PydanticCustomError("missing", "tool_call_id: a tool message answers a tool call; name it")
        return self

    def text(self) -> str:
        """The message's text; content parts other than text are refused (no multimodal models here)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates take it: text content, and tool calls with their arguments
        parsed (vLLM parses them too, since templates render them as objects)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


@dataclass(frozen=True)
class TemplateArguments:
    """What the chat template renders besides the messages (vLLM's names for them)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    documents: list[dict[str, str]] | None = None
    tools: list[dict[str, Any]] | None = None
    # chat_template_kwargs: variables the template reads (say enable_thinking).
    extra: dict[str, Any] = field(default_factory=dict)


# apply_chat_template's own parameters: chat_template_kwargs may not set them behind the request's back.
_RESERVED_TEMPLATE_KWARGS = frozenset({"chat_template", "tokenize", "add_generation_prompt", "continue_final_message",
                                       "tools", "documents", "messages", "conversation", "return_dict",
                                       "return_tensors", "tokenizer_kwargs", "padding", "truncation", "max_length"})


def check_template_arguments(add_generation_prompt: bool, continue_final_message: bool,
                             kwargs: dict[str, Any] | None) -> None:
    if continue_final_message and add_generation_prompt:
        # vLLM's wording (its check_generation_prompt).
        raise PydanticCustomError("value_error", "continue_final_message: Cannot set both `continue_final_message` and "
                                  "`add_generation_prompt` to True.")
    reserved = sorted(set(kwargs or {}) & _RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise PydanticCustomError("value_error", "chat_template_kwargs: {keys} are the request's own fields",
                                  {"keys": ", ".join(reserved)})


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text  # a template that wants an object gets the text, as a client sent it


def text_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as chat templates take them (`ChatMessage.for_template`), or the 400 for a content
    part that is not text."""
    try:
        return [m.for_template() for m in messages]
    except ValueError as err:
        raise APIError(400, str(err), param="messages") from None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Annotated[str, StringConstraints(min_length=1, max_length=256)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(BaseModel):
    """One tool a chat may call (OpenAI's `tools` entry)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Annotated[str, StringConstraints(min_length=1)]


class NamedToolChoice(BaseModel):
    """`tool_choice` naming the one tool the reply must call."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["function"] = "function"
    function: NamedFunction


def _params_or_empty_object(parameters: dict[str, Any] | None) -> dict[str, Any]:
    # vLLM's tool_parsers/utils.py: a tool without parameters takes an empty object.
    return parameters if parameters else {"type": "object", "properties": {}}


def tool_calls_schema(tools: Sequence[ChatTool], parallel: bool | None) -> dict[str, Any]:
    """The JSON schema a `tool_choice: "required"` reply follows: a list of {name, parameters}, one of
    the tools each (vLLM's _get_json_schema_from_tools, $defs merged the same way). One difference:
    an item may hold no other key (vLLM's schema allows them and its parser drops them), so that a
    model cannot write keys nobody reads until its budget runs out."""
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
        {"properties": {"name": {"type": "string", "enum": [t.function.name]},
                        "parameters": _params_or_empty_object({k: v for k, v in (t.function.parameters or {}).items()
                                                               if k != "$defs"})},
         "required": ["name", "parameters"], "additionalProperties": False} for t in tools]}}
    if parallel is False:
        schema["maxItems"] = 1
    defs: dict[str, Any] = {}
    for tool in tools:
        for name, definition in ((tool.function.parameters or {}).get("$defs") or {}).items():
            if name in defs and defs[name] != definition:
                raise ValueError(f"tools: the definition {name!r} has several schemas")
            defs[name] = definition
    if defs:
        schema["$defs"] = defs
    return schema


def new_tool_call_id() -> str:
    return new_id("chatcmpl-tool")


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions: messages rendered with the model's chat template."""

    NOT_SERVED: ClassVar[dict[str, tuple[Any, ...]]] = _NOT_SERVED_CHAT

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    echo: Any = False
    add_special_tokens: Any = False
    top_logprobs: int = Field(default=0, ge=0, le=MAX_LOGPROBS)
    tools: Annotated[list[ChatTool], Field(min_length=1)] | None = None
    # vLLM's default: "none", or "auto" when tools are given (its check_tool_usage).
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    reasoning_effort: Any = None
    include_reasoning: Any = True
    parallel_tool_calls: bool | None = True
    # How the chat template renders the conversation (vLLM passes them to it). A request's own template
    # is refused, as vLLM refuses it unless started with --trust-request-chat-template.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: Any = None
    chat_template_kwargs: dict[str, Any] | None = None
    media_io_kwargs: Any = None
    mm_processor_kwargs: Any = None
    return_prompt_text: Any = None

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs > 0 and not self.logprobs:
            # vLLM's wording (its ChatCompletionRequest.check_logprobs).
            raise PydanticCustomError("value_error", "top_logprobs: when using top_logprobs, logprobs must be set to true")
        return self

    @model_validator(mode="after")
    def _tool_usage(self) -> ChatCompletionRequest:
        # vLLM's check_tool_usage, in its words.
        choice = self.tool_choice
        if choice not in (None, "none") and self.tools is None:
            raise PydanticCustomError("value_error", "tool_choice: When using `tool_choice`, `tools` must be set.")
        if isinstance(choice, NamedToolChoice) and self.tools is not None \
                and choice.function.name not in {t.function.name for t in self.tools}:
            raise PydanticCustomError("value_error", "tool_choice: Tool '{name}' has not been passed in `tools`.",
                                      {"name": choice.function.name})
        if self.tool_mode() in ("named", "required") and (self.response_format is not None
                                                          and self.response_format.type != "text"
                                                          or self.structured_outputs is not None):
            raise PydanticCustomError("value_error",
                                      "tool_choice: a required or named tool call is a structured output already")
        if self.tool_mode() == "required":
            assert self.tools is not None
            try:
                tool_calls_schema(self.tools, self.parallel_tool_calls)
            except ValueError as err:
                raise PydanticCustomError("value_error", "{why}", {"why": str(err)}) from None
        return self

    def tool_mode(self) -> Literal["none", "auto", "required", "named"]:
        """How the reply treats the tools: not at all, as the model likes (its text is the content: no
        tool-call parser runs, as in vLLM without --enable-auto-tool-choice), or must call them."""
        if self.tools is None or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return "required" if self.tool_choice == "required" else "auto"

    def structured(self) -> tuple[ConstraintKind, str] | None:
        """A required or named tool call is generated as JSON that follows the tool's schema (vLLM's
        get_json_schema_from_tools); otherwise the request's own constraint."""
        mode = self.tool_mode()
        if mode == "named":
            assert self.tools is not None and isinstance(self.tool_choice, NamedToolChoice)
            name = self.tool_choice.function.name
            tool = next(t for t in self.tools if t.function.name == name)
            return ("json_schema", json.dumps(_params_or_empty_object(tool.function.parameters)))
        if mode == "required":
            assert self.tools is not None
            return ("json_schema", json.dumps(tool_calls_schema(self.tools, self.parallel_tool_calls)))
        return super().structured()

    @model_validator(mode="after")
    def _template_arguments(self) -> ChatCompletionRequest:
        check_template_arguments(self.add_generation_prompt, self.continue_final_message, self.chat_template_kwargs)
        return self

    def template_arguments(self) -> TemplateArguments:
        return TemplateArguments(self.add_generation_prompt, self.continue_final_message, self.documents,
                                 self.template_tools(), self.chat_template_kwargs or {})

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as chat templates take them; a template sees them whatever `tool_choice` says, as
        in vLLM (its `exclude_tools_when_tool_choice_none` is off by default)."""
        return None if self.tools is None else [t.model_dump(exclude_none=True) for t in self.tools]

    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def top_logprobs_wanted(self) -> int | None:
        return self.top_logprobs if self.logprobs else None

    def text_messages(self) -> list[dict[str, str]]:
        return text_messages(self.messages)


def resume_fields(body: CompletionRequest | ChatCompletionRequest) -> dict[str, Any]:
    """What a sample's continuation on another worker keeps of its request, as completion fields (a
    router's resume after a worker died is a completion of the prompt's token ids and the output so
    far: the worker's POST /internal/resume): every sampling field, the constraint (a chat's tools
    included) as `structured_outputs`, the logprobs count, `min_tokens` (the caller takes off what
    is done, and sets `max_tokens` to what is left), but not `seed` (the sample's)."""
    fields = body.model_dump(include={"model", "temperature", "top_p", "top_k", "min_p", "min_tokens", "presence_penalty",
                                      "frequency_penalty", "repetition_penalty", "logit_bias", "stop", "stop_token_ids",
                                      "include_stop_str_in_output", "ignore_eos", "user"}, exclude_none=True)
    wanted = body.top_logprobs_wanted()
    if wanted is not None:
        fields["logprobs"] = wanted
    constraint = body.structured()
    if constraint is not None:
        kind, spec = constraint
        structured: dict[str, Any]
        if kind == "json_schema":
            structured = {"json": spec}
        elif kind == "choice":
            structured = {"choice": json.loads(spec)}
        elif kind == "json_object":
            structured = {"json_object": True}
        else:  # regex, grammar: the field of the same name
            structured = {kind: spec}
        if body.structured_outputs is not None and body.structured_outputs.disable_any_whitespace:
            structured["disable_any_whitespace"] = True
        fields["structured_outputs"] = structured
    return fields


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
    if param is None and re.match(r"^[a-z_]+: ", message):
        # A check across fields (a model validator) names the field its message starts with.
        return APIError(400, message, param=message.split(":", 1)[0], code=first["type"])
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
    continue_final_message: bool = False
    add_special_tokens: Literal[False] = False
    chat_template: None = None
    chat_template_kwargs: dict[str, Any] | None = None
    media_io_kwargs: None = None
    mm_processor_kwargs: None = None
    tools: list[ChatTool] | None = None

    @model_validator(mode="after")
    def _template_arguments(self) -> TokenizeChatRequest:
        check_template_arguments(self.add_generation_prompt, self.continue_final_message, self.chat_template_kwargs)
        return self

    def text_messages(self) -> list[dict[str, Any]]:
        return text_messages(self.messages)

    def template_arguments(self) -> TemplateArguments:
        return TemplateArguments(self.add_generation_prompt, self.continue_final_message, None,
                                 None if self.tools is None else [t.model_dump(exclude_none=True) for t in self.tools],
                                 self.chat_template_kwargs or {})


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


def token_meta(index: int, token_ids: Sequence[int], prompt_token_ids: Sequence[int] | None = None,
               logprobs: Sequence[TokenLogprob] = ()) -> dict[str, Any]:
    """A router-mode chunk's `kvfleet` field (httpapi.TOKEN_STREAM_HEADER): the output index of its first
    token and the token ids it covers, their log-probabilities when asked for; the stream's first chunk
    also carries the prompt's ids."""
    meta: dict[str, Any] = {"index": index, "token_ids": list(token_ids)}
    if prompt_token_ids is not None:
        meta["prompt_token_ids"] = list(prompt_token_ids)
    if logprobs:
        meta["logprobs"] = [entry.to_wire() for entry in logprobs]
    return meta


@dataclass(frozen=True)
class TokenLogprob:
    """One output token's log-probability and the most likely tokens at its place, with their text.

    The neutral form both response layouts are made from (completions' parallel lists, chat's list of
    objects), and what a router-mode chunk carries, so the router answers in either layout, across a
    migration or a resume, without a tokenizer. A token's text is the tokenizer's decoding of it alone,
    as vLLM gives it (its convert_ids_list_to_tokens)."""

    token_id: int
    token: str
    logprob: float
    # (token id, text, logprob), most likely first.
    top: tuple[tuple[int, str, float], ...] = ()

    def to_wire(self) -> list[Any]:
        return [self.token_id, self.token, self.logprob, [list(t) for t in self.top]]

    @classmethod
    def from_wire(cls, raw: Sequence[Any]) -> TokenLogprob:
        token_id, token, logprob, top = raw
        return cls(int(token_id), str(token), float(logprob),
                   tuple((int(i), str(t), float(lp)) for i, t, lp in top))


def _clamped(logprob: float) -> float:
    # vLLM clamps -inf (a token the sampler masked) to -9999.0 so that the JSON stays valid.
    return max(logprob, -9999.0)


class LogprobsLayout:
    """One choice's log-probabilities as its endpoint shows them, chunk after chunk.

    Completions: vLLM's CompletionLogProbs (parallel lists, `text_offset` counted from the token
    texts, continuing over the chunks of a stream; each `top_logprobs` holds the chosen token and the
    most likely ones, as vLLM's does); chat: OpenAI's `{"content": [...]}` with each
    token's bytes and its `top_logprobs`."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        # Where the next token's text starts in the choice's text (echo with logprobs is not served, so
        # the text starts with the output).
        self.text_offset = 0

    def of(self, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        if self.chat:
            return {"content": [{"token": e.token, "logprob": _clamped(e.logprob), "bytes": list(e.token.encode()),
                                 "top_logprobs": [{"token": t, "logprob": _clamped(lp), "bytes": list(t.encode())}
                                                  for _, t, lp in e.top]} for e in entries]}
        offsets = []
        for entry in entries:
            offsets.append(self.text_offset)
            self.text_offset += len(entry.token)
        return {"text_offset": offsets, "token_logprobs": [_clamped(e.logprob) for e in entries],
                "tokens": [e.token for e in entries],
                "top_logprobs": [{e.token: _clamped(e.logprob), **{t: _clamped(lp) for _, t, lp in e.top}}
                                 for e in entries]}


@dataclass(frozen=True)
class Choice:
    """One sample's whole answer (a chat's tool calls, when it made some, instead of its text)."""

    text: str
    finish_reason: str
    logprobs: dict[str, Any] | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ToolReplies:
    """A chat sample's text as its reply: tool calls where `tool_choice` required them, as vLLM's server
    makes them without a tool-call parser (chat_completion/serving.py): a named tool's arguments are
    the text itself (finish reason as generated); "required" text is the JSON list of {name,
    parameters} its schema asked for (finish reason `tool_calls`). Streamed, a named call's arguments
    follow the text delta by delta; a required reply's calls come whole when the sample ends."""

    def __init__(self, body: ChatCompletionRequest | CompletionRequest) -> None:
        self.mode = body.tool_mode() if isinstance(body, ChatCompletionRequest) else "none"
        choice = body.tool_choice if isinstance(body, ChatCompletionRequest) else None
        self.name = choice.function.name if isinstance(choice, NamedToolChoice) else ""

    @property
    def calls_tools(self) -> bool:
        return self.mode in ("named", "required")

    def whole(self, text: str, finish: str, logprobs: dict[str, Any] | None) -> Choice:
        if self.mode == "named":
            return Choice("", finish, logprobs, [self._call(0, self.name, text)])
        if self.mode == "required":
            calls = _required_calls(text)
            if calls is not None:
                return Choice("", "tool_calls" if finish == "stop" else finish, logprobs,
                              [self._call(i, name, arguments) for i, (name, arguments) in enumerate(calls)])
        return Choice(text, finish, logprobs)

    def stream(self) -> ToolStream:
        return ToolStream(self)

    @staticmethod
    def _call(_: int, name: str, arguments: str) -> dict[str, Any]:
        return {"id": new_tool_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def _required_calls(text: str) -> list[tuple[str, str]] | None:
    """The (name, arguments) of a "required" reply, or None when the text is not the list (cut short)."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(items, list) or not all(isinstance(i, dict) and isinstance(i.get("name"), str) for i in items):
        return None
    return [(i["name"], json.dumps(i.get("parameters", {}), ensure_ascii=False)) for i in items]


class ToolStream:
    """One streamed chat sample's deltas: content, or a tool call's (ToolReplies)."""

    def __init__(self, replies: ToolReplies) -> None:
        self.replies = replies
        self.text = ""
        self.call_id: str | None = None

    def delta(self, text: str) -> dict[str, Any] | None:
        """The delta for text generated now (None: nothing to send yet)."""
        if not text:
            return None
        if self.replies.mode == "named":
            if self.call_id is None:
                self.call_id = new_tool_call_id()
                return {"tool_calls": [{"index": 0, "id": self.call_id, "type": "function",
                                        "function": {"name": self.replies.name, "arguments": text}}]}
            return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}
        if self.replies.mode == "required":
            self.text += text
            return None
        return {"content": text}

    def step(self, text: str, finish: str | None) -> list[tuple[dict[str, Any], str | None]]:
        """The (delta, finish reason) chunks to send for what a sample generated now: none while a
        required reply is still being written."""
        delta = self.delta(text)
        if finish is None:
            return [] if delta is None else [(delta, None)]
        last, reason = self.end(finish)
        if delta is not None and last is not None:
            return [(delta, None), (last, reason)]
        return [(delta or last or {}, reason)]

    def end(self, finish: str) -> tuple[dict[str, Any] | None, str]:
        """The delta the sample's last chunk carries, and its finish reason."""
        if self.replies.mode != "required":
            return None, finish
        calls = _required_calls(self.text)
        if calls is None:
            return ({"content": self.text} if self.text else None), finish
        return ({"tool_calls": [{"index": i, "id": new_tool_call_id(), "type": "function",
                                 "function": {"name": name, "arguments": arguments}}
                                for i, (name, arguments) in enumerate(calls)]},
                "tool_calls" if finish == "stop" else finish)


@dataclass(frozen=True)
class ResponseShape:
    """The response bodies of one request, completion or chat, whole or as stream chunks.

    The worker and the router both answer in these shapes, and a worker's continuation of a request
    handed over to it streams them too; one definition keeps a client's view the same whichever of
    them it talks to. A chunk's `kvfleet` argument is its `token_meta` (router mode only); `index` is
    the sample's (`n`).
    """

    request_id: str
    created: int
    model: str
    chat: bool

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def chunk(self, text: str | None, finish: str | None, kvfleet: dict[str, Any] | None = None, *, index: int = 0,
              logprobs: dict[str, Any] | None = None, delta: dict[str, Any] | None = None) -> dict[str, Any]:
        """One stream chunk: `text` (None or "" for none) and the finish reason on the last; a chat chunk's
        `delta` may be given instead of its text (tool calls, ToolStream)."""
        choice: dict[str, Any]
        if self.chat:
            if delta is None:
                delta = {"content": text} if text else {}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        return self._chunk([choice], kvfleet)

    def first_chunk(self, kvfleet: dict[str, Any] | None = None, *, index: int = 0, text: str = "") -> dict[str, Any]:
        """The chunk a stream opens with (chat: the assistant's role, as OpenAI sends it; completions:
        the echoed prompt, if any)."""
        if not self.chat:
            return self.chunk(text, None, kvfleet, index=index)
        return self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
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

    def whole(self, choices: Sequence[Choice], counts: dict[str, int]) -> dict[str, Any]:
        """The whole response of a request that did not ask to be streamed: one choice per sample."""
        if self.chat:
            return {"id": self.request_id, "object": "chat.completion", "created": self.created, "model": self.model,
                    "choices": [{"index": i, "message": _message(c), "logprobs": c.logprobs,
                                 "finish_reason": c.finish_reason} for i, c in enumerate(choices)], "usage": counts}
        return {"id": self.request_id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": i, "text": c.text, "logprobs": c.logprobs, "finish_reason": c.finish_reason}
                            for i, c in enumerate(choices)], "usage": counts}


def _message(choice: Choice) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": choice.text}
    if choice.tool_calls:
        message["tool_calls"] = choice.tool_calls
    return message
