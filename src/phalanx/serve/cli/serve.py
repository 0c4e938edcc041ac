"""``phalanx serve [MODEL_DIR]``: the OpenAI-compatible server (flags as vLLM names them)."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, NoReturn

import click

from .params import BYTE_SIZE

if TYPE_CHECKING:
    from phalanx.serve.server import ServerConfig

# Sizes of the embedded reference model (written on first use, same bytes everywhere).
MODEL_SIZES = {
    "tiny": {},  # the embedded default
    "small": {"name": "phalanx-small", "layers": 8, "hidden": 512, "heads": 8,
              "kv_heads": 4, "intermediate": 1376},
}




def _embedded(size: str) -> str:
    from phalanx.engine.model.default_model import ModelSpec, default_model_dir

    return str(default_model_dir(spec=ModelSpec(**MODEL_SIZES[size])))  # type: ignore[arg-type]


@click.command("serve")
@click.argument("model_dir", required=False, type=click.Path(exists=True))
@click.option("--tensor-parallel-size", "--tp", "tp", default=2, show_default=True,
              type=click.IntRange(1),
              help="rank processes the model is split across")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@click.option("--api-key", default=None, envvar="PHALANX_API_KEY",
              help="require 'Authorization: Bearer KEY' (also $PHALANX_API_KEY)")
@click.option("--served-model-name", default=None, help="the model name clients send")
@click.option("--max-model-len", default=None, type=click.IntRange(1),
              help="context length (prompt + output)")
@click.option("--max-num-seqs", default=16, show_default=True, type=click.IntRange(1),
              help="requests in the running batch")
@click.option("--max-num-batched-tokens", default=512, show_default=True, type=click.IntRange(1))
@click.option("--max-waiting", default=256, show_default=True, type=click.IntRange(0),
              help="requests queued beyond the batch before a 503")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
              default="auto", show_default=True)
@click.option("--device", default="cpu", show_default=True,
              help="cpu, cuda (rank r on GPU r; TP over NCCL) or cuda:N")
@click.option("--kv-cache-size", default="256M", show_default=True, type=BYTE_SIZE,
              help="KV memory per rank (the memory tier)")
@click.option("--prefix-cache-disk", default=None, type=click.Path(file_okay=False),
              help="the persistent prefix cache's directory [default: the user's cache dir]")
@click.option("--prefix-cache-disk-size", default="4G", show_default=True, type=BYTE_SIZE,
              help="its capacity per rank")
@click.option("--prefix-cache-max-age", default=None, type=click.FloatRange(0, min_open=True),
              help="seconds")
@click.option("--no-prefix-cache-disk", is_flag=True, help="memory tier only")
@click.option("--model-size", type=click.Choice(sorted(MODEL_SIZES)), default="tiny",
              show_default=True, help="size of the embedded model (no MODEL_DIR)")
@click.option("--no-restart", is_flag=True,
              help="exit non-zero when a rank dies instead of restarting the ranks")
@click.option("--shutdown-timeout", default=30.0, show_default=True, type=click.FloatRange(0),
              help="seconds in-flight requests get at SIGTERM")
@click.option("--header-timeout", default=10.0, show_default=True,
              type=click.FloatRange(0, min_open=True),
              help="seconds a connection has to send a request's headers (then 408)")
@click.option("--max-connections", default=1024, show_default=True, type=click.IntRange(1),
              help="open connections; requests beyond them are answered 503")
@click.option("--no-web-ui", is_flag=True,
              help="no page at GET / (a 404); the API and /state are unchanged")
@click.option("--nnodes", default=1, show_default=True, type=click.IntRange(1),
              help="hosts the ranks span (each runs tp / nnodes ranks)")
@click.option("--node-rank", default=0, show_default=True, type=click.IntRange(0),
              help="this host's rank: 0 serves HTTP, the others run headless")
@click.option("--master-addr", default="127.0.0.1", show_default=True,
              help="node 0's address (the job's rendezvous and store)")
@click.option("--master-port", default=29500, show_default=True, type=click.IntRange(1, 65535))
def serve(model_dir: str | None, tp: int, host: str, port: int, api_key: str | None,
          served_model_name: str | None, max_model_len: int | None, max_num_seqs: int,
          max_num_batched_tokens: int, max_waiting: int, dtype: str, device: str,
          kv_cache_size: int,
          prefix_cache_disk: str | None, prefix_cache_disk_size: int,
          prefix_cache_max_age: float | None, no_prefix_cache_disk: bool, model_size: str,
          no_restart: bool, shutdown_timeout: float, header_timeout: float,
          max_connections: int, no_web_ui: bool, nnodes: int, node_rank: int,
          master_addr: str, master_port: int) -> None:
    """Serve MODEL_DIR (a Hugging Face checkpoint directory or a GGUF file; the embedded
    model by default; a GGUF file's Q4_0/Q4_1/Q8_0 weights stay quantized unless --dtype
    names a type to dequantize them to) over an
    OpenAI-compatible HTTP API, tensor-parallel across rank processes, with a prefix cache
    kept in memory and on disk (identical on every rank, alive across restarts)."""
    from phalanx.serve.server import ServerConfig, default_cache_dir

    if tp < 1:
        raise click.BadParameter(f"{tp}: must be >= 1", param_hint="--tensor-parallel-size")
    if prefix_cache_disk and no_prefix_cache_disk:
        raise click.UsageError("--prefix-cache-disk and --no-prefix-cache-disk contradict")
    _check_device(device, tp, nnodes)
    if model_dir is not None:
        _check_model(model_dir, tp, None if dtype == "auto" else dtype, max_model_len)
    model = model_dir or _embedded(model_size)
    disk = None if no_prefix_cache_disk else str(prefix_cache_disk
                                                  or default_cache_dir(model, tp))
    if disk is not None:
        _check_disk_dir(disk, _local_ranks(tp, nnodes, node_rank))
    cfg = ServerConfig(
        model=model, tensor_parallel_size=tp, host=host,
        port=port, api_key=api_key or None, served_model_name=served_model_name,
        max_model_len=max_model_len, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, max_waiting=max_waiting,
        dtype=None if dtype == "auto" else dtype, device=device,
        kv_cache_bytes=kv_cache_size,
        prefix_cache_disk="" if no_prefix_cache_disk else prefix_cache_disk,
        prefix_cache_disk_bytes=prefix_cache_disk_size,
        prefix_cache_max_age=prefix_cache_max_age, restart=not no_restart,
        shutdown_timeout=shutdown_timeout, header_timeout=header_timeout,
        max_connections=max_connections, web_ui=not no_web_ui,
    )
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(_run(cfg, disk, nnodes, node_rank, master_addr, master_port))


def _run(cfg: ServerConfig, disk: str | None, nnodes: int, node_rank: int,
         master_addr: str, master_port: int) -> int:
    """Serve; the exit status. A disk-tier directory that fails while the ranks open
    their stores (changed since ``_check_disk_dir``) is the same one line, exit 2."""
    from phalanx.kvstore import ForeignStoreError, GeometryMismatchError
    from phalanx.serve import server

    try:
        if nnodes > 1:
            from phalanx.serve.multihost import JobSpec, serve_job

            return serve_job(cfg, JobSpec(nnodes, node_rank, master_addr, master_port))
        return server.run_server(cfg)
    except OSError as exc:
        if disk is None or not _is_under(exc.filename, disk):
            raise
        _refuse_disk(exc.filename, exc)
    except (ForeignStoreError, GeometryMismatchError) as exc:
        # a directory written for another model, dtype, TP or page size: a rank's store
        # refused it at open (a traceback of the rank's and the parent's before)
        click.echo(f"phalanx serve: --prefix-cache-disk {disk}: {exc}", err=True)
        sys.exit(2)


def _local_ranks(tp: int, nnodes: int, node_rank: int) -> range:
    """The ranks this host runs: all of them, or its tp / nnodes on several hosts
    (none when tp does not split: serve_job refuses that itself)."""
    if tp % nnodes:
        return range(0)
    per_node = tp // nnodes
    return range(node_rank * per_node, (node_rank + 1) * per_node)


def _check_disk_dir(directory: str, ranks: range) -> None:
    """Refuse a disk-tier directory this host's ranks cannot write, in one line naming
    the path and the errno, before any rank starts: a rank's store found it at open,
    under a traceback of the rank's and the parent's (79 lines, the path in the last).
    Creates DIR and DIR/rank-<i> (0700, as the store does) and writes a probe file in
    each, since only a real write sees a read-only mount, an immutable directory or a
    full disk (root passes ``os.access`` whatever the modes)."""
    from phalanx.replication import rank_directories

    paths = [directory, *(rank_directories(directory, ranks.stop)[r] for r in ranks)]
    for path in paths:
        try:
            _probe_dir(path)
        except OSError as exc:
            _refuse_disk(path, exc)


def _probe_dir(path: str) -> None:
    """Create ``path`` if missing and prove a file can be created and removed in it.
    The probe is named as the store's temp files are (``.*.tmp``): one left behind by
    a kill is purged by the store's recovery."""
    import errno
    import tempfile

    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except FileExistsError:  # something that is not a directory is there
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path) from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
    fd, probe = tempfile.mkstemp(prefix=".phalanx-probe-", suffix=".tmp", dir=path)
    os.close(fd)
    os.unlink(probe)


