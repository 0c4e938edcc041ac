"""phalanx.LLM end to end with real rank processes, against transformers.

A tiny Llama checkpoint written by transformers (tests/engine_oracle.py) with a byte-level
tokenizer. One TP-2 engine serves most tests (starting ranks costs seconds on a loaded
machine); the preemption case has a TP-1 engine with a small pool, the fault case its own
TP-2 engine, which it kills.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_oracle import PROMPT, greedy, hf_reference, write_checkpoint
from phalanx.engine._errors import EngineDeadError, RequestError
from phalanx.engine.core.sampling import SamplingParams
from phalanx.engine.llm import LLM

PT = 16


def _byte_tokenizer(path: Path) -> None:
    """tokenizer.json: a byte-level BPE of 256 byte tokens and no merges (vocab 256)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # the GPT-2 byte order, so id == byte value
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    vocab = {chr(c): b for b, c in zip(bs, cs, strict=True)}
    assert set(vocab) == set(alphabet)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path / "tokenizer.json"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = write_checkpoint(tmp_path_factory.mktemp("llm") / "llama", "llama", seed=3,
                         max_position_embeddings=256)
    _byte_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> Iterator[LLM]:
    with LLM(model_dir, tensor_parallel_size=2, page_tokens=PT, num_pages=160,
             max_num_batched_tokens=96, max_num_seqs=16) as engine:
        yield engine


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> Any:
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    m.eval()  # type: ignore[no-untyped-call]
    return m


def hf_greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=n, min_new_tokens=n)
    return list(out[0, len(prompt):].tolist())


def test_greedy_equals_transformers_at_tp2(llm: LLM, model_dir: Path) -> None:
    _, ref = hf_reference(model_dir, PROMPT, 32)
    (out,) = llm.generate({"prompt_token_ids": PROMPT}, greedy(32))
    c = out.outputs[0]
    assert c.token_ids == ref
    assert c.finish_reason == "length" and out.finished
    assert out.prompt_token_ids == PROMPT


def test_sixteen_requests_join_while_others_decode(llm: LLM, hf_model: Any) -> None:
    system = [(5 * i + 1) % 250 + 3 for i in range(40)]          # 2.5 pages shared
    prompts: list[list[int]] = []
    for i in range(16):
        tail = [(11 * i + j) % 240 + 5 for j in range(3 + (i * 7) % 23)]
        prompts.append(tail if i % 4 == 0 else system + tail)
    lengths = [4 + (i * 5) % 13 for i in range(16)]
    refs = [hf_greedy(hf_model, p, n) for p, n in zip(prompts, lengths, strict=True)]
    # streaming: requests finish at different steps, the rest keep decoding
    finished_at: dict[str, int] = {}
    final = {}
    stream = llm.generate_stream([{"prompt_token_ids": p} for p in prompts],
                                 [greedy(n) for n in lengths])
    for step, out in enumerate(stream):
        if out.finished:
            finished_at[out.request_id] = step
            final[out.request_id] = out
    got = [final[k].outputs[0].token_ids for k in sorted(final, key=int)]
    assert got == refs
    assert len(set(finished_at.values())) > 4
    assert sum(o.num_cached_tokens for o in final.values()) > 0   # the shared system prompt


def test_cached_equals_recomputed_for_fifty_prompts(llm: LLM, hf_model: Any) -> None:
    base = [(3 * i + 7) % 250 + 3 for i in range(70)]
    prompts = [[*base[: 20 + (i * 3) % 50], (i * 13) % 200 + 10, i % 250 + 3]
               for i in range(50)]
    params = greedy(6)
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    second = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    a = [o.outputs[0].token_ids for o in first]
    b = [o.outputs[0].token_ids for o in second]
    assert a == b
    # a repeated prompt computes one token: full pages are hits, the tail is a copy of
    # the first run's partial page (160 pages: nothing the first run kept is evicted)
    assert [o.cached_tokens_memory for o in second] == [len(p) - 1 for p in prompts]
    for i in (0, 17, 49):
        assert a[i] == hf_greedy(hf_model, prompts[i], 6)
    c = llm.counters
    assert c.prompt_memory > 0 and c.prompt_computed > 0


