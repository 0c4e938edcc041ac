"""The OpenAI-compatible HTTP API: request models, one error shape, routes, streams, metrics."""
