"""phalanx's next-token distributions over a fixed text, scored the way
``llama-perplexity --kl-divergence`` scores llama.cpp's.

The text is cut into chunks of ``n_ctx`` tokens; each chunk is one prefill from position
0 through the engine's own decoder (``CausalLM``, TP 1, in this process: the rank
processes would add nothing to the numbers and would hide the logits); the second half
of each chunk's positions is scored (as llama-perplexity does: every scored token has at
least ``n_ctx / 2`` tokens of context). ``kl_top1`` compares two runs: the mean KL
divergence of the second from the first (the base) and how often their top tokens agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["Agreement", "chunks", "kl_top1", "log_probs", "text"]

_PAGE = 16


@dataclass(frozen=True)
class Agreement:
    """One run against its base over the same scored positions."""

    kl: float          # mean KL(base || run), nats
    top1: float        # fraction of positions whose argmax agrees
    positions: int


def text() -> str:
    """The fixed English text both engines score (2,272 SmolLM2 tokens: four chunks of
    512), shipped with the package: never change it, or earlier figures stop comparing."""
    return (Path(__file__).parent / "data" / "fidelity_text.txt").read_text(encoding="utf-8")


def chunks(tokens: list[int], n_ctx: int) -> list[list[int]]:
    """Whole chunks of ``n_ctx`` tokens (a tail shorter than one is dropped, as
    llama-perplexity drops it)."""
    return [tokens[i:i + n_ctx] for i in range(0, len(tokens) - n_ctx + 1, n_ctx)]


def log_probs(path: Path, dtype: str | None, tokens: list[int], n_ctx: int,
              threads: int | None = None) -> torch.Tensor:
    """log-softmax of the next-token logits at the scored positions [positions, vocab],
    float32: ``dtype`` None runs the file's quantized path, a dtype the dequantized one."""
    import torch

    from phalanx.engine.model import CausalLM, build_meta, load_config

    if threads:
        torch.set_num_threads(threads)
    cfg = load_config(path, dtype=dtype, max_model_len=n_ctx)
    model, _ = CausalLM.from_pretrained(path, cfg)
    pages = -(-n_ctx // _PAGE)
    out = []
    with torch.no_grad():
        for chunk in chunks(tokens, n_ctx):
            kv = model.allocate_kv(pages, _PAGE)
            meta = build_meta([(0, n_ctx, list(range(pages)))], _PAGE, "cpu", kv[0].dtype)
            hidden = model(torch.tensor(chunk), torch.arange(n_ctx), meta, kv)
            logits = model.compute_logits(hidden[n_ctx // 2:n_ctx - 1])
            out.append(torch.log_softmax(logits.float(), dim=-1))
    return torch.cat(out)


def kl_top1(base: torch.Tensor, run: torch.Tensor) -> Agreement:
    """Mean KL(base || run) and top-1 agreement over the rows of two log-prob tables."""
    kl = (base.exp() * (base - run)).sum(-1)
    top = (base.argmax(-1) == run.argmax(-1)).float()
    return Agreement(float(kl.mean()), float(top.mean()), int(base.shape[0]))
