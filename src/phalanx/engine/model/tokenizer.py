"""A model directory's tokenizer: ``tokenizer.json``, its special tokens, its chat
template, and the generation defaults.

``tokenizer.json`` is read by the ``tokenizers`` library; ``tokenizer_config.json``
gives the special tokens (``bos_token``, ``eos_token``, ``add_bos_token``) and the
``chat_template``, rendered with jinja2 in a sandbox the way transformers renders it
(``trim_blocks``, ``lstrip_blocks``, ``raise_exception``); ``generation_config.json``
gives the EOS ids that end a generation and the sampling defaults. Nothing is
downloaded.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

from .._errors import CheckpointError, RequestError
from .gguf_file import is_gguf, open_gguf
from .gguf_tokenizer import TokenizerParts, gguf_tokenizer

__all__ = ["Tokenizer"]

_GENERATION = ("temperature", "top_p", "top_k", "max_new_tokens", "do_sample")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot read ({exc})") from exc
    if not isinstance(doc, dict):
        raise CheckpointError(f"{path}: must hold a JSON object")
    return doc


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _dir_parts(model_dir: Path) -> TokenizerParts:
    """A Hugging Face directory's tokenizer. The chat template is read where transformers
    5.x writes it (``chat_template.jinja``, or ``chat_template.json``) before
    ``tokenizer_config.json``'s ``chat_template`` (4.x)."""

    path = model_dir / "tokenizer.json"
    if not path.exists():
        raise CheckpointError(f"{model_dir}: no tokenizer.json (only fast tokenizers are "
                              f"read; a GGUF file carries its own)")
    try:
        tok = _HFTokenizer.from_file(str(path))
    except Exception as exc:  # the library raises its own exception type
        raise CheckpointError(f"{path}: cannot load ({exc})") from exc
    cfg = _read_json(model_dir / "tokenizer_config.json")
    gen = _read_json(model_dir / "generation_config.json")
    model_cfg = _read_json(model_dir / "config.json")
    template = _chat_template(model_dir, cfg)
    eos: set[int] = set()
    for source in (gen.get("eos_token_id"), model_cfg.get("eos_token_id")):
        items = source if isinstance(source, list) else [source]
        eos.update(i for i in items if isinstance(i, int) and not isinstance(i, bool))
    return TokenizerParts(tok, _token_text(cfg.get("bos_token")),
                          _token_text(cfg.get("eos_token")),
                          bool(cfg.get("add_bos_token", False)), template, eos,
                          {k: gen[k] for k in _GENERATION if k in gen})


def _chat_template(model_dir: Path, cfg: dict[str, Any]) -> str | None:
    jinja = model_dir / "chat_template.jinja"
    if jinja.exists():
        try:
            return jinja.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{jinja}: cannot read ({exc})") from exc
    doc = _read_json(model_dir / "chat_template.json")
    for value in (doc.get("chat_template"), cfg.get("chat_template")):
        if isinstance(value, str):
            return value
    return None


class Tokenizer:
    """Encode, decode and chat-format text for one model: a Hugging Face directory or a
    GGUF file (whose metadata holds its vocabulary: engine/gguf_tokenizer.py)."""

    def __init__(self, model: str | Path) -> None:

        self.dir = Path(model)
        parts = gguf_tokenizer(open_gguf(self.dir)) if is_gguf(self.dir) else _dir_parts(
            self.dir)
        self._tok = parts.tokenizer
        self.bos_token = parts.bos_token
        self.eos_token = parts.eos_token
        self.bos_token_id = self._id(self.bos_token)
        self.add_bos_token = parts.add_bos_token and self.bos_token_id is not None
        self.chat_template: str | None = parts.chat_template
        eos = set(parts.eos_token_ids)
        if (eos_id := self._id(self.eos_token)) is not None:
            eos.add(eos_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        # sampling defaults the model ships (temperature, top_p, top_k, ...)
        self.generation_defaults = parts.generation
        self._template: Any = None

    def _id(self, token: str | None) -> int | None:
        if token is None:
            return None
        i = self._tok.token_to_id(token)
        return int(i) if i is not None else None

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def to_json(self) -> str:
        """The tokenizer as Hugging Face's tokenizer.json text (for a grammar engine)."""
        return str(self._tok.to_str())

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(self._tok.encode(text, add_special_tokens=False).ids)
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        known = [i for i in ids if 0 <= i < self.vocab_size]  # padded model vocab ids
        return str(self._tok.decode(known, skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, messages: Sequence[dict[str, Any]],
                            add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt text of a chat, rendered with the model's template."""
        if self.chat_template is None:
            raise RequestError(f"{self.dir}: the model has no chat template (none in "
                               f"chat_template.jinja, tokenizer_config.json or the GGUF "
                               f"metadata); send a plain prompt")
        if self._template is None:

            def raise_exception(message: str) -> None:
                raise RequestError(f"chat template of {self.dir}: {message}")

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            self._template = env.from_string(self.chat_template)
        return str(self._template.render(
            messages=list(messages), add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra))
