"""The root of a model's page-key chain: what of a model can change a KV byte.

Used by the engine (its scheduler keys pages from it) and by the operator commands
(``engine/disk/identity.py``), so both derive the same chain for the same model.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from ...kvstore import fingerprint_digest
from .gguf_file import is_gguf, open_gguf

__all__ = ["model_fingerprint"]

_NOT_IN_KV = ("max_model_len", "eos_token_ids")


def model_fingerprint(model_dir: str | Path, config: dict[str, Any], tp: int,
                      page_tokens: int) -> bytes:
    """The root of the page-key chain: config, dtype, the weight files' headers and sizes
    (a GGUF file's tensor data), TP size and page size. Stable across processes and
    restarts; never reads safetensors weights.
    What cannot change a KV byte (the serving context length, EOS ids) is left out, so a
    server restarted with another ``--max-model-len`` keeps its cache."""
    h = hashlib.blake2b(digest_size=16)
    kv_config = {k: v for k, v in config.items() if k not in _NOT_IN_KV}
    h.update(json.dumps(kv_config, sort_keys=True, default=str).encode())
    h.update(f"|tp={tp}|page={page_tokens}|".encode())

    if is_gguf(model_dir):     # a GGUF file: a digest of every tensor byte
        h.update(f"gguf:{open_gguf(model_dir).data_digest()}".encode())
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        size = f.stat().st_size
        with f.open("rb") as fh:
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else 0
            header = fh.read(min(n, 64 << 20))
        h.update(f"{f.name}:{size}:".encode())
        h.update(header)
    return fingerprint_digest(h.digest())
