"""``phalanx bench fidelity``: how faithful each engine's quantized path is to its own
float32 model on the same GGUF file, measured as llama.cpp's users measure it.

Over the fixed text (``fidelity_score.text()``, four chunks of ``--n-ctx`` 512), the
mean KL divergence of the quantized path's next-token distribution from the float32
dequantized model's, and how often their top tokens agree:

- llama.cpp: the file dequantized to F32 by ``llama-quantize --allow-requantize``, scored
  by ``llama-perplexity --kl-divergence-base``, then the file itself by
  ``llama-perplexity --kl-divergence`` (both from the pinned build,
  ``phalanx_bench.llamacpp_build``);
- phalanx: ``fidelity_score.log_probs`` with dtype float32, then the quantized path
  (TP 1, the same chunks and scored positions).

Ratios: ``kl`` phalanx / llama.cpp (goal <= 1.0), ``top1`` phalanx / llama.cpp (goal
>= 1.0). One file at a time; the F32 base (4 bytes a weight) lives in a temporary
directory removed at the end.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import click

from . import real_model
from ._stats import emit
from .fidelity_score import kl_top1, log_probs, text
from .llamacpp_build import perplexity_path, quantize_path
from .machine import cpu

__all__ = ["command", "llamacpp_scores", "parse_kld"]

_KLD = re.compile(r"Mean\s+KLD:\s+([-\d.eE]+)")
_TOP = re.compile(r"Same top p:\s+([\d.]+)")


def parse_kld(output: str) -> tuple[float, float]:
    """(mean KL, top-1 agreement as a fraction) from llama-perplexity's statistics."""
    kl, top = _KLD.search(output), _TOP.search(output)
    if kl is None or top is None:
        raise click.ClickException(f"llama-perplexity printed no KL statistics; its output "
                                   f"ends: {output[-600:]}")
    return float(kl.group(1)), float(top.group(1)) / 100


def _run(cmd: list[str]) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise click.ClickException(f"{Path(cmd[0]).name} exited {done.returncode}: "
                                   f"{done.stderr[-600:]}")
    return done.stdout + done.stderr


def llamacpp_scores(model: Path, text_file: Path, n_ctx: int, threads: int,
                    work: Path, chunks: int | None = None) -> tuple[float, float]:
    """llama.cpp's (KL, top-1) for ``model`` against its own F32 dequantization."""
    for tool in (quantize_path(), perplexity_path()):
        if not tool.exists():
            raise click.ClickException(f"no {tool.name} at {tool}: bench/setup_llamacpp.sh "
                                       f"builds it")
    base, kld = work / "base.gguf", work / "base.kld"
    _run([str(quantize_path()), "--allow-requantize", str(model), str(base), "F32"])
    common = ["-f", str(text_file), "-c", str(n_ctx), "-t", str(threads),
              "--kl-divergence-base", str(kld)]
    if chunks:
        # a batch of exactly these chunks: with fewer chunks than the batch's sequences
        # (2,048 / n_ctx) llama-perplexity prints no final statistics
        common += ["--chunks", str(chunks), "-b", str(chunks * n_ctx)]
    _run([str(perplexity_path()), "-m", str(base), *common])
    base.unlink()
    out = _run([str(perplexity_path()), "-m", str(model), *common, "--kl-divergence"])
    return parse_kld(out)


def _row(model: Path, n_ctx: int, threads: int, chunks: int | None) -> dict[str, Any]:
    from phalanx.engine.model import Tokenizer, forget_gguf_files

    with tempfile.TemporaryDirectory(prefix="phalanx-fidelity-") as tmp:
        text_file = Path(tmp) / "text.txt"
        text_file.write_text(text(), encoding="utf-8")
        lkl, ltop = llamacpp_scores(model, text_file, n_ctx, threads, Path(tmp), chunks)
    ids = Tokenizer(model).encode(text())
    if chunks:
        ids = ids[:chunks * n_ctx]
    base = log_probs(model, "float32", ids, n_ctx, threads)
    ours = kl_top1(base, log_probs(model, None, ids, n_ctx, threads))
    forget_gguf_files()
    return {"file": model.name, "positions": ours.positions,
            "phalanx": {"kl": ours.kl, "top1": ours.top1},
            "llamacpp": {"kl": lkl, "top1": ltop},
            "ratio": {"kl": ours.kl / lkl if lkl > 0 else None,
                      "top1": ours.top1 / ltop if ltop > 0 else None}}


@click.command("fidelity")
@click.option("--model", "models", multiple=True,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="a quantized GGUF file (repeat for several; default: the real test "
                   "model, SmolLM2-135M-Instruct Q4_1)")
@click.option("--n-ctx", default=512, show_default=True, type=click.IntRange(16, 4096),
              help="tokens per scored chunk (llama-perplexity's -c)")
@click.option("--chunks", default=None, type=click.IntRange(1),
              help="score only the first N chunks (default: the whole text)")
@click.option("--threads", default=1, show_default=True, type=click.IntRange(1, 256))
@click.option("--json", "as_json", is_flag=True, help="only the JSON line")
def command(models: tuple[Path, ...], n_ctx: int, chunks: int | None, threads: int,
            as_json: bool) -> None:
    """KL and top-1 agreement of each engine's quantized path against its own float32
    model, phalanx over llama.cpp (goals: kl ratio <= 1.0, top1 ratio >= 1.0)."""
    rows = [_row(m, n_ctx, threads, chunks) for m in (models or (real_model.fetch(),))]
    if not as_json:
        print(f"cpu: {cpu().get('model')}")
        print(f"{'file':44s} {'KL phalanx':>11s} {'KL llama':>9s} {'ratio':>6s} "
              f"{'top1 ph':>8s} {'top1 ll':>8s} {'ratio':>6s}")
        for r in rows:
            p, ll, q = r["phalanx"], r["llamacpp"], r["ratio"]
            print(f"{r['file']:44s} {p['kl']:11.5f} {ll['kl']:9.5f} {q['kl'] or 0:6.2f} "
                  f"{p['top1']:8.2%} {ll['top1']:8.2%} {q['top1'] or 0:6.3f}")
    emit({"bench": "fidelity", "cpu": cpu(), "n_ctx": n_ctx, "threads": threads,
          "rows": rows}, as_json=True)
