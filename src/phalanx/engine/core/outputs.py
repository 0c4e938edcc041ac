"""What a request returns, in vLLM's shape, and the incremental detokenizer behind its text.

``RequestOutput.outputs[0]`` is a :class:`CompletionOutput` (``token_ids``, ``text``,
``finish_reason``, ``logprobs``...). ``num_cached_tokens`` is vLLM's count of prompt
tokens whose KV was not computed; phalanx splits it by tier
(``cached_tokens_memory``, ``cached_tokens_disk``). Streamed outputs are cumulative, as
vLLM's default, and also carry what this step added (``delta_text``,
``delta_token_ids``) so a server need not diff.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

__all__ = ["CompletionOutput", "IncrementalDetokenizer", "Logprob", "RequestOutput"]

# Prompt tokens the detokenizer decodes before the first output token, as vLLM does: some
# decoders (SentencePiece's leading space) render a token differently at the start.
_CONTEXT_TOKENS = 5


@dataclass(frozen=True)
class Logprob:
    """One candidate token's logprob, its rank among the candidates (1 = best)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None     # "stop", "length", "abort", "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    cached_tokens_memory: int = 0
    cached_tokens_disk: int = 0
    error: BaseException | None = None   # set when finish_reason is "error"


class IncrementalDetokenizer:
    """Text of a growing token list, decoding only a short window at each token.

    ``decode(ids)`` must render a token list (special tokens skipped as configured). A
    token that ends inside a multi-byte character renders U+FFFD; its text is held back
    until the character completes.
    """

    __slots__ = ("_decode", "_prefix", "_read", "_tokens", "text")

    def __init__(self, decode: Callable[[list[int]], str], prompt: Sequence[int] = ()) -> None:
        self._decode = decode
        self._tokens = list(prompt[-_CONTEXT_TOKENS:]) if prompt else []
        self._prefix = 0
        self._read = len(self._tokens)
        self.text = ""

    def push(self, token: int) -> str:
        """Add ``token``; returns the text it completed (may be empty)."""
        self._tokens.append(token)
        before = self._decode(self._tokens[self._prefix : self._read])
        after = self._decode(self._tokens[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            delta = after[len(before) :]
            self._prefix = self._read
            self._read = len(self._tokens)
            self.text += delta
            return delta
        return ""
