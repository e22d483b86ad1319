"""Clients built for vLLM's OpenAI server send vLLM's parameters (its own benchmark client sends
`repetition_penalty: 1.0`): kvfleet's request models have every field the pinned vLLM's have, so a vLLM
upgrade that adds one fails here rather than as 400s in production; a field kvfleet's engines do not
serve yet is accepted at a value that asks for nothing and refused, by name, at any other."""

from __future__ import annotations

from typing import Any

import pytest

from kvfleet.serving.openai_api import APIError, ChatCompletionRequest, CompletionRequest, validated

MESSAGES = [{"role": "user", "content": "hi"}]


def vllm_fields(endpoint: str) -> set[str]:
    pytest.importorskip("vllm", reason="vllm is not installed (make vllm)")
    if endpoint == "completions":
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest as VLLMCompletion

        return set(VLLMCompletion.model_fields)
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as VLLMChat

    return set(VLLMChat.model_fields)


@pytest.mark.parametrize(("endpoint", "ours"), [("completions", CompletionRequest), ("chat", ChatCompletionRequest)])
def test_the_request_models_have_exactly_vllms_fields(endpoint: str, ours: type[Any]) -> None:
    theirs = vllm_fields(endpoint)
    assert set(ours.model_fields) - theirs == set(), "fields vLLM does not have"
    assert theirs - set(ours.model_fields) == set(), "vLLM's fields kvfleet would refuse as unknown"


def test_vllm_bench_serves_payloads_are_accepted() -> None:
    # vllm/benchmarks/lib/endpoint_request_func.py's completions and chat payloads, streaming.
    completion = validated(CompletionRequest, {
        "model": "tiny", "prompt": "hello", "repetition_penalty": 1.0, "max_tokens": 8, "logprobs": None,
        "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0.0,
        "top_k": -1, "min_p": 0.0, "top_p": 1.0})
    assert completion.max_tokens == 8 and completion.ignore_eos and completion.include_usage_in_stream()
    chat = validated(ChatCompletionRequest, {
        "model": "tiny", "messages": MESSAGES, "max_completion_tokens": 8, "stream": True,
        "stream_options": {"include_usage": True}, "temperature": None, "top_p": None, "logprobs": None})
    assert chat.output_limit() == 8 and chat.temperature == 1.0 and chat.top_p == 1.0 and chat.logprobs is False


@pytest.mark.parametrize(("field", "value"), [("bad_words", ["x"]), ("use_beam_search", True),
                                              ("kv_transfer_params", {"kvfleet": {"id": "x", "load": True}}),
                                              ("request_id", "mine"), ("return_tokens_as_token_ids", True)])
def test_a_parameter_not_served_yet_is_refused_by_name(field: str, value: Any) -> None:
    with pytest.raises(APIError) as refused:
        validated(CompletionRequest, {"model": "tiny", "prompt": "hi", field: value})
    assert (refused.value.status, refused.value.param, refused.value.code) == (400, field, "unsupported_parameter")
    assert refused.value.message.startswith(f"{field}: ") and "not served by kvfleet's engines yet" in refused.value.message


@pytest.mark.parametrize(("field", "value"), [("echo", True), ("reasoning_effort", "high"),
                                              ("chat_template", "{{ messages }}")])
def test_a_chat_parameter_not_served_yet_is_refused_by_name(field: str, value: Any) -> None:
    with pytest.raises(APIError) as refused:
        validated(ChatCompletionRequest, {"model": "tiny", "messages": MESSAGES, field: value})
    assert (refused.value.param, refused.value.code) == (field, "unsupported_parameter")


def test_the_served_sampling_parameters_are_read_as_vllm_reads_them() -> None:
    body = validated(CompletionRequest, {
        "model": "tiny", "prompt": "hi", "n": 3, "top_k": -1, "min_p": 0.1, "repetition_penalty": 1.2,
        "presence_penalty": -0.5, "frequency_penalty": 2, "logit_bias": {"7": 300, "2": -1.5}, "min_tokens": 4,
        "logprobs": 5, "echo": False, "seed": 11, "include_stop_str_in_output": True, "max_tokens": 9})
    assert (body.n, body.top_k, body.min_p, body.repetition_penalty, body.min_tokens) == (3, -1, 0.1, 1.2, 4)
    # Biases are clamped to +-100 as vLLM clamps them, and sorted by token id for the engines.
    assert body.logit_biases() == ((2, -1.5), (7, 100.0))
    assert body.top_logprobs_wanted() == 5 and [body.sample_seed(i) for i in range(3)] == [11, 12, 13]
    chat = validated(ChatCompletionRequest, {"model": "tiny", "messages": MESSAGES, "logprobs": True, "top_logprobs": 3})
    assert chat.top_logprobs_wanted() == 3
    assert validated(ChatCompletionRequest, {"model": "tiny", "messages": MESSAGES}).top_logprobs_wanted() is None