def test_text_prompt_stop_string_and_streaming(llm: LLM) -> None:
    (full,) = llm.generate("Once upon a time", greedy(24))
    text = full.outputs[0].text
    assert full.outputs[0].token_ids and len(text) > 0
    tok = llm.get_tokenizer()
    assert tok is not None
    assert text == tok.decode(full.outputs[0].token_ids)
    # stop at a substring of the greedy text: excluded from the output, as vLLM does
    stop = text[5:8]
    (cut,) = llm.generate("Once upon a time", greedy(24, stop=[stop]))
    c = cut.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == text[: text.find(stop)]
    deltas = [o.outputs[0].delta_text for o in llm.generate_stream("Once upon a time",
                                                                    greedy(24))]
    assert "".join(deltas) == text
    # streamed with a stop string: text that may begin the stop string is held back, so
    # the deltas add up to the cut text, never to a piece of the stop string
    held = [o.outputs[0].delta_text for o in llm.generate_stream(
        "Once upon a time", greedy(24, stop=[stop]))]
    assert "".join(held) == c.text and stop not in "".join(held)


def test_stop_token_ids_eos_and_max_tokens(llm: LLM) -> None:
    (ref,) = llm.generate({"prompt_token_ids": PROMPT}, greedy(12))
    toks = ref.outputs[0].token_ids
    (st,) = llm.generate({"prompt_token_ids": PROMPT}, greedy(12, stop_token_ids=[toks[4]]))
    first = toks.index(toks[4])
    assert st.outputs[0].token_ids == toks[: first + 1]
    assert st.outputs[0].finish_reason == "stop" and st.outputs[0].stop_reason == toks[4]
    # EOS: the engine's eos ids, unless ignore_eos
    eng = llm.engine
    saved = eng.eos_token_ids
    eng.eos_token_ids = (toks[2],)
    try:
        (eos,) = llm.generate({"prompt_token_ids": PROMPT},
                              SamplingParams(temperature=0, max_tokens=12))
        (ign,) = llm.generate({"prompt_token_ids": PROMPT}, greedy(12))
    finally:
        eng.eos_token_ids = saved
    assert eos.outputs[0].token_ids == toks[: toks.index(toks[2]) + 1]
    assert eos.outputs[0].finish_reason == "stop" and eos.outputs[0].stop_reason is None
    assert ign.outputs[0].token_ids == toks


def test_logprobs_and_seeded_sampling(llm: LLM) -> None:
    (lp,) = llm.generate({"prompt_token_ids": PROMPT}, greedy(5, logprobs=3))
    c = lp.outputs[0]
    assert c.logprobs is not None and len(c.logprobs) == 5
    for tok, entry in zip(c.token_ids, c.logprobs, strict=True):
        assert len(entry) == 3 and entry[tok].rank == 1   # greedy: the best one
    assert c.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs, strict=True)))
    hot = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    (alone,) = llm.generate({"prompt_token_ids": PROMPT}, hot)
    others = [{"prompt_token_ids": [9 + i] * (5 + i)} for i in range(3)]
    mixed = llm.generate([*others, {"prompt_token_ids": PROMPT}],
                         [SamplingParams(temperature=0.7, max_tokens=20)] * 3 + [hot])
    assert mixed[3].outputs[0].token_ids == alone.outputs[0].token_ids
    (other_seed,) = llm.generate({"prompt_token_ids": PROMPT},
                                 SamplingParams(temperature=1.0, top_p=0.9, seed=99,
                                                max_tokens=16, ignore_eos=True))
    assert other_seed.outputs[0].token_ids != alone.outputs[0].token_ids


def test_cancelled_stream_frees_its_pages(llm: LLM) -> None:
    pool = llm.engine.scheduler.pool
    stream = llm.generate_stream({"prompt_token_ids": PROMPT}, greedy(100))
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()                       # aborts the request
    assert pool.num_free < pool.num_pages  # freed at the next step, not yet
    (after,) = llm.generate({"prompt_token_ids": [4, 5, 6]}, greedy(2))
    assert after.finished and pool.num_free == pool.num_pages
    assert not llm.engine.has_unfinished()


def test_bad_requests_are_refused(llm: LLM) -> None:
    with pytest.raises(RequestError, match="outside the vocabulary of 256"):
        llm.generate({"prompt_token_ids": [1, 999]}, greedy(2))
    with pytest.raises(RequestError, match="prompt_token_ids"):
        llm.generate({"prompt_token_ids": ["a"]}, greedy(2))
    with pytest.raises(RequestError, match="2 sampling params for 1 prompts"):
        llm.generate("x", [greedy(1), greedy(1)])
    with pytest.raises(RequestError, match="max_model_len=256"):
        llm.generate({"prompt_token_ids": [3] * 256}, greedy(1))
    assert not llm.engine.has_unfinished()


