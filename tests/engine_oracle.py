"""The oracle: tiny checkpoints written by Hugging Face transformers, its logits and its
greedy output, and the engine's, computed through the runner's step plans.

Weights are transformers' seeded init scaled up (``_SCALE``) so logits spread out
(std ~1) and greedy generation is not decided by near-ties; biases (Qwen2's q/k/v) are
filled with seeded noise, since transformers initialises them to zero and a zero bias
would test nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from phalanx.engine.core.plan import PageLoad, SamplingSpec, SeqChunk, StepPlan
from phalanx.engine.core.sampling import SamplingParams
from phalanx.engine.worker.runner import Runner

_SCALE = 5.0
PROMPT = [(7 * i + 3) % 251 + 3 for i in range(37)]   # 37 tokens: 3 pages of 16, ragged
PAGE_TOKENS = 16
NEW_TOKENS = 32
# float32 throughout: the engine and transformers compute the same ops in a slightly
# different order (a packed q/k/v matmul, paged gathers), so logits agree to rounding.
ATOL = 1e-4


def greedy(n: int, **kw: Any) -> SamplingParams:
    """Greedy sampling of exactly ``n`` tokens (EOS ignored): what the oracle compares;
    ``kw``: further SamplingParams fields (logprobs, stop, ...)."""
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def write_checkpoint(path: Path, arch: str = "llama", *, seed: int = 0,
                     max_shard_size: str | None = None, **overrides: Any) -> Path:
    """A tiny checkpoint of ``arch`` (llama | qwen2 | mistral) at ``path``."""
    import transformers

    # no progress bars: tqdm's monitor thread would outlive the test
    transformers.utils.logging.disable_progress_bar()
    base: dict[str, Any] = dict(vocab_size=256, hidden_size=64, intermediate_size=128,
                                num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, max_position_embeddings=128,
                                tie_word_embeddings=False, bos_token_id=None,
                                eos_token_id=None, pad_token_id=None)
    if arch == "mistral":
        base["sliding_window"] = None
    base.update(overrides)
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**base))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(_SCALE)
            elif name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(str(path), **kwargs)
    return path


def hf_reference(path: Path, prompt: list[int] = PROMPT,
                 new_tokens: int = NEW_TOKENS) -> tuple[torch.Tensor, list[int]]:
    """transformers' float32 logits of ``prompt`` and its greedy continuation."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    return logits, out[0, len(prompt):].tolist()


def engine_generate(runner: Runner, prompt: list[int] = PROMPT,
                    new_tokens: int = NEW_TOKENS, chunk: int = PAGE_TOKENS,
                    seq_id: int = 1, first_page: int = 0, cached: int = 0,
                    loads: list[PageLoad] | None = None) -> tuple[torch.Tensor, list[int]]:
    """The engine's logits of ``prompt`` (prefilled in chunks of ``chunk`` tokens) and its
    greedy continuation, one decode step per token, through step plans.

    ``cached`` leading tokens are already in the pages (``loads`` puts them there, in the
    first step); logits are returned for the positions computed."""
    total = len(prompt) + new_tokens
    pages = list(range(first_page, first_page + -(-total // runner.page_tokens)))
    greedy = SamplingSpec(temperature=0.0)
    parts = []
    step = 0
    for start in range(cached, len(prompt), chunk):
        toks = prompt[start:start + chunk]
        plan = StepPlan(step=step, chunks=[SeqChunk(seq_id, toks, start, pages, False,
                                                    greedy)],
                        loads=(loads or []) if step == 0 else [])
        parts.append(runner.logits(plan))
        step += 1
    logits = torch.cat(parts)
    out = [int(logits[-1].argmax())]
    while len(out) < new_tokens:
        pos = len(prompt) + len(out) - 1
        plan = StepPlan(step=step, chunks=[SeqChunk(seq_id, [out[-1]], pos, pages, True,
                                                    greedy)])
        res = runner.execute(plan)
        step += 1
        # only rank 0 samples: it sends the token to the others, as the engine's next
        # plan would
        mine = res.tokens[seq_id].to_bytes(4, "little") if runner.comm.rank == 0 else None
        out.append(int.from_bytes(runner.comm.broadcast_bytes(mine), "little"))
    return logits, out
