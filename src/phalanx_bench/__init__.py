"""Benchmarks behind ``phalanx bench``; one module each, exposing a click ``command``.

Shared helpers are in ``_stats.py``. Performance lives here, never in timed test asserts.
"""
