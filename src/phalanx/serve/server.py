"""``phalanx serve``: the engine, supervised, behind the HTTP API on uvicorn.

Start-up: the model directory (the embedded default when none is given), the engine
(ranks started, weights sliced, the disk tier recovered and reconciled), then the
socket is bound and one line says the server is ready. Shutdown on SIGINT / SIGTERM:
uvicorn stops admitting and gives in-flight requests ``shutdown_timeout`` seconds, then
the engine and its Worker are closed, and the process exits 0 leaving nothing behind.
A dead engine with ``restart=False`` ends the process with exit status 1.

ASGI stack: Starlette (routing, requests, streaming responses) on uvicorn (HTTP/1.1,
signals, graceful shutdown) with the deadlines of ``serve/http.py``; see
docs/design.md for why.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .api.app import ServeSettings, build_app
from .api.metrics import Metrics
from .api.state import ServerInfo
from .driver import EngineDriver
from .supervisor import Supervisor

__all__ = ["ServerConfig", "default_cache_dir", "listen_socket", "run_server"]

log = logging.getLogger("phalanx.serve")


def default_cache_dir(model: str | Path, tp: int) -> Path:
    """The disk tier's directory when none is given: one per model path and TP size
    under the user's cache dir. A store refuses a directory written for another model
    or TP size (its manifest), so one shared default made a user who switched models
    pass --prefix-cache-disk; a file changed in place is still refused (phalanx serve
    says so in one line)."""
    import hashlib

    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    path = Path(model).resolve()
    tag = hashlib.blake2b(str(path).encode(), digest_size=4).hexdigest()
    return Path(base) / "phalanx" / "prefix-cache" / f"{path.name}-tp{tp}-{tag}"


@dataclass(frozen=True)
class ServerConfig:
    model: str | None = None
    tensor_parallel_size: int = 2
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    max_waiting: int = 256
    dtype: str | None = None
    device: str = "cpu"                      # "cpu", "cuda" or "cuda:N"
    kv_cache_bytes: int = 256 << 20
    prefix_cache_disk: str | None = None     # None: default_cache_dir(...); "": disabled
    prefix_cache_disk_bytes: int = 4 << 30
    prefix_cache_max_age: float | None = None
    restart: bool = True
    max_restarts: int = 3
    shutdown_timeout: float = 30.0
    max_body_bytes: int = 4 << 20
    header_timeout: float = 10.0             # a request's head must arrive within this
    max_connections: int = 1024              # beyond: 503 (uvicorn's limit_concurrency)
    web_ui: bool = True                      # GET / serves the page (False: a 404)


def _model_dir(cfg: ServerConfig) -> Path:
    if cfg.model is not None:
        return Path(cfg.model)
    from phalanx.engine.model.default_model import default_model_dir

    return Path(default_model_dir())


def _disk_off(cfg: ServerConfig) -> bool:
    return cfg.prefix_cache_disk == ""


def _disk_dir(cfg: ServerConfig) -> str | None:
    if _disk_off(cfg):
        return None
    path = (Path(cfg.prefix_cache_disk) if cfg.prefix_cache_disk
            else default_cache_dir(_model_dir(cfg), cfg.tensor_parallel_size))
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return str(path)


def _starter(cfg: ServerConfig, model_dir: Path, name: str, hosts: Any = None
             ) -> Callable[[Callable[[BaseException], None]], EngineDriver]:
    def start(on_death: Callable[[BaseException], None]) -> EngineDriver:
        from phalanx.engine import Engine, EngineConfig
        from phalanx.engine.model.tokenizer import Tokenizer

        tokenizer = Tokenizer(model_dir)
        engine = Engine(EngineConfig(
            model=str(model_dir), tensor_parallel_size=cfg.tensor_parallel_size,
            max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=cfg.max_model_len, dtype=cfg.dtype, kv_cache_bytes=cfg.kv_cache_bytes,
            prefix_cache_disk=_disk_dir(cfg),
            prefix_cache_disk_bytes=cfg.prefix_cache_disk_bytes,
            prefix_cache_max_age=cfg.prefix_cache_max_age, device=cfg.device,
        ), tokenizer, eos_token_ids=None, hosts=hosts)
        return EngineDriver(engine, tokenizer, name,
                            max_pending=cfg.max_num_seqs + cfg.max_waiting, on_death=on_death)
    return start


def listen_socket(host: str, port: int) -> socket.socket:
    """The server's TCP socket, bound (uvicorn listens on it).

    Created with ``IPPROTO_TCP`` named, not 0: asyncio turns Nagle's algorithm off
    (``TCP_NODELAY``) only on accepted sockets whose protocol says TCP. With it on, a
    kept-alive connection's response waited for the client's delayed ACK of its
    headers before the first event went out: every request after the first on one
    connection (the ``openai`` client keeps them) reached its first token 40 ms late
    (docs/design.md, "Nagle's algorithm on the server's connections")."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                         socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def run_server(cfg: ServerConfig, *, ready: Callable[[str], None] | None = None,
               hosts: Any = None) -> int:
    """Serve until a signal (exit 0) or a fatal engine death (exit 1). ``hosts``: node 0's
    :class:`~phalanx.hosts.MultiHostWorker` when the ranks span hosts (serve/multihost.py)."""
    from .http import HttpServer

    model_dir = _model_dir(cfg)
    name = cfg.served_model_name or _served_name(model_dir)
    state = _RunState()
    with _signals_stop(state):  # from the start: a signal during start-up stops it too
        supervisor = Supervisor(_starter(cfg, model_dir, name, hosts), restart=cfg.restart,
                                max_restarts=cfg.max_restarts, on_fatal=state.fatal)
        try:
            if state.stop_requested:
                return 0
            sock = listen_socket(cfg.host, cfg.port)
            host, port = sock.getsockname()[:2]
            metrics = Metrics(name)
            info = ServerInfo(
                tensor_parallel_size=cfg.tensor_parallel_size,
                nnodes=hosts.spec.nnodes if hosts is not None else 1,
                disk_capacity_bytes=0 if _disk_off(cfg) else cfg.prefix_cache_disk_bytes)
            settings = ServeSettings(served_model_name=name, api_key=cfg.api_key,
                                     max_body_bytes=cfg.max_body_bytes,
                                     max_prompts=cfg.max_num_seqs + cfg.max_waiting,
                                     info=info, web_ui=cfg.web_ui)
            line = _ready_line(f"http://{host}:{port}", name, cfg, supervisor)

            @asynccontextmanager
            async def lifespan(app: Any) -> AsyncIterator[None]:
                (ready or _print)(line)
                yield

            app = build_app(supervisor, settings, metrics, lifespan=lifespan)
            state.server = HttpServer(
                app, header_timeout=cfg.header_timeout, max_connections=cfg.max_connections,
                shutdown_timeout=cfg.shutdown_timeout,
                fail_inflight=supervisor.fail_inflight)
            if not state.stop_requested:
                state.server.run(sockets=[sock])
            sock.close()
        finally:
            supervisor.close(cfg.shutdown_timeout)
    return state.exit_code


