"""A real ``phalanx serve`` process for tests: started, waited for, signalled, reaped."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil

READY = re.compile(r"ready at (http://\S+)")
START_DEADLINE_S = 240.0  # a loaded 2-core machine starting ranks and the disk tier


class Server:
    """``phalanx serve ARGS`` on an ephemeral port; ``stop()`` signals and reaps it."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        cmd = [sys.executable, "-m", "phalanx.serve.cli._main", "serve", "--port", "0", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env={**os.environ, **(env or {})})
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stderr: list[str] = []
        self._readers = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self.lines.put),
                             daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, self.stderr.append),
                             daemon=True),
        ]
        for t in self._readers:
            t.start()
        self.url = self._wait_ready()
        self.client = httpx.Client(base_url=self.url, timeout=120)
        self._openai: dict[str, Any] = {}

    def openai(self, key: str = "unused") -> Any:
        """The official client against this server (closed by ``stop``)."""
        import openai

        if key not in self._openai:
            self._openai[key] = openai.OpenAI(base_url=self.url + "/v1", api_key=key,
                                              max_retries=0, timeout=120)
        return self._openai[key]

    def _close_clients(self) -> None:
        self.client.close()
        for c in self._openai.values():
            c.close()
        self._openai.clear()

    def _reap(self) -> None:
        for t in self._readers:
            t.join(10)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()

    @staticmethod
    def _read(stream: Any, sink: Callable[[Any], None]) -> None:
        for line in stream:
            sink(line)
        sink(None)

    def _wait_ready(self) -> str:
        end = time.monotonic() + START_DEADLINE_S
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, end - time.monotonic()))
            except queue.Empty:
                line = None
            if line is not None:
                m = READY.search(line)
                if m:
                    self.ready_line = line
                    return m.group(1)
                continue
            self.proc.kill()
            self.proc.wait(30)
            self._reap()
            raise AssertionError("phalanx serve did not become ready; stderr:\n"
                                 + "".join(x for x in self.stderr if x)[-4000:])

    def rank_pids(self) -> dict[int, int]:
        """rank -> pid of this server's rank processes (its children running rank_main)."""
        out: dict[int, int] = {}
        for p in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                if "phalanx.runtime.rank_main" in " ".join(p.cmdline()):
                    out[int(p.environ()["PHALANX_RANK"])] = p.pid
            except (psutil.Error, KeyError, ValueError):
                continue
        return out

    def health(self) -> int:
        try:
            return httpx.get(self.url + "/health", timeout=10).status_code
        except httpx.HTTPError:
            return 0

    def metric(self, name: str) -> float:
        text = self.client.get("/metrics").text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def metric_by_label(self, name: str) -> dict[str, float]:
        """label values -> sample of a labelled metric (``rank="0"`` -> 12.0)."""
        out: dict[str, float] = {}
        for line in self.client.get("/metrics").text.splitlines():
            if line.startswith(name + "{"):
                labels, value = line[len(name):].rsplit(" ", 1)
                out[labels] = float(value)
        return out

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 120.0) -> int:
        """Signal the server and wait for it (and its ranks) to exit; its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.wait_exit(timeout)

    def wait_exit(self, timeout: float) -> int:
        """Wait for the server to exit by itself (killed past ``timeout``); its status."""
        self._close_clients()
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(30)
            self._reap()


def pages_prompt(n_words: int, seed: int = 0) -> str:
    """A prompt long enough to fill whole 64-token pages (the cache's unit)."""
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel",
             "india", "juliet", "kilo", "lima", "mike", "november", "oscar", "papa"]
    return " ".join(words[(i * 7 + seed) % len(words)] for i in range(n_words))


def model_env(tmp: Path) -> dict[str, str]:
    """Servers write the embedded model under their own cache home."""
    return {"XDG_CACHE_HOME": str(tmp), "TOKENIZERS_PARALLELISM": "false"}