def test_kv_exhaustion_preempts_and_stays_exact(model_dir: Path, hf_model: Any) -> None:
    prompts = [[(7 * i + j) % 250 + 3 for j in range(20 + 9 * i)] for i in range(4)]
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=24, ignore_eos=True)
    with LLM(model_dir, tensor_parallel_size=1, page_tokens=PT, num_pages=10,
             max_num_batched_tokens=64) as small:
        (alone,) = small.generate({"prompt_token_ids": prompts[3]}, seeded)
        assert small.counters.preemptions == 0 and small.reset_prefix_cache()
        outs = small.generate([{"prompt_token_ids": p} for p in prompts],
                              [greedy(24)] * 3 + [seeded])
        assert small.counters.preemptions > 0
        # the newest request was preempted and recomputed: its seeded draws are the same
        assert outs[3].outputs[0].token_ids == alone.outputs[0].token_ids
        outs = outs[:3] + small.generate({"prompt_token_ids": prompts[3]}, greedy(24))
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == hf_greedy(hf_model, p, 24)


def test_a_killed_rank_fails_every_request_and_poisons(model_dir: Path) -> None:
    llm = LLM(model_dir, tensor_parallel_size=2, page_tokens=PT, num_pages=64)
    try:
        stream = llm.generate_stream([{"prompt_token_ids": PROMPT}, {"prompt_token_ids": [7] * 9}],
                                     greedy(50))
        errors = []
        for i, out in enumerate(stream):
            if i == 2:
                llm.engine.executor.worker.arm_failpoint("engine.rank.step", "kill", ranks=[1])
            if out.finished:
                errors.append(out)
        assert len(errors) == 2
        for out in errors:
            assert out.outputs[0].finish_reason == "error"
            assert isinstance(out.error, EngineDeadError) and "rank 1" in str(out.error)
        with pytest.raises(EngineDeadError, match="rank 1"):
            llm.generate({"prompt_token_ids": [1, 2]}, greedy(1))
    finally:
        llm.close()
    llm.close()                           # idempotent


def test_ranks_run_with_one_malloc_arena(llm: LLM) -> None:
    # steps run on whichever serving thread read them; an arena per thread made every
    # step fault its temporaries in afresh (phalanx.engine.worker.local.rank_env)
    outcomes = llm.engine.executor.worker.call_ranks([0, 1], os.getenv, "MALLOC_ARENA_MAX")
    assert {r: o.value for r, o in outcomes.items()} == {0: "1", 1: "1"}


def test_checkpoint_config_is_the_fingerprint(model_dir: Path, llm: LLM) -> None:
    from phalanx.engine.engine import model_fingerprint

    cfg = json.loads((model_dir / "config.json").read_text())
    a = model_fingerprint(model_dir, cfg, 2, PT)
    assert a == model_fingerprint(model_dir, cfg, 2, PT)
    assert a != model_fingerprint(model_dir, cfg, 1, PT)
    assert a != model_fingerprint(model_dir, cfg, 2, 64)
    assert len(llm.engine.fingerprint) == 16