class _RunState:
    """What the signal handler and the supervisor tell the serving thread."""

    def __init__(self) -> None:
        self.server: Any = None
        self.stop_requested = False
        self.exit_code = 0

    def stop(self) -> None:
        self.stop_requested = True
        if self.server is not None:
            self.server.should_exit = True

    def fatal(self, reason: str) -> None:
        self.exit_code = 1
        self.stop()


@contextmanager
def _signals_stop(state: _RunState) -> Iterator[None]:
    """SIGINT / SIGTERM ask the server to stop, before and after uvicorn's own handlers.

    uvicorn handles both while it serves, then restores the handlers it found and raises
    the signal it caught again; with the default handler that would kill the process
    before the engine and its ranks are closed. Ours only asks the server to stop, so
    the close always runs and the process exits 0.
    """
    def stop(signum: int, frame: Any) -> None:
        state.stop()

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _served_name(model_dir: Path) -> str:
    """The model's name clients send: a checkpoint's directory name (a GGUF file's name
    without .gguf); the embedded model's name without its digest suffix."""
    name = model_dir.name.removesuffix(".gguf")
    head, _, tail = name.rpartition("-")
    if head and len(tail) == 16 and all(c in "0123456789abcdef" for c in tail):
        return head
    return name


def _print(line: str) -> None:
    print(line, flush=True)


def _ready_line(url: str, name: str, cfg: ServerConfig, supervisor: Supervisor) -> str:
    stats = supervisor.stats()
    records = stats.get("cache_disk_records") or {}
    disk = (f"disk tier {sum(records.values()) // max(1, len(records))} records recovered "
            f"per rank" if records else "disk tier off" if cfg.prefix_cache_disk == ""
            else "disk tier empty")
    weights = stats.get("rank_weight_bytes") or {}
    rss = stats.get("rank_resident_bytes") or {}
    memory = (f", per rank {max(weights.values()) / 2**20:.0f} MiB weights, "
              f"{max(rss.values()) / 2**20:.0f} MiB resident" if weights and rss else "")
    return (f"phalanx serve: ready at {url} — model {name!r}, "
            f"{cfg.tensor_parallel_size} rank(s) (tensor parallel){memory}, memory tier "
            f"{stats.get('kv_pages_total', '?')} pages, {disk}")


def main_entry(cfg: ServerConfig) -> None:
    code = run_server(cfg)
    sys.exit(code)
