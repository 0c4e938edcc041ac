"""``phalanx.LLM``: the offline API in the shape users know from vLLM's ``LLM``.

    with LLM(model=DIR, tensor_parallel_size=2) as llm:
        outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))
        print(outs[0].outputs[0].text)

A prompt is a string (tokenized with the model's tokenizer) or
``{"prompt_token_ids": [...]}``. :meth:`LLM.generate` returns one
:class:`~phalanx.engine.outputs.RequestOutput` per prompt, in order;
:meth:`LLM.generate_stream` yields each request's cumulative output after every step
that advanced it (the form a server streams from). One LLM runs one generate at a time.
"""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Generator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from ._errors import EngineError, RequestError
from .engine import Engine, EngineConfig, TokenizerLike
from .outputs import RequestOutput
from .sampling import SamplingParams
from .scheduler import PrefixTier

__all__ = ["LLM", "PromptType"]

PromptType = str | Mapping[str, Any]


class _FileTokenizer:
    """``tokenizer.json`` through the ``tokenizers`` library (no chat template here)."""

    def __init__(self, model_dir: Path) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=True).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))


def _load_tokenizer(model_dir: Path) -> TokenizerLike | None:
    if not (model_dir / "tokenizer.json").exists():
        return None
    return _FileTokenizer(model_dir)


def _generation_eos(model_dir: Path) -> list[int]:
    path = model_dir / "generation_config.json"
    if not path.exists():
        return []
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise EngineError(f"{path}: cannot read generation_config.json: {exc}") from exc
    eos = raw.get("eos_token_id") if isinstance(raw, dict) else None
    if isinstance(eos, int):
        return [eos]
    if isinstance(eos, list):
        return [e for e in eos if isinstance(e, int)]
    return []


def _default_model_dir() -> Path:
    import importlib

    try:
        default_model = importlib.import_module("phalanx.engine.default_model")
    except ImportError as exc:
        raise EngineError(
            "LLM(model=None): the embedded default model is not available in this build; "
            "pass a Hugging Face model directory"
        ) from exc
    ensure = getattr(default_model, "ensure_default_model", None)
    if ensure is None:
        raise EngineError("LLM(model=None): engine.default_model has no ensure_default_model()")
    return Path(ensure())


class LLM:
    """An engine over ``tensor_parallel_size`` rank processes; see the module docstring."""

    def __init__(
        self,
        model: str | Path | None = None,
        tensor_parallel_size: int = 2,
        prefix_cache_disk: str | Path | None = None,
        *,
        tokenizer: TokenizerLike | None = None,
        page_tokens: int = 64,
        num_pages: int | None = None,
        kv_cache_bytes: int = 256 << 20,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 512,
        max_model_len: int | None = None,
        dtype: str | None = None,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        step_timeout: float = 120.0,
        prefix_tier: PrefixTier | None = None,
        prefix_cache_disk_bytes: int = 1 << 30,
    ) -> None:
        model_dir = Path(model) if model is not None else _default_model_dir()
        self.model_dir = model_dir
        self.tokenizer = tokenizer if tokenizer is not None else _load_tokenizer(model_dir)
        config = EngineConfig(
            model=str(model_dir), tensor_parallel_size=tensor_parallel_size,
            page_tokens=page_tokens, num_pages=num_pages, kv_cache_bytes=kv_cache_bytes,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, dtype=dtype,
            enable_prefix_caching=enable_prefix_caching, seed=seed,
            step_timeout=step_timeout,
            prefix_cache_disk=None if prefix_cache_disk is None else str(prefix_cache_disk),
            prefix_cache_disk_bytes=prefix_cache_disk_bytes,
        )
        from .config import load_config

        mcfg = load_config(model_dir, max_model_len=max_model_len, dtype=dtype)
        eos = list(mcfg.eos_token_ids)
        eos += [e for e in _generation_eos(model_dir) if e not in eos]
        self.engine = Engine(config, self.tokenizer, prefix_tier, eos_token_ids=eos)
        self._ids = itertools.count()
        self._busy = threading.Lock()

    # -- generation -------------------------------------------------------------------

    def get_tokenizer(self) -> TokenizerLike | None:
        return self.tokenizer

    def _prepare(self, prompt: PromptType) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(
                    f"a text prompt needs a tokenizer, and {self.model_dir} has no "
                    "tokenizer.json: pass {'prompt_token_ids': [...]}"
                )
            return self.tokenizer.encode(prompt), prompt
        if isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise RequestError("prompt_token_ids must be a list of ints")
            return list(ids), prompt.get("prompt")
        raise RequestError(
            f"a prompt is a string or {{'prompt_token_ids': [...]}}, not {type(prompt).__name__}"
        )

    def generate_stream(
        self, prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Generator[RequestOutput, None, None]:
        """Yield every request's cumulative output after each step that advanced it."""
        if isinstance(prompts, (str, Mapping)):
            prompts = [prompts]
        plist = list(prompts)
        if sampling_params is None:
            params: list[SamplingParams] = [SamplingParams()] * len(plist)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(plist)
        else:
            params = list(sampling_params)
            if len(params) != len(plist):
                raise RequestError(
                    f"{len(params)} sampling params for {len(plist)} prompts"
                )
        prepared = [self._prepare(p) for p in plist]
        if not self._busy.acquire(blocking=False):
            raise RequestError("this LLM is already generating (one generate at a time)")
        added: list[str] = []
        try:
            for (ids, text), sp in zip(prepared, params, strict=True):
                rid = str(next(self._ids))
                self.engine.add_request(rid, ids, sp, prompt=text)
                added.append(rid)
            live = set(added)
            while live:
                for out in self.engine.step():
                    if out.request_id in live:
                        if out.finished:
                            live.discard(out.request_id)
                        yield out
        finally:
            for rid in added:
                self.engine.abort(rid)
            self._busy.release()

    def generate(
        self, prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One finished output per prompt, in order. A dead engine raises EngineDeadError."""
        final: dict[str, RequestOutput] = {}
        for out in self.generate_stream(prompts, sampling_params):
            if out.finished:
                final[out.request_id] = out
        ordered = [final[k] for k in sorted(final, key=int)]
        for o in ordered:
            if o.error is not None:
                raise o.error
        return ordered

    def reset_prefix_cache(self) -> bool:
        """Drop the memory tier of the prefix cache (vLLM's name); the disk tier stays."""
        return self.engine.reset_prefix_cache()

    @property
    def counters(self) -> Any:
        """Prompt tokens from memory / disk / computed, preemptions, evictions."""
        return self.engine.counters

    # -- lifetime ---------------------------------------------------------------------

    def close(self) -> None:
        """Stop the ranks and release everything (idempotent)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
