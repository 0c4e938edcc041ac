"""``phalanx.LLM``: the offline API in the shape users know from vLLM's ``LLM``.

    with LLM(model=DIR, tensor_parallel_size=2) as llm:
        outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))
        print(outs[0].outputs[0].text)

A prompt is a string (tokenized with the model's tokenizer) or
``{"prompt_token_ids": [...]}``. :meth:`LLM.generate` returns one
:class:`~phalanx.engine.core.outputs.RequestOutput` per prompt, in order;
:meth:`LLM.generate_stream` yields each request's cumulative output after every step
that advanced it (the form a server streams from). One LLM runs one generate at a time.

``device="cuda"`` runs rank ``r`` on ``cuda:{r % torch.cuda.device_count()}`` (TP over
NCCL, one GPU per rank; "cuda:N" for one chosen GPU at TP 1): see engine/worker/devices.py.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Generator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from ._errors import RequestError
from .core.outputs import OutputBuilder, RequestOutput
from .core.sampling import SamplingParams
from .core.scheduler import PrefixTier
from .engine import Engine, EngineConfig, TokenizerLike
from .model.config import load_config
from .model.default_model import default_model_dir
from .model.gguf_file import forget_gguf_files, is_gguf
from .model.tokenizer import Tokenizer

__all__ = ["LLM", "PromptType"]

PromptType = str | Mapping[str, Any]


def _load_tokenizer(model_dir: Path) -> Tokenizer | None:
    """The model's tokenizer: a GGUF file carries one; a directory may lack it (then only
    token-id prompts are served)."""

    if not is_gguf(model_dir) and not (model_dir / "tokenizer.json").exists():
        return None
    return Tokenizer(model_dir)


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
        device: str = "cpu",
        tp_comm: str = "auto",
    ) -> None:
        model_dir = Path(model) if model is not None else default_model_dir()
        self.model_dir = model_dir
        loaded = _load_tokenizer(model_dir)
        self.tokenizer: TokenizerLike | None = tokenizer if tokenizer is not None else loaded
        config = EngineConfig(
            model=str(model_dir), tensor_parallel_size=tensor_parallel_size,
            page_tokens=page_tokens, num_pages=num_pages, kv_cache_bytes=kv_cache_bytes,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, dtype=dtype,
            enable_prefix_caching=enable_prefix_caching, seed=seed,
            step_timeout=step_timeout,
            prefix_cache_disk=None if prefix_cache_disk is None else str(prefix_cache_disk),
            prefix_cache_disk_bytes=prefix_cache_disk_bytes,
            device=device, tp_comm=tp_comm,
        )

        mcfg = load_config(model_dir, max_model_len=max_model_len, dtype=dtype)
        eos = list(mcfg.eos_token_ids)
        if loaded is not None:   # generation_config.json, tokenizer_config.json's eos
            eos += sorted(e for e in loaded.eos_token_ids if e not in eos)
        self._chat = loaded
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

    @staticmethod
    def _requests(prompts: PromptType | Sequence[PromptType],
                  sampling_params: SamplingParams | Sequence[SamplingParams] | None
                  ) -> tuple[list[PromptType], list[SamplingParams]]:
        """The prompts as a list, with one sampling params each."""
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
        return plist, params

    def generate_stream(
        self, prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Generator[RequestOutput, None, None]:
        """Yield every request's cumulative output after each step that advanced it."""
        plist, params = self._requests(prompts, sampling_params)
        prepared = [self._prepare(p) for p in plist]
        yield from self._run(prepared, params, every_step=True)

    def _run(self, prepared: list[tuple[list[int], str | None]],
             params: list[SamplingParams], every_step: bool
             ) -> Generator[RequestOutput, None, None]:
        """Submit, step, and build each request's output from the engine's deltas:
        after every step that advanced it (``every_step``), else once when it ends."""
        if not self._busy.acquire(blocking=False):
            raise RequestError("this LLM is already generating (one generate at a time)")
        live: dict[str, OutputBuilder] = {}
        try:
            for (ids, text), sp in zip(prepared, params, strict=True):
                rid = str(next(self._ids))
                self.engine.add_request(rid, ids, sp)
                live[rid] = OutputBuilder(rid, text, ids, sp.logprobs is not None)
            while live:
                for delta in self.engine.step():
                    builder = live.get(delta.request_id)
                    if builder is None:
                        continue
                    builder.add(delta)
                    if delta.finished:
                        del live[delta.request_id]
                    if every_step or delta.finished:
                        yield builder.output()
        finally:
            for rid in live:
                self.engine.abort(rid)
            self._busy.release()

    def generate(
        self, prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One finished output per prompt, in order. A dead engine raises EngineDeadError."""
        plist, params = self._requests(prompts, sampling_params)
        prepared = [self._prepare(p) for p in plist]
        final = {out.request_id: out for out in self._run(prepared, params, every_step=False)}
        ordered = [final[k] for k in sorted(final, key=int)]
        for o in ordered:
            if o.error is not None:
                raise o.error
        return ordered

    def reset_prefix_cache(self) -> bool:
        """Drop the memory tier of the prefix cache (vLLM's name); the disk tier stays."""
        return self.engine.reset_prefix_cache()

    def drain_disk_stores(self, timeout: float = 60.0) -> bool:
        """Wait until the pages of finished prefills are on disk (True; at once without a
        disk tier), or ``timeout`` passed (False). Requests never wait for these stores
        (they run once the ranks are quiet); a benchmark that must not time them, or a
        program about to reopen the directory elsewhere, does."""
        return self.engine.drain_disk_stores(timeout)

    def chat(
        self, messages: Sequence[Mapping[str, Any]],
        sampling_params: SamplingParams | None = None,
    ) -> RequestOutput:
        """One chat turn: ``messages`` rendered with the model's chat template."""
        if self._chat is None:
            raise RequestError(f"{self.model_dir} has no tokenizer.json: no chat template")
        text = self._chat.apply_chat_template([dict(m) for m in messages])
        ids = self._chat.encode(text, add_special_tokens=False)
        (out,) = self.generate({"prompt_token_ids": ids, "prompt": text}, sampling_params)
        return out

    @property
    def counters(self) -> Any:
        """Prompt tokens from memory / disk / computed, preemptions, evictions."""
        return self.engine.counters

    # -- lifetime ---------------------------------------------------------------------

    def close(self) -> None:
        """Stop the ranks and release everything (idempotent)."""

        self.engine.close()
        forget_gguf_files()   # a GGUF file's parse, kept for this start, holds its map

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
