"""The serve layer: the `phalanx` CLI (and, later, the HTTP API and metrics)."""

__all__: list[str] = []
