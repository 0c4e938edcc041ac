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

from ._errors import CheckpointError, RequestError

__all__ = ["Tokenizer"]


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


class Tokenizer:
    """Encode, decode and chat-format text for one model directory."""

    def __init__(self, model_dir: str | Path) -> None:
        from tokenizers import Tokenizer as _HFTokenizer

        self.dir = Path(model_dir)
        path = self.dir / "tokenizer.json"
        if not path.exists():
            raise CheckpointError(f"{self.dir}: no tokenizer.json (only fast tokenizers "
                                  f"are read)")
        try:
            self._tok = _HFTokenizer.from_file(str(path))
        except Exception as exc:  # the library raises its own exception type
            raise CheckpointError(f"{path}: cannot load ({exc})") from exc
        cfg = _read_json(self.dir / "tokenizer_config.json")
        gen = _read_json(self.dir / "generation_config.json")
        model_cfg = _read_json(self.dir / "config.json")
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.bos_token_id = self._id(self.bos_token)
        self.add_bos_token = bool(cfg.get("add_bos_token", False)) and self.bos_token_id is not None
        self.chat_template: str | None = cfg.get("chat_template") if isinstance(
            cfg.get("chat_template"), str) else None
        eos: set[int] = set()
        for source in (gen.get("eos_token_id"), model_cfg.get("eos_token_id"),
                       self._id(self.eos_token)):
            items = source if isinstance(source, list) else [source]
            eos.update(i for i in items if isinstance(i, int) and not isinstance(i, bool))
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        # sampling defaults the model ships (temperature, top_p, top_k, ...)
        self.generation_defaults = {k: gen[k] for k in ("temperature", "top_p", "top_k",
                                                        "max_new_tokens", "do_sample")
                                    if k in gen}
        self._template: Any = None

    def _id(self, token: str | None) -> int | None:
        if token is None:
            return None
        i = self._tok.token_to_id(token)
        return int(i) if i is not None else None

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

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
            raise RequestError(f"{self.dir}: the model has no chat_template in "
                               f"tokenizer_config.json; send a plain prompt")
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise RequestError(f"chat template of {self.dir}: {message}")

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            self._template = env.from_string(self.chat_template)
        return str(self._template.render(
            messages=list(messages), add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra))