def _is_under(path: object, directory: str) -> bool:
    if not isinstance(path, str):
        return False
    real, top = os.path.abspath(path), os.path.abspath(directory)
    return real == top or real.startswith(top.rstrip(os.sep) + os.sep)


def _refuse_disk(path: str, exc: OSError) -> NoReturn:
    """The command's one line for a disk-tier directory it cannot use; exit 2, as every
    bad input of the command line."""
    click.echo(f"phalanx serve: --prefix-cache-disk {path}: cannot write (errno "
               f"{exc.errno}, {exc.strerror}): give a writable directory, or "
               f"--no-prefix-cache-disk", err=True)
    sys.exit(2)


def _check_model(model: str, tp: int, dtype: str | None, max_model_len: int | None) -> None:
    """Refuse a model that cannot be served, in one line naming the file and why, before
    any rank starts: its config or GGUF metadata, a TP size it cannot be split by (the
    sizes that work named), a missing tokenizer or weights, a truncated file."""
    from phalanx.engine.model.checkpoint import open_checkpoint
    from phalanx.engine.model.config import load_config
    from phalanx.engine.model.tokenizer import Tokenizer
    from phalanx.errors import EngineError

    try:
        cfg = load_config(model, max_model_len=max_model_len, dtype=dtype)
        try:
            cfg.check_tp(tp)
        except EngineError as exc:
            raise type(exc)(f"{model}: {exc}") from None
        Tokenizer(model)
        open_checkpoint(model).close()
    except EngineError as exc:
        click.echo(f"phalanx serve: {exc}", err=True)
        sys.exit(2)


def _check_device(device: str, tp: int, nnodes: int) -> None:
    """Refuse a device the ranks cannot run on before anything starts (the engine would
    refuse it too, under a traceback)."""
    from phalanx.engine.worker.devices import resolve_devices
    from phalanx.errors import EngineError

    if nnodes > 1 and device != "cpu":
        raise click.BadParameter(f"{device}: ranks on several hosts run on CPU only",
                                 param_hint="--device")
    try:
        resolve_devices(device, tp)
    except EngineError as exc:
        raise click.BadParameter(str(exc), param_hint="--device") from None
