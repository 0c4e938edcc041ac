"""A GGUF file's tokenizer, built from its metadata into a ``tokenizers`` tokenizer.

GGUF keeps the vocabulary, not ``tokenizer.json``: ``tokenizer.ggml.model`` says which
scheme (``gpt2``: byte-level BPE with ``merges``; ``llama``: SentencePiece BPE with a
score per piece and byte fallback), ``tokenizer.ggml.pre`` names the pre-tokenizer
(llama.cpp's ``llama-vocab.cpp`` maps each name to its split regexes; the table below
holds the same for the names of the architectures this engine serves) and
``token_type`` marks the control tokens (special: matched in text, skipped on decode).
A pre-tokenizer name not in the table is refused: a guessed split gives other tokens
than the model was trained on, silently.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from .._errors import CheckpointError

if TYPE_CHECKING:
    from tokenizers import Tokenizer as HFTokenizer

    from .gguf_file import GGUFFile

__all__ = ["TokenizerParts", "gguf_tokenizer"]

_CONTROL, _USER_DEFINED = 3, 4
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
           r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
          r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# GPT-4o's split (o200k; Phi-4-mini's tokenizer.json), as llama.cpp's GPT4O pre type
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
          r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}|"
          r" ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> (the split before byte-level BPE, NFC first, ignore_merges)
_PRE: dict[str, tuple[str, bool, bool]] = {
    "default": ("gpt2", False, False), "gpt2": ("gpt2", False, False),
    "smollm": ("digits", False, False), "starcoder": ("digits", False, False),
    "refact": ("digits", False, False),
    "llama3": ("llama3", False, True), "llama-bpe": ("llama3", False, True),
    "llama-v3": ("llama3", False, True), "smaug-bpe": ("llama3", False, True),
    "qwen2": ("qwen2", True, False), "deepseek-r1-qwen": ("qwen2", True, False),
    "gpt-4o": ("gpt4o", False, False),
}


@dataclass
class TokenizerParts:
    """What a model's tokenizer is made of, from a directory or a GGUF file."""

    tokenizer: HFTokenizer
    bos_token: str | None
    eos_token: str | None
    add_bos_token: bool
    chat_template: str | None
    eos_token_ids: set[int] = field(default_factory=set)
    generation: dict[str, Any] = field(default_factory=dict)


def gguf_tokenizer(f: GGUFFile) -> TokenizerParts:
    """The tokenizer of ``f``, from ``tokenizer.ggml.*`` and ``tokenizer.chat_template``."""

    kind = f.get("tokenizer.ggml.model")
    tokens = f.get("tokenizer.ggml.tokens")
    if kind is None or not tokens:
        raise CheckpointError(f"{f.path}: no tokenizer in the GGUF metadata "
                              f"(tokenizer.ggml.model / tokenizer.ggml.tokens)")
    types = f.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
        tok = _byte_level(f, tokens)
        add_bos = bool(f.get("tokenizer.ggml.add_bos_token", False))
    elif kind == "llama":
        tok = _sentencepiece(f, tokens)
        add_bos = bool(f.get("tokenizer.ggml.add_bos_token", True))
    else:
        raise CheckpointError(f"{f.path}: tokenizer.ggml.model={kind!r} is not supported "
                              f"(gpt2 and llama vocabularies are)")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types, strict=True) if k == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, k in zip(tokens, types, strict=True) if k == _USER_DEFINED])

    def text(key: str) -> str | None:
        i = f.get(key)
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    eos_ids = {int(i) for i in (f.get("tokenizer.ggml.eos_token_id"),
                                f.get("tokenizer.ggml.eot_token_id"),
                                f.get("tokenizer.ggml.eom_token_id")) if isinstance(i, int)}
    template = f.get("tokenizer.chat_template")
    return TokenizerParts(tok, text("tokenizer.ggml.bos_token_id"),
                          text("tokenizer.ggml.eos_token_id"), add_bos,
                          template if isinstance(template, str) else None, eos_ids)


def _byte_level(f: GGUFFile, tokens: list[str]) -> HFTokenizer:

    pre = f.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE:
        raise CheckpointError(f"{f.path}: tokenizer.ggml.pre={pre!r} is a pre-tokenizer this "
                              f"engine does not know (known: {', '.join(sorted(_PRE))})")
    split, nfc, ignore_merges = _PRE[pre]
    merges = [tuple(m.split(" ", 1)) for m in f.get("tokenizer.ggml.merges") or []]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges,
                               ignore_merges=ignore_merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if split == "gpt2":
        tok.pre_tokenizer = byte_level
    elif split == "digits":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        regex = {"llama3": _LLAMA3, "qwen2": _QWEN2, "gpt4o": _GPT4O}[split]
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(f: GGUFFile, tokens: list[str]) -> HFTokenizer:
    """SentencePiece BPE: merges recovered from the pieces' scores (a pair merges where
    both halves and their join are pieces, the join's score ranking it), as
    transformers' SentencePiece extractor does."""

    scores = f.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked: list[tuple[float, int, int, str, str]] = []
    for piece, i in vocab.items():
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                ranked.append((-float(scores[i]), vocab[left], vocab[right], left, right))
    ranked.sort()
    unk = f.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(models.BPE(vocab, [(r[3], r[4]) for r in ranked],
                               unk_token=tokens[unk] if isinstance(unk, int) else None,
                               fuse_unk=True, byte_fallback=True))
    steps: list[normalizers.Normalizer] = [normalizers.Replace(" ", "\u2581")]
    if f.get("tokenizer.ggml.add_space_prefix", True):
        steps.insert(0, normalizers.Prepend("\u2581"))
    tok.normalizer = normalizers.Sequence(steps)
    strip = [decoders.Strip(" ", 1, 0)] if f.get("tokenizer.ggml.add_space_prefix",
                                                 True) else []
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), *strip])
    return tok
