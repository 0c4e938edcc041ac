"""The hash chain over token pages: key(page i) = H(key(page i-1), page tokens, model).

Keys are 16-byte BLAKE2b digests keyed by the model fingerprint, so two models never
share a key and a key names its whole prefix (the parent is part of the hash).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from ._errors import RowSpanError

__all__ = ["KEY_BYTES", "ROOT_KEY", "KeyChain", "Tokens", "fingerprint_digest", "page_keys"]

KEY_BYTES = 16
ROOT_KEY = bytes(KEY_BYTES)  # parent of the first page of every prefix

Tokens = Sequence[int] | npt.NDArray[np.integer]


def fingerprint_digest(fingerprint: str | bytes) -> bytes:
    """A model fingerprint (any string or bytes) as the 16 bytes headers carry."""
    raw = fingerprint.encode() if isinstance(fingerprint, str) else bytes(fingerprint)
    if len(raw) == KEY_BYTES:
        return raw
    return hashlib.blake2b(raw, digest_size=KEY_BYTES).digest()


def page_keys(
    tokens: Tokens, page_tokens: int, fingerprint: bytes, limit: int | None = None,
    parent: bytes = ROOT_KEY,
) -> list[bytes]:
    """Keys of the full pages of ``tokens`` (at most ``limit``), in order.

    Raises RowSpanError for a token list shorter than one page: such a list has no key.
    """
    arr = np.ascontiguousarray(tokens, dtype=np.int64)
    if arr.ndim != 1:
        raise RowSpanError(f"tokens must be 1-D, got shape {arr.shape}")
    n_pages = len(arr) // page_tokens
    if n_pages == 0:
        raise RowSpanError(
            f"{len(arr)} tokens is shorter than one page of {page_tokens}: nothing to cache"
        )
    if limit is not None:
        n_pages = min(n_pages, limit)
    raw = arr[: n_pages * page_tokens].tobytes()
    step = page_tokens * 8
    out: list[bytes] = []
    for i in range(n_pages):
        h = hashlib.blake2b(parent, digest_size=KEY_BYTES, key=fingerprint)
        h.update(raw[i * step : (i + 1) * step])
        parent = h.digest()
        out.append(parent)
    return out


class KeyChain:
    """The page keys of a prefix, computed once and extended page by page.

    A caller that grows a prefix (a decoding request, a long conversation) keeps its
    chain and extends it, instead of rehashing every page at each store or lookup.
    DiskStore methods accept a KeyChain wherever they accept tokens.
    """

    __slots__ = ("fingerprint", "keys", "page_tokens")

    def __init__(self, keys: list[bytes], page_tokens: int, fingerprint: bytes) -> None:
        self.keys = keys
        self.page_tokens = page_tokens
        self.fingerprint = fingerprint

    @classmethod
    def of(cls, tokens: Tokens, page_tokens: int, fingerprint: str | bytes) -> KeyChain:
        fp = fingerprint_digest(fingerprint)
        return cls(page_keys(tokens, page_tokens, fp), page_tokens, fp)

    def extend(self, tokens: Tokens) -> KeyChain:
        """A new chain with the full pages of ``tokens`` appended (a partial page is not)."""
        parent = self.keys[-1] if self.keys else ROOT_KEY
        more = page_keys(tokens, self.page_tokens, self.fingerprint, parent=parent)
        return KeyChain(self.keys + more, self.page_tokens, self.fingerprint)

    def __len__(self) -> int:
        return len(self.keys)
