"""The serve layer: the `phalanx` CLI and `phalanx serve`, the OpenAI-compatible HTTP server
(``api/``: requests, errors, routes, streams, metrics; ``driver``: the engine thread;
``supervisor``: health and restarts; ``server``: uvicorn, signals, the ready line)."""

__all__: list[str] = []