def _shared_prompts(n: int, seed: int) -> list[list[int]]:
    """``n`` prompts over four 'system prompts' of 1-3 pages, with distinct tails."""
    systems = [[(seed * 31 + s * 17 + 7 * i) % 250 + 3 for i in range(16 * (1 + s % 3) + 5)]
               for s in range(4)]
    return [[*systems[i % 4][: 16 * (1 + (i // 4) % 3)], (seed + i * 13) % 240 + 5,
             (i * 7) % 240 + 5] for i in range(n)]


@pytest.mark.slow  # two engines and a disk tier: ~19 s
def test_disk_tier_cached_equals_recomputed(model_dir: Path, tmp_path: Path) -> None:
    prompts = _shared_prompts(50, seed=1)
    refused = _shared_prompts(8, seed=2)
    sp = greedy(5, logprobs=0)
    opts: dict[str, Any] = {"tensor_parallel_size": 2, "page_tokens": PT, "num_pages": 160,
                            "max_num_batched_tokens": 128}
    with LLM(model_dir, enable_prefix_caching=False, **opts) as plain:
        plain_out = plain.generate(_ids(prompts), sp)
        ref = [o.outputs[0].token_ids for o in plain_out]
        ref_refused = [o.outputs[0].token_ids for o in plain.generate(_ids(refused), sp)]
    cache = tmp_path / "cache"
    with LLM(model_dir, prefix_cache_disk=cache, **opts) as llm:
        cold = llm.generate(_ids(prompts), sp)
        assert [o.outputs[0].token_ids for o in cold] == ref
        assert llm.drain_disk_stores(60)
        stats = llm.engine.stats().as_metrics()
        assert stats["cache_disk_stores_pending"] == 0 and stats["disk_tier_stores"] > 0
        assert stats["disk_tier_store_failures"] == 0
        warm = llm.generate(_ids(prompts), sp)                       # memory tier
        assert [o.outputs[0].token_ids for o in warm] == ref
        assert all(o.cached_tokens_memory > 0 for o in warm)
        assert llm.reset_prefix_cache()
        disk = llm.generate(_ids(prompts), sp)                       # disk, same process
        assert [o.outputs[0].token_ids for o in disk] == ref
        assert sum(o.cached_tokens_disk for o in disk) >= 16 * 4
        # the bound (docs/design.md): tokens are identical, logprobs agree to rounding
        # (cached KV was computed in other batches and chunks than the recomputed one)
        assert _max_logprob_gap(plain_out, warm) < LOGPROB_BOUND
        assert _max_logprob_gap(plain_out, disk) < LOGPROB_BOUND
        assert llm.counters.prompt_disk > 0
    with LLM(model_dir, prefix_cache_disk=cache, **opts) as again:   # after a restart
        restarted = again.generate(_ids(prompts), sp)
        assert [o.outputs[0].token_ids for o in restarted] == ref
        assert all(o.cached_tokens_disk > 0 for o in restarted[:4])
        # a disk tier that refuses every store costs misses, never a wrong answer
        again.engine.executor.worker.arm_failpoint("cache.store.temp_opened", "raise")
        out = again.generate(_ids(refused), sp)
        assert [o.outputs[0].token_ids for o in out] == ref_refused
        assert again.drain_disk_stores(60)
        assert again.engine.stats().as_metrics()["disk_tier_store_failures"] > 0
        again.engine.executor.worker.disarm_failpoints()
        assert again.reset_prefix_cache()
        out2 = again.generate(_ids(refused), sp)
        assert [o.outputs[0].token_ids for o in out2] == ref_refused
        # a store that hangs on rank 0: the request did not wait for it, the store is
        # reported pending until it ends (the hang's 5 s bound the check's window)
        again.engine.executor.worker.arm_failpoint("cache.store.temp_opened", "hang:5*1",
                                                ranks=0)
        again.generate(_ids(_shared_prompts(1, seed=3)), sp)
        assert again.engine.stats().as_metrics()["cache_disk_stores_pending"] >= 1
        assert not again.drain_disk_stores(0)
        assert again.drain_disk_stores(60)
        assert again.engine.stats().as_metrics()["cache_disk_stores_pending"] == 0


def _ids(prompts: list[list[int]]) -> list[dict[str, Any]]:
    return [{"prompt_token_ids": p} for p in prompts]


LOGPROB_BOUND = 1e-4


def _max_logprob_gap(a: list[Any], b: list[Any]) -> float:
    gap = 0.0
    for x, y in zip(a, b, strict=True):
        for ex, ey, t in zip(x.outputs[0].logprobs, y.outputs[0].logprobs,
                             x.outputs[0].token_ids, strict=True):
            gap = max(gap, abs(ex[t].logprob - ey[t].logprob))
    return gap


def test_the_embedded_default_model_serves_text_and_chat(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with LLM(tensor_parallel_size=2) as llm:
        assert llm.model_dir.parent == tmp_path / "phalanx" / "models"
        (out,) = llm.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=8))
        c = out.outputs[0]
        assert len(c.token_ids) >= 1 and c.finish_reason in ("stop", "length")
        tok = llm.get_tokenizer()
        assert tok is not None and out.prompt_token_ids == tok.encode("The quick brown fox")
        again = llm.chat([{"role": "user", "content": "hi"}],
                         SamplingParams(temperature=0, max_tokens=4))
        assert again.prompt is not None and "<|im_start|>assistant" in again.prompt
        assert again.finished
