"""The failpoint sweep's engine and serve scenarios (tests/test_failpoint_sweep.py's
COVERS): each drives a real engine or server through the public operation that passes
its point."""

from __future__ import annotations

from pathlib import Path

from phalanx.lifecycle import failpoints
from sweep_checks import Problems, attempt, reached


def engine_points(points: list[str], tmp: Path) -> Problems:
    """The disk tier's lookup faults with phalanx's own error: that prompt is a miss
    (computed, the same tokens), the engine lives, the next repeat is a disk hit."""
    from phalanx.engine import LLM, SamplingParams
    from phalanx.engine.model.default_model import default_model_dir

    (point,) = points
    prompt = {"prompt_token_ids": [(7 * i + 3) % 200 + 3 for i in range(3 * 16 + 1)]}
    sp = SamplingParams(max_tokens=3, temperature=0)
    p: list[str] = []
    with LLM(default_model_dir(), tensor_parallel_size=1, page_tokens=16, num_pages=32,
             prefix_cache_disk=tmp / "cache") as llm:
        (ref,) = llm.generate(prompt, sp)
        tier = llm.engine.disk_tier
        assert tier is not None and tier.drain(60)
        llm.reset_prefix_cache()
        failpoints.arm(point, "raise*1")
        try:
            (out,) = llm.generate(prompt, sp)
        except Exception as exc:  # noqa: BLE001  inspected: the point must not fail it
            p.append(f"the faulted lookup failed the request: {exc!r}")
        else:
            if out.outputs[0].token_ids != ref.outputs[0].token_ids or out.cached_tokens_disk:
                p.append("the faulted lookup changed the output or counted a disk hit")
        finally:
            failpoints.disarm_all()
        if tier.stats.load_failures != 1:
            p.append(f"{tier.stats.load_failures} lookup failures counted, not 1")
        llm.reset_prefix_cache()
        (again,) = llm.generate(prompt, sp)
        if again.cached_tokens_disk != 3 * 16:
            p.append(f"the next repeat found {again.cached_tokens_disk} tokens on disk")
    return {point: p}


def rank_step_points(points: list[str], tmp: Path) -> Problems:
    """A rank faults on a step it read from the step channel: the step fails naming the
    point and the rank, the engine is dead (a rank's step failure is its death), and it
    closes cleanly, leaving nothing. One rank: with two, the survivor's step waits out
    its collective's deadline (30 s) before the close can take its runner (the parent
    fails the step at once either way)."""
    from phalanx.engine import LLM, SamplingParams
    from phalanx.engine.model.default_model import default_model_dir

    (point,) = points
    rank = 0
    sp = SamplingParams(max_tokens=3, temperature=0)
    with LLM(default_model_dir(), tensor_parallel_size=1) as llm:
        llm.generate("before", sp)
        llm.engine.executor.worker.arm_failpoint(point, "raise*1", ranks=[rank])
        p = reached(point, rank, attempt(llm.generate, "faulted", sp))
        if llm.engine.dead is None:
            p.append("the engine serves on after a rank failed a step")
    return {point: p}


def serve_points(points: list[str], tmp: Path) -> Problems:
    """A request faults at admission: it fails naming the point, the next is served."""
    import asyncio

    from phalanx.engine import SamplingParams
    from phalanx.engine.model.default_model import default_model_dir
    from phalanx.serve.server import ServerConfig, _starter

    (point,) = points
    cfg = ServerConfig(tensor_parallel_size=1, prefix_cache_disk="", max_num_seqs=2)
    driver = _starter(cfg, Path(default_model_dir()), "seeded")(lambda exc: None)

    async def one(rid: str) -> list[int]:
        out: list[int] = []
        sp = SamplingParams(max_tokens=3, temperature=0)
        async for d in driver.generate(rid, [5, 6, 7, 8], sp):
            out += d.token_ids
        return out

    try:
        failpoints.arm(point, "raise*1")
        p = reached(point, None, attempt(asyncio.run, one("a")))
        failpoints.disarm_all()
        served = asyncio.run(one("b"))
        if len(served) != 3 or not driver.health().ok:
            p.append(f"the next request got {served}, health {driver.health()}")
    finally:
        failpoints.disarm_all()
        driver.close()
    return {point: p}


def api_points(points: list[str], tmp: Path) -> Problems:
    """A large prompt's tokenization (off the event loop) faults: the request fails
    naming the point, the next large one is tokenized. The HTTP app in this process."""
    import asyncio

    import httpx

    from phalanx.engine.model.default_model import default_model_dir
    from phalanx.serve.api.app import ServeSettings, build_app
    from phalanx.serve.api.metrics import Metrics
    from phalanx.serve.server import ServerConfig, _starter

    (point,) = points
    cfg = ServerConfig(tensor_parallel_size=1, prefix_cache_disk="", max_num_seqs=2)
    driver = _starter(cfg, Path(default_model_dir()), "seeded")(lambda exc: None)
    app = build_app(driver, ServeSettings("seeded"), Metrics("seeded"))
    big = "word " * 10_000  # over the off-loop threshold

    async def one() -> int:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://sweep") as client:
            r = await client.post("/tokenize", json={"prompt": big})
            return r.status_code

    try:
        failpoints.arm(point, "raise*1")
        p = reached(point, None, attempt(asyncio.run, one()))
        failpoints.disarm_all()
        status = asyncio.run(one())
        if status != 200 or not driver.health().ok:
            p.append(f"the next request got {status}, health {driver.health()}")
    finally:
        failpoints.disarm_all()
        driver.close()
    return {point: p}
