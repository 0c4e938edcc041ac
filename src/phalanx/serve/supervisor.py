"""The server's engine, supervised: a dead rank is noticed, reported, and healed.

:class:`Supervisor` is what the HTTP layer talks to (it implements ``EngineClient`` by
delegating to the current :class:`~phalanx.serve.driver.EngineDriver`). When the engine
dies (a rank was killed, a step failed), every request in flight has already failed
with an error naming the rank, ``/health`` answers 503, and the supervisor either
restarts — closes the poisoned engine and its Worker, starts fresh ranks, recovers the
disk tier (warm: its records are disk hits at once) — with at most ``max_restarts`` in
``restart_window`` seconds, or, with ``restart=False`` (``--no-restart``), asks the
server to exit non-zero for a supervisor that restarts the process itself.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from phalanx.engine import SamplingParams
from phalanx.errors import EngineDeadError

from .api.engine_client import Health
from .driver import EngineDriver, RequestStream

__all__ = ["Supervisor"]

log = logging.getLogger("phalanx.serve")


class Supervisor:
    """Owns the current engine driver; restarts it after a death, within a budget."""

    def __init__(self, start: Callable[[Callable[[BaseException], None]], EngineDriver], *,
                 restart: bool, max_restarts: int = 3, restart_window: float = 600.0,
                 on_fatal: Callable[[str], None] | None = None) -> None:
        self._start = start
        self._restart = restart
        self._max_restarts = max_restarts
        self._window = restart_window
        self._on_fatal = on_fatal
        self._restarts: deque[float] = deque()
        self.restart_count = 0
        # Everything below changes under _lock. Each driver is a generation, and its
        # death report names it: a report from a driver already replaced is ignored, and
        # one from the driver a heal is still installing is kept (_pending) and healed
        # once that driver is installed, not dropped (issue 34).
        self._lock = threading.Lock()
        self._closing = False
        self._fatal: str | None = None
        self._restarting: threading.Thread | None = None
        self._generation = 0
        self._pending: BaseException | None = None
        self._driver: EngineDriver | None = start(self._reporter(0))
        self.model_name = self._driver.model_name
        self.max_model_len = self._driver.max_model_len
        self.chat_template = self._driver.chat_template

    def _reporter(self, generation: int) -> Callable[[BaseException], None]:
        return lambda exc: self._died(generation, exc)

    @property
    def driver(self) -> EngineDriver:
        d = self._driver
        if d is None:
            raise EngineDeadError(self._fatal or "the engine is restarting; retry shortly")
        return d

    # -- EngineClient -------------------------------------------------------------------

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.driver.tokenize(text, add_special_tokens)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self.driver.detokenize(token_ids)

    def chat_prompt(self, messages: Sequence[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        return self.driver.chat_prompt(messages, tools)

    def token_text(self, token_id: int) -> str:
        return self.driver.token_text(token_id)

    def generate_many(self, requests: Sequence[tuple[str, list[int], SamplingParams]],
                      n: int = 1) -> list[RequestStream]:
        return self.driver.generate_many(requests, n)

    def fail_inflight(self, reason: str) -> int:
        d = self._driver
        return d.fail_inflight(reason) if d is not None else 0

    def health(self) -> Health:
        if self._fatal is not None:
            return Health(False, self._fatal)
        d = self._driver
        if d is None:
            return Health(False, "the engine died and is restarting",
                          {"restarts": self.restart_count})
        h = d.health()
        return Health(h.ok, h.reason, {**h.detail, "restarts": self.restart_count})

    def stats(self) -> dict[str, Any]:
        d = self._driver
        s = d.stats() if d is not None else {}
        s["engine_restarts"] = self.restart_count
        return s

    # -- death and restart --------------------------------------------------------------

    def _died(self, generation: int, exc: BaseException) -> None:
        """Called on a driver's engine thread when its engine died."""
        with self._lock:
            if self._closing:
                return
            if self._restarting is not None:
                if generation == self._generation + 1:  # the one being installed
                    self._pending = exc
                return
            if generation != self._generation:  # a driver already replaced
                return
            now = time.monotonic()
            while self._restarts and now - self._restarts[0] > self._window:
                self._restarts.popleft()
            if not self._restart:
                self._fatal = f"the engine died and --no-restart is set: {exc}"
            elif len(self._restarts) >= self._max_restarts:
                self._fatal = (f"the engine died {len(self._restarts) + 1} times within "
                               f"{self._window:g} s (limit {self._max_restarts} restarts): "
                               f"{exc}")
            else:
                self._restarts.append(now)
                old, self._driver = self._driver, None
                self._restarting = threading.Thread(
                    target=self._heal, args=(exc, old, generation + 1),
                    name="phalanx-restart", daemon=True)
                self._restarting.start()
                return
        log.error("%s", self._fatal)
        if self._on_fatal is not None:
            self._on_fatal(self._fatal or "")

    def _heal(self, exc: BaseException, old: EngineDriver | None, generation: int) -> None:
        log.warning("engine died (%s); restarting its ranks", exc)
        try:
            if old is not None:
                old.close()
        except Exception as close_exc:  # noqa: BLE001  the old ranks are gone either way
            log.warning("closing the dead engine reported: %s", close_exc)
        driver: EngineDriver | None = None
        try:
            if not self._closing:
                driver = self._start(self._reporter(generation))
        except Exception as start_exc:  # noqa: BLE001  a failed restart is fatal
            with self._lock:
                self._fatal = (f"the engine died ({exc}) and could not be restarted: "
                               f"{start_exc}")
                self._restarting = None
            log.error("%s", self._fatal)
            if self._on_fatal is not None:
                self._on_fatal(self._fatal)
            return
        with self._lock:  # installed, counted and the heal over in one step
            closing = self._closing
            if driver is not None and not closing:
                self._driver = driver
                self._generation = generation
                self.restart_count += 1
            self._restarting = None
            pending, self._pending = self._pending, None
        if driver is None:
            return
        if closing:
            driver.close()
            return
        log.warning("engine restarted (%d restart(s) so far)", self.restart_count)
        if pending is not None:  # it died while it was being installed
            self._died(generation, pending)

    def close(self, timeout: float = 60.0) -> None:
        with self._lock:
            self._closing = True
            restarting = self._restarting
        if restarting is not None:
            restarting.join(timeout)
        d, self._driver = self._driver, None
        if d is not None:
            d.close(timeout)
