"""Prompt token ids on the router's side: the model's own tokenizer, without a model runtime.

MemServe's global scheduler "runs a tokenizer to turn prompt strings into token IDs" (§6) before it
matches them against its prompt tree; kvfleet's router does the same for text and chat prompts. The
model's files live with the workers, so a worker hands its tokenizer over (`GET /kvfleet/tokenizer`:
the fast tokenizer's JSON, the chat template and the special tokens it renders with) and the router
rebuilds it here with the `tokenizers` library and a sandboxed Jinja environment, as transformers
renders chat templates (trim_blocks, lstrip_blocks, `raise_exception`), so that the ids equal the
worker's (tests/router/test_locality_tokens.py checks them against the worker's Tokenizer).
A prompt the router tokenizes differently only matches a shorter prefix: the tree holds the ids the
workers themselves returned.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as FastTokenizer

TOKENIZER_PATH = "/kvfleet/tokenizer"


def _raise(message: str) -> None:
    raise TemplateError(message)


class PromptTokenizer:
    """Text and chat prompts to the model's token ids, from a worker's tokenizer payload."""

    def __init__(self, tokenizer_json: str, chat_template: str | None, special_tokens: Mapping[str, str],
                 block_size_tokens: int) -> None:
        self._tok = FastTokenizer.from_str(tokenizer_json)
        self._special = dict(special_tokens)
        self.block_size_tokens = block_size_tokens
        self._template = None
        if chat_template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
            env.globals["raise_exception"] = _raise
            self._template = env.from_string(chat_template)

    @staticmethod
    def from_payload(payload: Mapping[str, Any]) -> PromptTokenizer:
        """From `GET /kvfleet/tokenizer`'s JSON (kvfleet.worker.text.Tokenizer.payload); KeyError or
        ValueError when it is not one."""
        special = payload.get("specialTokens") or {}
        return PromptTokenizer(str(payload["tokenizer"]), payload.get("chatTemplate") or None,
                               {str(k): str(v) for k, v in special.items() if isinstance(v, str)},
                               int(payload["blockSizeTokens"]))

    def encode(self, text: str) -> list[int]:
        """A completion prompt's ids, with the special tokens the model's post-processor adds (BOS)."""
        return list(self._tok.encode(text, add_special_tokens=True).ids)

    def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int] | None:
        """A chat's ids as the worker renders it for the reply; None without a template (or when it
        refuses the messages: the worker then answers the 400)."""
        if self._template is None:
            return None
        try:
            rendered = self._template.render(messages=list(messages), add_generation_prompt=True, **self._special)
        except TemplateError:
            return None
        return list(self._tok.encode(rendered, add_special_tokens=False).ids)