@pytest.mark.parametrize(("raw", "kind", "spec"), [
    ({"response_format": {"type": "json_object"}}, "json_object", ""),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "object"}}}},
     "json_schema", '{"type": "object"}'),
    ({"response_format": {"type": "text"}}, None, None),
    ({"structured_outputs": {"json": {"type": "integer"}}}, "json_schema", '{"type": "integer"}'),
    ({"structured_outputs": {"json": '{"type": "integer"}'}}, "json_schema", '{"type": "integer"}'),
    ({"structured_outputs": {"regex": "[0-9]+"}}, "regex", "[0-9]+"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice", '["yes", "no"]'),
    ({"structured_outputs": {"grammar": "start: \"a\""}}, "grammar", 'start: "a"'),
    ({"structured_outputs": {"json_object": True}}, "json_object", ""),
])
def test_structured_outputs_become_one_constraint(raw: dict[str, Any], kind: str | None, spec: str | None) -> None:
    body = validated(CompletionRequest, {"model": "tiny", "prompt": "hi", **raw})
    assert body.structured() == (None if kind is None else (kind, spec))


@pytest.mark.parametrize(("raw", "param"), [
    ({"n": 0}, "n"), ({"n": 17}, "n"), ({"top_k": -2}, "top_k"), ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"logit_bias": {"a": 1}}, "logit_bias"), ({"min_tokens": 20}, "min_tokens"), ({"logprobs": 21}, "logprobs"),
    ({"echo": True, "logprobs": 1}, "echo"), ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "structural_tag"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
])
def test_bad_values_are_refused_with_the_field_named(raw: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as refused:
        validated(CompletionRequest, {"model": "tiny", "prompt": "hi", **raw})
    assert (refused.value.status, refused.value.param) == (400, param)


def test_top_logprobs_needs_logprobs_in_chat() -> None:
    with pytest.raises(APIError) as refused:
        validated(ChatCompletionRequest, {"model": "tiny", "messages": MESSAGES, "top_logprobs": 2})
    assert refused.value.param == "top_logprobs" and "logprobs must be set to true" in refused.value.message


def test_unknown_fields_are_still_refused() -> None:
    with pytest.raises(APIError, match="unknown field 'frobnicate'"):
        validated(CompletionRequest, {"model": "tiny", "prompt": "hi", "frobnicate": 1})
    with pytest.raises(APIError, match="unknown field 'prompt_embeds'"):
        validated(ChatCompletionRequest, {"model": "tiny", "messages": MESSAGES, "prompt_embeds": None})


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
def test_every_parameter_not_served_yet_is_a_field_of_its_model(model: type[Any]) -> None:
    assert set(model.NOT_SERVED) <= set(model.model_fields)


def test_tools_are_read_as_vllm_reads_them() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    assert validated(ChatCompletionRequest, {"model": "tiny", "messages": MESSAGES}).tool_mode() == "none"
    # Tools without a tool_choice: "auto" (vLLM's check_tool_usage), the model's text as content.
    auto = validated(ChatCompletionRequest, {"model": "tiny", "messages": MESSAGES, "tools": [tool]})
    assert auto.tool_mode() == "auto" and auto.structured() is None and auto.template_tools() == [tool]
    named = validated(ChatCompletionRequest, {"model": "tiny", "messages": MESSAGES, "tools": [tool],
                                              "tool_choice": {"type": "function", "function": {"name": "f"}}})
    assert named.structured() == ("json_schema", '{"type": "object"}')
    required = validated(ChatCompletionRequest, {"model": "tiny", "messages": MESSAGES, "tools": [tool],
                                                 "tool_choice": "required", "parallel_tool_calls": False})
    kind, spec = required.structured() or ("", "")
    assert kind == "json_schema" and '"maxItems": 1' in spec and '"enum": ["f"]' in spec
