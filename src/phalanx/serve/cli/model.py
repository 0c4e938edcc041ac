"""``phalanx model init DIR ...``: write a seeded model of a chosen size (Hugging Face
format), for tests and benchmarks that need larger cases than the embedded default."""

from __future__ import annotations

import json

import click

_D = {"layers": 4, "hidden": 256, "heads": 8, "kv_heads": 4, "intermediate": 688,
      "vocab": 1472, "seed": 0, "max_position": 4096}  # the embedded default's shape


@click.group("model")
def model() -> None:
    """Model directories: write seeded reference checkpoints."""


@model.command("init")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--layers", default=_D["layers"], show_default=True, type=click.IntRange(1))
@click.option("--hidden", default=_D["hidden"], show_default=True, type=click.IntRange(1))
@click.option("--heads", default=_D["heads"], show_default=True, type=click.IntRange(1))
@click.option("--kv-heads", default=_D["kv_heads"], show_default=True, type=click.IntRange(1))
@click.option("--intermediate", default=None, type=click.IntRange(1),
              help="MLP width (default: 688 for the default hidden size, else ~8/3 hidden "
                   "rounded to 16)")
@click.option("--vocab", default=_D["vocab"], show_default=True, type=click.IntRange(1),
              help="model vocabulary (ids beyond what the embedded text trains stay unused)")
@click.option("--arch", type=click.Choice(["llama", "qwen2", "mistral"]), default="llama",
              show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]),
              default="float32", show_default=True)
@click.option("--seed", default=_D["seed"], show_default=True, type=int)
@click.option("--max-position", default=_D["max_position"], show_default=True,
              type=click.IntRange(1))
@click.option("--tie/--no-tie", default=False, show_default=True,
              help="tie the LM head to the embedding")
@click.option("--name", default="phalanx-custom", show_default=True)
def init(directory: str, layers: int, hidden: int, heads: int, kv_heads: int,
         intermediate: int | None, vocab: int, arch: str, dtype: str, seed: int,
         max_position: int, tie: bool, name: str) -> None:
    """Write a deterministic model (same flags, same bytes) into DIRECTORY (new)."""
    from phalanx.engine.model.default_model import ModelSpec, write_model
    from phalanx.errors import ModelConfigError

    if intermediate is None:
        intermediate = (_D["intermediate"] if hidden == _D["hidden"]
                        else -(-(8 * hidden // 3) // 16) * 16)
    spec = ModelSpec(name=name, arch=arch, layers=layers, hidden=hidden, heads=heads,
                     kv_heads=kv_heads, intermediate=intermediate, vocab=vocab, dtype=dtype,
                     seed=seed, max_position=max_position, tie=tie)
    try:
        path = write_model(directory, spec)
    except ModelConfigError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(json.dumps({"path": str(path), "digest": spec.digest(),
                           "spec": spec.__dict__}))
