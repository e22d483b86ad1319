"""Text on the worker's side of the engine contract: prompts to token ids, token ids back to text.

Engines see only token ids (engines/base.py), so tokenisation, chat templates, incremental
detokenisation and stop strings live here, once for both engines. Detokenising a stream token by
token is subtle: byte-level BPE splits multi-byte characters over tokens, and a tokenizer's spacing
rules can change how earlier tokens render. `Detokenizer` decodes a sliding window of recent tokens
and emits only text that can no longer change, the method vLLM and TGI use.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

# How many already-emitted tokens the detokenizer re-decodes for context (spacing, merges).
_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class Tokenizer:
    """The model's tokenizer, loaded from the model directory only (never the hub)."""

    def __init__(self, model_path: Path) -> None:
        self._tok: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)

    @property
    def eos_token_id(self) -> int | None:
        value = self._tok.eos_token_id
        return int(value) if value is not None else None

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    def encode(self, text: str) -> list[int]:
        """Token ids of a completion prompt, with the BOS token the model expects."""
        return list(self._tok.encode(text, add_special_tokens=True))

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Token ids of a chat rendered by the model's own chat template, ready for the reply."""
        if not getattr(self._tok, "chat_template", None):
            raise ValueError("this model has no chat template; use /v1/completions")
        rendered: Any = self._tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
        return list(self._tok.encode(str(rendered), add_special_tokens=False))

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=True))

    def detokenizer(self, prompt_token_ids: Sequence[int]) -> Detokenizer:
        return Detokenizer(self, list(prompt_token_ids[-_CONTEXT_TOKENS:]))


@dataclass
class Detokenizer:
    """Turns a growing list of token ids into text deltas that never need taking back."""

    tokenizer: Tokenizer
    tokens: list[int]
    # tokens[prefix:read] were already emitted; decoding from prefix gives them their context.
    prefix: int = 0
    read: int = field(init=False)

    def __post_init__(self) -> None:
        self.read = len(self.tokens)

    def add(self, new_token_ids: Sequence[int]) -> str:
        self.tokens.extend(new_token_ids)
        before = self.tokenizer.decode(self.tokens[self.prefix:self.read])
        after = self.tokenizer.decode(self.tokens[self.prefix:])
        # A trailing replacement character is half of a multi-byte character: wait for the rest.
        if len(after) > len(before) and not after.endswith(_REPLACEMENT) and after.startswith(before):
            delta = after[len(before):]
            self.prefix = max(0, len(self.tokens) - _CONTEXT_TOKENS)
            self.read = len(self.tokens)
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is still held back when the request ends (a dangling partial character included)."""
        before = self.tokenizer.decode(self.tokens[self.prefix:self.read])
        after = self.tokenizer.decode(self.tokens[self.prefix:])
        self.read = len(self.tokens)
        return after[len(before):] if after.startswith(before) else ""


@dataclass
class StopStrings:
    """Holds back text that might be the start of a stop string, and cuts the output at one.

    OpenAI semantics: the stop string itself is not returned, and generation ends at its first
    occurrence, even across token boundaries.
    """

    stops: tuple[str, ...]
    pending: str = ""
    stopped: bool = False

    def feed(self, text: str) -> str:
        """Text safe to send now; sets `stopped` when a stop string appeared."""
        if not self.stops:
            return text
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self.pending = self.pending[: min(hits)], ""
            return out
        keep = max(len(s) for s in self.stops) - 1
        cut = max(0, len(self.pending) - keep)
        # Only hold back a tail that really is a prefix of some stop string.
        while cut < len(self.pending) and not any(s.startswith(self.pending[cut:]) for s in self.stops):
            cut += 1
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def finish(self) -> str:
        out, self.pending = self.pending, ""
        return out
