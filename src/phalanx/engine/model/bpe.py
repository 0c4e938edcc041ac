"""A byte-level BPE tokenizer trained deterministically, written as ``tokenizer.json``.

The embedded default model needs a tokenizer whose bytes are identical on every machine
and with every ``tokenizers`` version, so neither the training nor the JSON comes from
the library: merges are learnt here (most frequent pair first, ties broken by the pair
itself) over an embedded text, and the file is written with ``json.dumps`` in a fixed
form that ``tokenizers.Tokenizer.from_file`` reads (GPT-2's byte-level scheme).
"""

from __future__ import annotations

import itertools
import json
import re
from collections import Counter

__all__ = ["bytes_to_unicode", "tokenizer_json", "train_merges"]

# GPT-2's pre-tokenizer pattern restricted to ASCII classes (Python's re has no \p{L});
# the library splits with the full pattern at run time, and the merges stay valid.
_SPLIT = re.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+""")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of the 256 bytes to printable characters."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1)))
    chars = list(keep)
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(keep, chars, strict=True)}


def train_merges(text: str, merges: int) -> list[tuple[str, str]]:
    """Up to ``merges`` merges learnt on ``text`` (fewer if the text runs out of pairs)."""
    table = bytes_to_unicode()
    words = Counter(_SPLIT.findall(text))
    seqs = [([table[b] for b in w.encode()], n) for w, n in sorted(words.items())]
    out: list[tuple[str, str]] = []
    while len(out) < merges:
        pairs: Counter[tuple[str, str]] = Counter()
        for sym, n in seqs:
            for a, b in itertools.pairwise(sym):
                pairs[(a, b)] += n
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        out.append(best)
        joined = best[0] + best[1]
        for sym, _ in seqs:
            i = 0
            while i < len(sym) - 1:
                if sym[i] == best[0] and sym[i + 1] == best[1]:
                    sym[i:i + 2] = [joined]
                i += 1
    return out


def tokenizer_json(merges: list[tuple[str, str]], specials: list[str]) -> str:
    """``tokenizer.json`` text: 256 byte tokens, then the merges' tokens, then ``specials``."""
    vocab: dict[str, int] = {}
    for ch in bytes_to_unicode().values():
        vocab[ch] = len(vocab)
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    added = []
    for s in specials:
        added.append({"id": len(vocab), "content": s, "single_word": False, "lstrip": False,
                      "rstrip": False, "normalized": False, "special": True})
        vocab[s] = len(vocab)
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                  "use_regex": True}
    doc = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": None,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": [f"{a} {b}" for a, b in merges]},
    }
    return json.dumps(doc, ensure_ascii=False, indent=1) + "\n"
