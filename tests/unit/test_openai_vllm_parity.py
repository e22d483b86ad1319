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


@pytest.mark.parametrize(("field", "value"), [("top_k", 5), ("min_p", 0.1), ("repetition_penalty", 1.2),
                                              ("logit_bias", {"5": 10}), ("bad_words", ["x"]), ("min_tokens", 3),
                                              ("use_beam_search", True), ("response_format", {"type": "json_object"}),
                                              ("kv_transfer_params", {"kvfleet": {"id": "x", "load": True}}),
                                              ("top_k", False), ("request_id", "mine")])
def test_a_parameter_not_served_yet_is_refused_by_name(field: str, value: Any) -> None:
    with pytest.raises(APIError) as refused:
        validated(CompletionRequest, {"model": "tiny", "prompt": "hi", field: value})
    assert (refused.value.status, refused.value.param, refused.value.code) == (400, field, "unsupported_parameter")
    assert refused.value.message.startswith(f"{field}: ") and "not served by kvfleet's engines yet" in refused.value.message


@pytest.mark.parametrize(("field", "value"), [("tools", [{"type": "function", "function": {"name": "f"}}]),
                                              ("top_logprobs", 2), ("tool_choice", "auto"),
                                              ("chat_template_kwargs", {"enable_thinking": True})])
def test_a_chat_parameter_not_served_yet_is_refused_by_name(field: str, value: Any) -> None:
    with pytest.raises(APIError) as refused:
        validated(ChatCompletionRequest, {"model": "tiny", "messages": MESSAGES, field: value})
    assert (refused.value.param, refused.value.code) == (field, "unsupported_parameter")


def test_unknown_fields_are_still_refused() -> None:
    with pytest.raises(APIError, match="unknown field 'frobnicate'"):
        validated(CompletionRequest, {"model": "tiny", "prompt": "hi", "frobnicate": 1})
    with pytest.raises(APIError, match="unknown field 'prompt_embeds'"):
        validated(ChatCompletionRequest, {"model": "tiny", "messages": MESSAGES, "prompt_embeds": None})


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
def test_every_parameter_not_served_yet_is_a_field_of_its_model(model: type[Any]) -> None:
    assert set(model.NOT_SERVED) <= set(model.model_fields)
