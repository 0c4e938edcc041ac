"""Response bodies in OpenAI's shapes: completions, chat, their stream chunks, usage.

Plain dicts built in one place, so every route and the stream agree on field names;
``usage.prompt_tokens_details.cached_tokens`` is always present (0 when nothing was
cached), and phalanx's own ``cached_tokens_memory`` / ``cached_tokens_disk`` split it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .engine_client import Delta

__all__ = ["ChoiceState", "chat_chunk", "chat_response", "completion_chunk",
           "completion_response", "usage"]

JSON = dict[str, Any]


@dataclass
class ChoiceState:
    """What one choice accumulated from its deltas."""

    index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[tuple[int, float, Sequence[tuple[int, float]]]] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_memory: int = 0
    cached_disk: int = 0

    def add(self, d: Delta) -> None:
        self.text.append(d.text)
        self.token_ids.extend(d.token_ids)
        self.logprobs.extend(d.logprobs)
        if d.finish_reason is not None:
            self.finish_reason = d.finish_reason
        if d.prompt_tokens:
            self.prompt_tokens = d.prompt_tokens
            self.cached_memory, self.cached_disk = d.cached_memory, d.cached_disk


def usage(choices: Sequence[ChoiceState], n: int = 1) -> JSON:
    """Usage of a request whose prompts have ``n`` choices each (in runs of ``n``).

    A prompt counts once, as OpenAI counts it, with what its first choice found cached;
    the others follow it and hit its pages (issue 46), which phalanx's own
    ``prompt_tokens_computed`` shows: every choice's prompt tokens that were computed,
    not served from a cache tier (one prefill: the first's, plus each later choice's
    last partial page)."""
    firsts = choices[::n]
    prompt = sum(c.prompt_tokens for c in firsts)
    completion = sum(len(c.token_ids) for c in choices)
    memory = sum(c.cached_memory for c in firsts)
    disk = sum(c.cached_disk for c in firsts)
    computed = sum(c.prompt_tokens - c.cached_memory - c.cached_disk for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": memory + disk},
        "cached_tokens_memory": memory,
        "cached_tokens_disk": disk,
        "prompt_tokens_computed": computed,
    }


TokenText = Callable[[int], str]


def completion_logprobs(entries: Sequence[tuple[int, float, Sequence[tuple[int, float]]]],
                        token_text: TokenText, offset: int = 0) -> JSON:
    """The legacy completions logprobs object (tokens, token_logprobs, top_logprobs)."""
    tokens, lps, tops, offsets = [], [], [], []
    pos = offset
    for tok, lp, top in entries:
        text = token_text(tok)
        tokens.append(text)
        lps.append(lp)
        tops.append({token_text(t): p for t, p in top})
        offsets.append(pos)
        pos += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(entries: Sequence[tuple[int, float, Sequence[tuple[int, float]]]],
                  token_text: TokenText) -> JSON:
    def item(tok: int, lp: float) -> JSON:
        text = token_text(tok)
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}
    return {"content": [
        {**item(tok, lp), "top_logprobs": [item(t, p) for t, p in top]}
        for tok, lp, top in entries
    ]}


def completion_response(rid: str, model: str, choices: Sequence[ChoiceState],
                        token_text: TokenText, want_logprobs: bool, n: int = 1) -> JSON:
    return {
        "id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [{
            "index": c.index, "text": "".join(c.text),
            "logprobs": completion_logprobs(c.logprobs, token_text) if want_logprobs else None,
            "finish_reason": c.finish_reason,
        } for c in choices],
        "usage": usage(choices, n),
    }


def completion_chunk(rid: str, model: str, created: int, index: int, d: Delta,
                     token_text: TokenText, want_logprobs: bool) -> JSON:
    return {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [{
            "index": index, "text": d.text,
            "logprobs": completion_logprobs(d.logprobs, token_text) if want_logprobs else None,
            "finish_reason": d.finish_reason,
        }],
    }


def chat_response(rid: str, model: str, choices: Sequence[ChoiceState],
                  token_text: TokenText, want_logprobs: bool, n: int = 1) -> JSON:
    return {
        "id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{
            "index": c.index,
            "message": {"role": "assistant", "content": "".join(c.text)},
            "logprobs": chat_logprobs(c.logprobs, token_text) if want_logprobs else None,
            "finish_reason": c.finish_reason,
        } for c in choices],
        "usage": usage(choices, n),
    }


def chat_chunk(rid: str, model: str, created: int, index: int, delta: JSON,
               finish_reason: str | None, logprobs: JSON | None) -> JSON:
    return {
        "id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                     "finish_reason": finish_reason}],
    }


def usage_chunk(rid: str, model: str, created: int, obj: str,
                choices: Sequence[ChoiceState], n: int = 1) -> JSON:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(choices, n)}
