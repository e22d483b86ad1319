"""Text on the worker's side of the engine contract: prompts to token ids, token ids back to text.

Engines see only token ids (engines/base.py), so tokenisation, chat templates, incremental
detokenisation live here, once for both engines (stop strings in kvfleet.serving.stops, which the
router shares). Detokenising a stream token by token is subtle: byte-level BPE splits multi-byte
characters over tokens, and a tokenizer's spacing rules can change how earlier tokens render.
`Detokenizer` decodes a sliding window of recent tokens and emits only text that can no longer
change, the method vLLM and TGI use.
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

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a completion prompt, with the BOS token the model expects (unless told not to)."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def encode_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: Sequence[dict[Any, Any]] | None = None, *, continue_final_message: bool = False,
                    documents: Sequence[dict[str, str]] | None = None, extra: dict[str, Any] | None = None
                    ) -> list[int]:
        """Token ids of a chat (and the tools it may call, the documents it may read, the template's own
        variables `extra`) rendered by the model's own chat template, ready for the reply (unless
        `add_generation_prompt` is False, or the last message is to be continued)."""
        if not getattr(self._tok, "chat_template", None):
            raise ValueError("this model has no chat template; use /v1/completions")
        rendered: Any = self._tok.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                                      tools=list(tools) if tools is not None else None,
                                                      documents=list(documents) if documents is not None else None,
                                                      continue_final_message=continue_final_message,
                                                      tokenize=False, **(extra or {}))
        return list(self._tok.encode(str(rendered), add_special_tokens=False))

    def token_strs(self, token_ids: Sequence[int]) -> list[str]:
        """Each token's own string, as /tokenize's `token_strs` gives them (vLLM: the tokenizer's tokens)."""
        return [str(s) for s in self._tok.convert_ids_to_tokens(list(token_ids))]

    def token_texts(self, token_ids: Sequence[int], context: Sequence[int] = ()) -> list[str]:
        """Each token's text as vLLM shows tokens in log-probabilities: decoded alone (its
        convert_ids_list_to_tokens, for a tokenizer without a leading-space marker), except a token
        that is part of a multi-byte character, which shows the text it completes after the output
        tokens of `context` (up to 4, oldest first), or "" when it completes none (vLLM's
        _correct_decoded_token, v1/engine/logprobs.py)."""
        texts = []
        for token in token_ids:
            text = str(self._tok.decode([token]))
            if text.endswith(_REPLACEMENT):
                text = self._completed_text(token, list(context[-4:]))
            texts.append(text)
        return texts

    def _completed_text(self, token: int, context: list[int]) -> str:
        for num_context in range(1, len(context) + 1):
            before = context[-num_context:]
            whole = str(self._tok.decode([*before, token]))
            if whole.endswith(_REPLACEMENT):
                continue
            # The context tokens that are bytes of the same character showed "": their text is this one's.
            clean_end = len(before)
            while clean_end > 0 and str(self._tok.decode([before[clean_end - 1]])).endswith(_REPLACEMENT):
                clean_end -= 1
            prefix = str(self._tok.decode(before[:clean_end])) if clean_end else ""
            if whole.startswith(prefix):
                return whole[len(prefix):]
            common = next((i for i, (a, b) in enumerate(zip(prefix, whole)) if a != b), min(len(prefix), len(whole)))
            return whole[common:]
        return ""

    def payload(self) -> dict[str, Any]:
        """What a router needs to tokenize prompts as this worker does (kvfleet.serving.tokens): the
        fast tokenizer's JSON, the chat template and the special tokens it renders with."""
        special = {k: v for k, v in self._tok.special_tokens_map.items() if isinstance(v, str)}
        template = getattr(self._tok, "chat_template", None)
        return {"tokenizer": self._tok.backend_tokenizer.to_str(),
                "chatTemplate": template if isinstance(template, str) else None, "specialTokens": special}

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=True))

    def completion_text(self, token_ids: Sequence[int]) -> str:
        """The text a completion of these output tokens shows: never the bytes of a character it did
        not complete at its end (Detokenizer.flush, as vLLM's detokenizer)."""
        return self.decode(token_ids).rstrip(_REPLACEMENT)

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
        """Whatever is still held back when the request ends, but not the bytes of a character it never
        completed (vLLM's incremental detokenizer never shows them either)."""
        before = self.tokenizer.decode(self.tokens[self.prefix:self.read])
        after = self.tokenizer.decode(self.tokens[self.prefix:])
        self.read = len(self.tokens)
        return after[len(before):].rstrip(_REPLACEMENT) if after.startswith(before) else ""


__all__ = ["Detokenizer", "Tokenizer"]
