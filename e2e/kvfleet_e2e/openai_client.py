"""What users of vLLM send every day, through the official `openai` client: n, logprobs, top_logprobs,
echo, seed, penalties, response_format and tools, and bad values answered with a 400 naming the field.

One set of exercises for any kvfleet endpoint (a router over in-process workers in
tests/worker/test_openai_client.py, a pool's router on the local control plane in
e2e/test_worker.py), each taking the client pointed at it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai

PROMPT = "Once upon a time"
# (keyword arguments of chat.completions.create, the field the 400 names)
BAD_VALUES: list[tuple[dict[str, Any], str]] = [
    ({"n": 0}, "n"), ({"top_logprobs": 2}, "top_logprobs"), ({"presence_penalty": 3}, "presence_penalty"),
    ({"tool_choice": "required"}, "tool_choice")]


def no_whitespace(model_dir: Path) -> dict[str, int]:
    """A logit_bias that keeps the random-weight tiny model from writing JSON's optional whitespace forever
    (vLLM's structured outputs allow any whitespace, and so does kvfleet)."""
    from kvfleet.worker.text import Tokenizer

    tokenizer = Tokenizer(model_dir)
    texts = tokenizer.token_texts(list(range(tokenizer.vocab_size)))
    return {str(i): -100 for i, text in enumerate(texts) if text and not text.strip()}


def completions(client: openai.OpenAI) -> None:
    sampled = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, n=2, seed=3, temperature=1.0,
                                        extra_body={"ignore_eos": True})
    assert [c.index for c in sampled.choices] == [0, 1] and sampled.usage is not None
    assert sampled.usage.completion_tokens == 16
    again = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, seed=4, temperature=1.0,
                                      extra_body={"ignore_eos": True})
    assert again.choices[0].text == sampled.choices[1].text, "sample 1 of seed 3 is seed 4's"
    scored = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, logprobs=2, temperature=0,
                                       presence_penalty=0.5, frequency_penalty=0.5,
                                       extra_body={"ignore_eos": True, "repetition_penalty": 1.1, "top_k": 5,
                                                   "min_p": 0.05})
    logprobs = scored.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None and logprobs.token_logprobs is not None
    # A token that is a byte of a character shows the text it completes, or "" (as vLLM shows it).
    assert len(logprobs.tokens) == 6 and "".join(logprobs.tokens) == scored.choices[0].text.replace("\ufffd", "")
    assert all(lp is not None and lp <= 0 for lp in logprobs.token_logprobs)
    echoed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, echo=True, temperature=0,
                                       extra_body={"ignore_eos": True})
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text


def chat(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "Say something"}]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, logprobs=True,
                                           top_logprobs=2, seed=1, temperature=0.7, extra_body={"ignore_eos": True})
    content = reply.choices[0].logprobs
    assert content is not None and content.content is not None and len(content.content) == 5
    assert all(len(t.top_logprobs) == 2 for t in content.content)
    assert "".join(t.token for t in content.content) == (reply.choices[0].message.content or "").replace("\ufffd", "")
    again = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, seed=1, temperature=0.7,
                                           extra_body={"ignore_eos": True})
    assert again.choices[0].message.content == reply.choices[0].message.content
    picked = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=20,
        response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": {"enum": ["left", "right"]}}})
    assert json.loads(picked.choices[0].message.content or "") in ("left", "right")


def tools(client: openai.OpenAI, model_dir: Path) -> None:
    weather: Any = [{"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
        "additionalProperties": False}}}]
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=weather, max_tokens=40,
        tool_choice={"type": "function", "function": {"name": "weather"}}, logit_bias=no_whitespace(model_dir))
    calls = reply.choices[0].message.tool_calls
    assert calls is not None and len(calls) == 1
    call: Any = calls[0]
    assert call.function.name == "weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    follow_up = client.chat.completions.create(
        model="tiny", tools=weather, max_tokens=4, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": "Weather?"},
                  {"role": "assistant", "tool_calls": [{"id": call.id, "type": "function", "function": {
                      "name": "weather", "arguments": call.function.arguments}}]},
                  {"role": "tool", "tool_call_id": call.id, "content": "sunny"}])
    assert follow_up.choices[0].message.content


def bad_values(client: openai.OpenAI) -> None:
    for kwargs, param in BAD_VALUES:
        try:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                           **kwargs)
        except openai.BadRequestError as refused:
            body: Any = refused.body
            assert body["param"] == param, (kwargs, body)
        else:
            raise AssertionError(f"{kwargs} was not refused")


def everything(client: openai.OpenAI, model_dir: Path) -> None:
    completions(client)
    chat(client)
    tools(client, model_dir)
    bad_values(client)
