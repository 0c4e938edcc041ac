"""The serve layer: the `phalanx` CLI (and, later, the HTTP API and metrics)."""
