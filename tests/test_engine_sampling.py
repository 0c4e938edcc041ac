"""Sampling: parameter validation, greedy, filtering, seeded determinism, logprobs, stops."""

from __future__ import annotations

import pytest
import torch

from phalanx.engine._errors import SamplingParamsError
from phalanx.engine.core.plan import SamplingSpec
from phalanx.engine.core.sampling import SamplingParams, StopChecker
from phalanx.engine.worker.sampler import sample


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logprobs": 21}, "logprobs"),
        ({"seed": "x"}, "seed"),
    ],
)
def test_invalid_params_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(SamplingParamsError, match=f"SamplingParams.{field}=") as err:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert isinstance(err.value, ValueError)


def test_spec_normalizes_greedy_and_top_k() -> None:
    p = SamplingParams(temperature=0.0, top_k=0, stop="x", seed=5, logprobs=2)
    assert p.greedy and p.stop_strings == ("x",)
    s = p.spec(7)
    assert s == SamplingSpec(temperature=0.0, top_p=1.0, top_k=-1, seed=5, logprobs=2,
                             step_index=7)


def _logits(rows: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 3


def test_greedy_is_argmax() -> None:
    lg = _logits(4)
    toks, lps = sample(lg, [SamplingSpec()] * 4)
    assert toks == lg.argmax(-1).tolist()
    assert lps == [None] * 4


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    lg = _logits(3)
    best = lg.argmax(-1).tolist()
    toks, _ = sample(lg, [SamplingSpec(temperature=1.5, top_k=1)] * 3)
    assert toks == best
    toks, _ = sample(lg, [SamplingSpec(temperature=1.5, top_p=1e-6)] * 3)
    assert toks == best


def test_top_k_limits_the_draws() -> None:
    lg = _logits(1, vocab=40, seed=3)
    allowed = set(torch.topk(lg[0], 5).indices.tolist())
    seen = set()
    for i in range(200):
        toks, _ = sample(lg, [SamplingSpec(temperature=2.0, top_k=5, seed=11, step_index=i)])
        seen.add(toks[0])
    assert seen <= allowed and len(seen) > 1


def test_top_p_keeps_the_nucleus() -> None:
    lg = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen = set()
    for i in range(300):
        toks, _ = sample(lg, [SamplingSpec(temperature=1.0, top_p=0.7, seed=1, step_index=i)])
        seen.add(toks[0])
    assert seen == {0, 1}   # 0.5 < 0.7 so token 1 is in; 0.8 >= 0.7 so token 2 is out


def test_seeded_draws_ignore_batch_composition() -> None:
    lg = _logits(5, seed=9)
    spec = SamplingSpec(temperature=1.0, seed=1234, step_index=3)
    alone, _ = sample(lg[2:3], [spec])
    others = [SamplingSpec(temperature=0.8, seed=None)] * 2
    mixed, _ = sample(lg[[0, 1, 2]], [others[0], others[1], spec])
    assert mixed[2] == alone[0]
    again, _ = sample(lg[2:3], [spec])
    assert again == alone
    # another index of the same seed is another draw (not the same token every step)
    draws = {sample(lg[2:3], [SamplingSpec(temperature=1.0, seed=1234, step_index=i)])[0][0]
             for i in range(40)}
    assert len(draws) > 1


def test_sampling_matches_the_distribution() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1])
    lg = torch.log(probs)[None]
    counts = [0, 0, 0]
    n = 3000
    for i in range(n):
        t = sample(lg, [SamplingSpec(temperature=1.0, seed=7, step_index=i)])[0][0]
        counts[t] += 1
    for c, p in zip(counts, probs.tolist(), strict=True):
        assert abs(c / n - p) < 0.04


def test_logprobs_of_raw_distribution() -> None:
    lg = _logits(2)
    toks, lps = sample(lg, [SamplingSpec(logprobs=3), SamplingSpec(logprobs=0)])
    ref = torch.log_softmax(lg, -1)
    a, b = lps
    assert a is not None and b is not None
    assert a.token == toks[0] and a.logprob == pytest.approx(float(ref[0, toks[0]]))
    assert [t for t, _ in a.top] == torch.topk(ref[0], 3).indices.tolist()
    assert a.top[0][1] == pytest.approx(a.logprob)   # greedy: the chosen one is the best
    assert b.top == []


def test_shape_mismatch_is_refused() -> None:
    with pytest.raises(SamplingParamsError, match="2 specs"):
        sample(_logits(3), [SamplingSpec()] * 2)


def test_stop_checker_finds_strings_across_increments() -> None:
    sc = StopChecker(["END", "\n\n"])
    text = ""
    cut = None
    for piece in ["hello E", "N", "D more"]:
        start = len(text)
        text += piece
        cut = sc.check(text, start)
        if cut is not None:
            break
    assert cut == len("hello ") and sc.matched == "END"
    inc = StopChecker(["END"], include_in_output=True)
    assert inc.check("xxENDyy", 3) == 5
    assert StopChecker([]).check("anything", 0) is None
    assert sc.holdback == 2
