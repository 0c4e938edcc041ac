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


# arch -> transformers' config and model classes
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
}
# each family's tiny shape beyond the shared one: 4 experts of which 2 route; Gemma's
# sliding windows shorter than the prompt, soft-caps low enough to bite, Gemma 3's
# default layer pattern (5 sliding, 1 global: what llama.cpp assumes of a GGUF) with the
# global layers' own rope (linear-scaled, another base). query_pre_attn_scalar equals
# head_dim: a GGUF does not carry it (llama.cpp assumes head_dim); Gemma tied, as the
# converter drops an untied head.
ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "mistral": dict(sliding_window=None),
    "mixtral": dict(sliding_window=None, num_local_experts=4, num_experts_per_tok=2),
    "qwen3": dict(head_dim=16),
    "qwen3_moe": dict(head_dim=16, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, norm_topk_prob=True),
    "gemma2": dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                   tie_word_embeddings=True,
                   attn_logit_softcapping=4.0, final_logit_softcapping=3.0),
    "gemma3": dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                   num_hidden_layers=6, tie_word_embeddings=True,
                   rope_parameters={
                       "full_attention": {"rope_type": "linear", "factor": 4.0,
                                          "rope_theta": 1_000_000.0},
                       "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}),
    "phi3": dict(sliding_window=None),
}


def greedy(n: int, **kw: Any) -> SamplingParams:
    """Greedy sampling of exactly ``n`` tokens (EOS ignored): what the oracle compares;
    ``kw``: further SamplingParams fields (logprobs, stop, ...)."""
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def write_checkpoint(path: Path, arch: str = "llama", *, seed: int = 0,
                     max_shard_size: str | None = None, **overrides: Any) -> Path:
    """A tiny checkpoint of ``arch`` (a key of ``ARCHS``) at ``path``."""
    import transformers

    # no progress bars: tqdm's monitor thread would outlive the test
    transformers.utils.logging.disable_progress_bar()
    base: dict[str, Any] = dict(vocab_size=256, hidden_size=64, intermediate_size=128,
                                num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, max_position_embeddings=128,
                                tie_word_embeddings=False, bos_token_id=None,
                                eos_token_id=None, pad_token_id=None)
    base.update(ARCH_DEFAULTS.get(arch, {}))
    base.update(overrides)
    config_cls, model_cls = (getattr(transformers, n) for n in ARCHS[arch])
    torch.manual_seed(seed)
    model = model_cls(config_cls(**base))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:   # 3: experts held fused by transformers 5
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


def prompts(n: int = 8, length: int = len(PROMPT), vocab: int = 251,
            seed: int = 0) -> list[list[int]]:
    """``n`` seeded prompts of one length (transformers then batches them unpadded)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


def hf_generate(path: Path, batch: list[list[int]],
                new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """transformers' greedy continuations of equal-length prompts, in one batch."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.eval()
    ids = torch.tensor(batch)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    return [row[len(batch[0]):] for row in out.tolist()]


def engine_generate_batch(runner: Runner, batch: list[list[int]],
                          new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """The engine's greedy continuations of ``batch``: every prompt prefilled in one step
    (a chunk each, on pages of its own), then one decode step for all per token."""
    greedy = SamplingSpec(temperature=0.0)
    per = -(-(max(map(len, batch)) + new_tokens) // runner.page_tokens)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(len(batch))]
    outs: list[list[int]] = [[] for _ in batch]
    for step in range(new_tokens):
        chunks = [SeqChunk(i, o[-1:] if o else p, len(p) + len(o) - 1 if o else 0,
                           tables[i], True, greedy)
                  for i, (p, o) in enumerate(zip(batch, outs, strict=True))]
        res = runner.execute(StepPlan(step=step, chunks=chunks))
        # only rank 0 samples: it sends the tokens to the others, as the next plan would
        mine = (b"".join(res.tokens[i].to_bytes(4, "little") for i in range(len(batch)))
                if runner.comm.rank == 0 else None)
        got = runner.comm.broadcast_bytes(mine)
        for i, o in enumerate(outs):
            o.append(int.from_bytes(got[4 * i:4 * i + 4], "little"))
    return outs
