"""The engine on a GPU: skipped where torch has no CUDA (CI has none; the CPU side of the
device option is tests/test_engine_device.py). Where one exists: greedy output equals
transformers' on the same GPU in float32 and bfloat16, a reopened disk tier serves a
repeated prompt from disk with the same tokens (its pages pass through host memory),
ranks that share one GPU run TP 2 over gloo, and with two GPUs TP 2 runs over NCCL.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine_oracle import greedy, write_checkpoint
from phalanx.engine.llm import LLM

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="torch has no CUDA here")

PT = 16
NEW = 24
PROMPTS = [[(11 * i + 5 * n) % 250 + 3 for i in range(n)] for n in (5, 37, 64)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("cuda") / "llama", "llama", seed=3,
                            max_position_embeddings=256)


_HF_GREEDY = """
import json, sys
import torch, transformers
path, dtype, new, prompts = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
model = transformers.AutoModelForCausalLM.from_pretrained(
    path, dtype=getattr(torch, dtype)).to("cuda:0").eval()
outs = []
with torch.no_grad():
    for p in prompts:
        ids = torch.tensor([p], device="cuda:0")
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=new, min_new_tokens=new)
        outs.append(out[0, len(p):].tolist())
print(json.dumps(outs))
"""


def hf_greedy(model_dir: Path, dtype: str) -> list[list[int]]:
    """transformers' greedy continuations of PROMPTS on cuda:0, in a process of its own:
    this one never holds a CUDA context (its device fds would read as a leak)."""
    out = subprocess.run([sys.executable, "-c", _HF_GREEDY, str(model_dir), dtype,
                          str(NEW), json.dumps(PROMPTS)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got: list[list[int]] = json.loads(out.stdout.strip().splitlines()[-1])
    return got


def engine_greedy(model_dir: Path, **opts: object) -> list[list[int]]:
    with LLM(model_dir, page_tokens=PT, num_pages=64, **opts) as llm:  # type: ignore[arg-type]
        assert all(m.device.startswith("cuda:") for m in llm.engine.executor.memory)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(NEW))
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_equals_transformers_on_the_gpu(model_dir: Path, dtype: str) -> None:
    want = hf_greedy(model_dir, dtype)
    assert engine_greedy(model_dir, tensor_parallel_size=1, device="cuda",
                         dtype=dtype) == want


def test_a_reopened_disk_tier_serves_the_gpu(model_dir: Path, tmp_path: Path) -> None:
    opts = {"tensor_parallel_size": 1, "device": "cuda:0", "page_tokens": PT,
            "num_pages": 64, "prefix_cache_disk": tmp_path / "disk"}
    prompt = {"prompt_token_ids": PROMPTS[2]}
    with LLM(model_dir, **opts) as llm:   # type: ignore[arg-type]
        (first,) = llm.generate(prompt, greedy(NEW))
        assert llm.drain_disk_stores(60)
    with LLM(model_dir, **opts) as again:   # type: ignore[arg-type]
        (out,) = again.generate(prompt, greedy(NEW))
    assert out.outputs[0].token_ids == first.outputs[0].token_ids
    assert out.cached_tokens_disk >= PT


def test_tp2_with_ranks_sharing_a_gpu_over_gloo(model_dir: Path) -> None:
    assert engine_greedy(model_dir, tensor_parallel_size=2, device="cuda",
                         tp_comm="gloo") == hf_greedy(model_dir, "float32")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL takes one GPU per rank")
def test_tp2_over_nccl(model_dir: Path) -> None:
    assert engine_greedy(model_dir, tensor_parallel_size=2,
                         device="cuda") == hf_greedy(model_dir, "float32")
