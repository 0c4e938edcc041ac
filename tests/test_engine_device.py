"""The engine's ``device`` option (engine/devices.py): the plan of each rank's device and
TP communicator for any GPU count, and real rank processes on this CPU-only machine.

CUDA itself is not here: ``device="cuda"`` must be refused at start, before a rank
exists, naming why. The local torch.distributed group that TP runs over on CUDA (NCCL)
forms the same way over gloo on CPU (``tp_comm="gloo"``), and that path is run here.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

from engine_oracle import PROMPT, greedy, hf_reference, write_checkpoint
from phalanx.engine.llm import LLM
from phalanx.engine.worker.devices import DevicePlan, plan_devices, resolve_devices
from phalanx.errors import EngineError

PT = 16
NO_CUDA = not torch.cuda.is_available()


# -- the plan (pure) ----------------------------------------------------------------------

@pytest.mark.parametrize(("device", "tp", "count", "comm", "want"), [
    ("cpu", 1, 0, "auto", DevicePlan(("cpu",), "solo")),
    ("cpu", 2, 0, "auto", DevicePlan(("cpu", "cpu"), "shm")),
    ("cpu", 2, 4, "auto", DevicePlan(("cpu", "cpu"), "shm")),   # GPUs there, not asked
    ("cpu", 3, 0, "gloo", DevicePlan(("cpu",) * 3, "gloo")),
    ("cpu", 1, 0, "gloo", DevicePlan(("cpu",), "solo")),
    ("cuda", 1, 1, "auto", DevicePlan(("cuda:0",), "solo")),
    ("cuda", 2, 2, "auto", DevicePlan(("cuda:0", "cuda:1"), "nccl")),
    ("cuda", 2, 8, "nccl", DevicePlan(("cuda:0", "cuda:1"), "nccl")),
    ("cuda:3", 1, 4, "auto", DevicePlan(("cuda:3",), "solo")),
    ("cuda", 2, 1, "gloo", DevicePlan(("cuda:0", "cuda:0"), "gloo")),  # a shared GPU
    ("cuda", 3, 2, "gloo", DevicePlan(("cuda:0", "cuda:1", "cuda:0"), "gloo")),
])
def test_plan_devices(device: str, tp: int, count: int, comm: str, want: DevicePlan) -> None:
    got = plan_devices(device, tp, count, comm)
    assert got == want
    assert got.on_cuda == (device != "cpu")
    assert got.dist == (want.comm in ("gloo", "nccl"))


@pytest.mark.parametrize(("device", "tp", "count", "comm", "says"), [
    ("gpu", 1, 1, "auto", "give 'cpu', 'cuda'"),
    ("cuda:", 1, 1, "auto", "give 'cpu', 'cuda'"),
    ("cuda:-1", 1, 1, "auto", "give 'cpu', 'cuda'"),
    ("CPU", 1, 0, "auto", "give 'cpu', 'cuda'"),
    ("cpu", 2, 0, "mpi", "tp_comm='mpi'"),
    ("cpu", 0, 0, "auto", "tensor_parallel_size=0"),
    ("cpu", 2, 2, "nccl", "NCCL reduces GPU memory only"),
    ("cuda", 1, 0, "auto", "torch.cuda.is_available() is False"),
    ("cuda:0", 2, 0, "auto", "torch.cuda.is_available() is False"),
    ("cuda:2", 1, 2, "auto", "torch sees 2 GPU(s)"),
    ("cuda", 2, 1, "auto", "tensor_parallel_size=2 on CUDA needs 2 GPUs (NCCL takes one "
                           "GPU per rank), but torch sees 1"),
    ("cuda", 4, 3, "nccl", "needs 4 GPUs"),
    ("cuda:1", 2, 4, "auto", "puts all 2 ranks on one GPU"),
    ("cuda", 2, 2, "shm", "host memory only"),
])
def test_plan_devices_refuses(device: str, tp: int, count: int, comm: str, says: str) -> None:
    with pytest.raises(EngineError) as info:
        plan_devices(device, tp, count, comm)
    assert says in str(info.value)


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
def test_resolve_devices_asks_torch() -> None:
    assert resolve_devices("cpu", 2) == DevicePlan(("cpu", "cpu"), "shm")
    with pytest.raises(EngineError, match=r"is_available\(\) is False"):
        resolve_devices("cuda", 1)


# -- real ranks ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("device") / "llama", "llama", seed=5,
                            max_position_embeddings=256)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> list[int]:
    return list(hf_reference(model_dir, PROMPT, 24)[1])


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


@pytest.mark.parametrize("tp", [1, 2])
def test_explicit_cpu_device_serves_as_before(model_dir: Path, reference: list[int],
                                              tp: int) -> None:
    with LLM(model_dir, tensor_parallel_size=tp, page_tokens=PT, num_pages=32,
             device="cpu") as llm:
        assert llm.engine.executor.devices.comm == ("shm" if tp > 1 else "solo")
        assert [m.device for m in llm.engine.executor.memory] == ["cpu"] * tp
        (out,) = llm.generate({"prompt_token_ids": PROMPT}, greedy(24))
    assert out.outputs[0].token_ids == reference


@pytest.mark.slow  # a gloo group of two ranks: ~11 s
def test_tp2_over_a_local_torch_distributed_group(model_dir: Path, reference: list[int],
                                                  tmp_path: Path) -> None:
    """The path TP takes on CUDA (a group of the local ranks on a store the parent holds;
    NCCL there, gloo here), with the disk tier: greedy equals transformers, and a
    reopened engine serves the prompt from disk with the same tokens."""
    opts = {"tensor_parallel_size": 2, "page_tokens": PT, "num_pages": 32,
            "tp_comm": "gloo", "prefix_cache_disk": tmp_path / "disk"}
    with LLM(model_dir, **opts) as llm:   # type: ignore[arg-type]
        assert llm.engine.executor.devices == DevicePlan(("cpu", "cpu"), "gloo")
        (out,) = llm.generate({"prompt_token_ids": PROMPT}, greedy(24))
        assert out.outputs[0].token_ids == reference
        assert llm.drain_disk_stores(60)
    with LLM(model_dir, **opts) as again:   # type: ignore[arg-type]
        (out,) = again.generate({"prompt_token_ids": PROMPT}, greedy(24))
        assert out.outputs[0].token_ids == reference
        assert out.cached_tokens_disk >= PT


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_without_cuda_is_refused_at_start(model_dir: Path, device: str) -> None:
    before = _children()
    with pytest.raises(EngineError, match=r"torch.cuda.is_available\(\) is False"):
        LLM(model_dir, tensor_parallel_size=1, device=device)
    assert _children() <= before        # refused before any rank process existed


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
def test_serve_refuses_cuda_without_cuda() -> None:
    exe = [sys.executable, "-m", "phalanx.serve.cli._main", "serve", "--device", "cuda",
           "--no-prefix-cache-disk", "--port", "0"]
    out = subprocess.run(exe, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "--device" in out.stderr and "is_available() is False" in out.stderr


def test_serve_refuses_a_device_across_hosts() -> None:
    exe = [sys.executable, "-m", "phalanx.serve.cli._main", "serve", "--device", "cuda:0",
           "--nnodes", "2", "--tp", "2", "--no-prefix-cache-disk"]
    out = subprocess.run(exe, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "several hosts run on CPU only" in out.stderr


def test_engine_refuses_a_device_with_hosts(model_dir: Path) -> None:
    from phalanx.engine.engine import Engine, EngineConfig

    with pytest.raises(EngineError, match="several hosts run on CPU"):
        Engine(EngineConfig(model=str(model_dir), device="cuda"), hosts=object())

