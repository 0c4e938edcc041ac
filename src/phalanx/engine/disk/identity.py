"""What a served model's disk tier is keyed by: its geometry per rank and its fingerprint.

One function, used by the engine when it opens its disk tier and by the operator
commands (``phalanx cache synth|maintain --model DIR --tp N``), so records written
offline fit the geometry a server opens, and a server refuses a directory written for
another model, dtype, TP size or page size (``ForeignStoreError``).
"""

from __future__ import annotations

from pathlib import Path

from ...kvstore import Geometry
from ..model.config import load_config, local_kv_heads
from ..model.fingerprint import model_fingerprint

__all__ = ["cache_identity"]


def cache_identity(model_dir: str | Path, tp: int, page_tokens: int = 64,
                   dtype: str | None = None) -> tuple[Geometry, bytes]:
    """(each rank's page geometry, the key chain's fingerprint) of ``model_dir`` at TP
    ``tp`` (reads config.json and the safetensors headers, never the weights)."""
    cfg = load_config(model_dir, dtype=dtype)
    geometry = Geometry(layers=cfg.num_layers, kv_heads=local_kv_heads(cfg.num_kv_heads, tp),
                        head_dim=cfg.head_dim, dtype=cfg.dtype, page_tokens=page_tokens)
    return geometry, model_fingerprint(model_dir, cfg.to_dict(), tp, page_tokens)
