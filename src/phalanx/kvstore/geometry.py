"""The shape of one rank's KV rows: what every record header carries and checks."""

from __future__ import annotations

import msgspec

__all__ = ["DTYPE_SIZES", "Geometry"]

# dtype name -> bytes per element. Names, not numpy dtypes: bfloat16 and fp8 have no
# numpy dtype, and the header stores the name.
DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


class Geometry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """KV geometry of this rank's shard.

    A row is token-major: for each token, K then V for every layer, each
    ``kv_heads x head_dim`` elements. So the KV of a shorter prefix inside a row is a
    byte range of it.
    """

    layers: int
    kv_heads: int  # heads of this rank's shard, not of the model
    head_dim: int
    dtype: str
    page_tokens: int = 64

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_dim", "page_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"Geometry.{name} must be a positive int, got {value!r}")
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(
                f"Geometry.dtype {self.dtype!r} is not one of {sorted(DTYPE_SIZES)}"
            )

    @property
    def token_bytes(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_SIZES[self.dtype]

    @property
    def page_bytes(self) -> int:
        return self.token_bytes * self.page_tokens
