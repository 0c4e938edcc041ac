"""``phalanx bench structured`` (issue 46): what a JSON schema costs ``phalanx serve``.

One ``phalanx serve`` on the real model (``phalanx_bench.real_model``, TP 1, the
flags ``phalanx bench llamacpp`` starts it with, no disk tier), greedy, every request a
streamed chat completion (``stream_options.include_usage``: token counts are the
server's ``usage.completion_tokens``). Each case runs both sides, in alternating order
per repeat (``--repeats``, medians):

- ``throughput_tps``: ``--clients`` concurrent clients, each asking for a person record
  as JSON, with ``response_format`` ``json_schema`` (:data:`PERSON`) against the same
  prompts unconstrained: output tokens over the burst's wall time. The constrained
  answer ends at the grammar's end (llguidance allows only EOS there, which ends the
  output even under ``ignore_eos``), so an untimed constrained burst first learns each
  client's answer length, and the unconstrained side asks for exactly that many tokens
  with ``ignore_eos``: both sides generate the same tokens per client;
- ``decode_tps_b1``: one request at a time (the first 3 prompts), constrained against
  unconstrained of the same length: (tokens - 1) / (last token - first token);
- ``grammar_compile_ms``: measured from outside (the compile is not public API): the
  TTFT of a request whose schema the server has not seen (:data:`PERSON` with a
  ``title`` of its own per repeat: the cache key is the canonical source) against one
  whose schema was just used, each prompt unseen so the prompt cache favours neither;
  ``new_schema_cost_ms`` is their difference, what a new schema costs end to end (the
  parent's check and compile plus rank 0's first matcher; llguidance compiles lazily).

The goal: constrained throughput >= 0.9x unconstrained.
"""

from __future__ import annotations

import copy
import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import click

from phalanx.serve.cli import BYTE_SIZE

from ._stats import emit, median
from .llamacpp import decode_rate
from .machine import cpu
from .real_model import fetch
from .serve import (
    PHALANX_EXTRA,
    Timing,
    _client,
    _served_name,
    servers,
    start_phalanx,
    stream,
    summarize,
)

# the burst's schema: a small realistic record (bounded strings and array, an enum)
PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 40},
        "role": {"enum": ["engineer", "teacher", "doctor", "artist", "farmer", "other"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20},
                 "maxItems": 3},
    },
    "required": ["name", "age", "city", "role", "tags"],
    "additionalProperties": False,
}
_JOBS = ["nurse", "welder", "violinist", "chef", "pilot", "librarian", "baker", "potter",
         "geologist", "tailor", "judge", "sailor", "florist", "plumber", "poet", "coach"]
_CITIES = ["Lisbon", "Osaka", "Lagos", "Quito", "Oslo", "Perth", "Hanoi", "Dakar",
           "Austin", "Krakow", "Lima", "Cairo", "Tunis", "Porto", "Seoul", "Bergen"]


def _chat(i: int) -> list[dict[str, str]]:
    job, city = _JOBS[i % len(_JOBS)], _CITIES[(i * 7) % len(_CITIES)]
    return [{"role": "system", "content": "You answer with one JSON object and nothing else."},
            {"role": "user", "content": f"Invent person number {i}: a {job} who lives in "
                                        f"{city}. Give name, age, city, role and tags."}]


def _format(schema: dict[str, Any], name: str = "person") -> dict[str, Any]:
    return {"response_format": {"type": "json_schema", "json_schema": {
        "name": name, "schema": schema, "strict": True}}}


def _burst(url: str, name: str, bodies: list[dict[str, Any]]) -> tuple[list[Timing], float]:
    """``bodies`` as concurrent streamed chat completions released together."""
    gate = threading.Barrier(len(bodies))

    def one(body: dict[str, Any]) -> Timing:
        gate.wait(60)
        return stream(c, url, "/v1/chat/completions", {"model": name, **body})

    with _client(len(bodies)) as c, ThreadPoolExecutor(len(bodies)) as pool:
        t0 = time.perf_counter()
        ts = list(pool.map(one, bodies))
        return ts, time.perf_counter() - t0


def _bodies(chats: list[list[dict[str, str]]], max_tokens: list[int],
            constrained: bool) -> list[dict[str, Any]]:
    fmt = _format(PERSON) if constrained else {}
    return [{"messages": m, "max_tokens": n, **PHALANX_EXTRA, **fmt}
            for m, n in zip(chats, max_tokens, strict=True)]


def _titled(schema: dict[str, Any], title: str) -> dict[str, Any]:
    s = copy.deepcopy(schema)
    s["title"] = title
    return s


def run(gguf: Path, clients: int, max_tokens: int, repeats: int, kv_cache_size: int,
        logs: Path) -> dict[str, Any]:
    chats = [_chat(i) for i in range(clients)]
    flags = ["--max-num-seqs", str(max(16, clients)), "--kv-cache-size", str(kv_cache_size)]
    out: dict[str, Any] = {}
    with servers() as started:
        s = start_phalanx(started, gguf, 1, None, logs / "phalanx.log", flags)
        name = _served_name(s.url)
        # warm-up, untimed: both sides once; the constrained answers' lengths
        learned, _ = _burst(s.url, name, _bodies(chats, [max_tokens] * clients, True))
        lengths = [max(2, t.output_tokens) for t in learned]
        _burst(s.url, name, _bodies(chats, lengths, False))
        sides: dict[str, list[float]] = {"structured": [], "unconstrained": []}
        bursts: dict[str, list[dict[str, Any]]] = {"structured": [], "unconstrained": []}
        b1: dict[str, list[float]] = {"structured": [], "unconstrained": []}
        ttft: dict[str, list[float]] = {"new_schema": [], "cached_schema": []}
        for r in range(repeats):
            order = ["structured", "unconstrained"][:: 1 if r % 2 == 0 else -1]
            for side in order:
                ts, wall = _burst(s.url, name, _bodies(chats, lengths,
                                                       side == "structured"))
                summary = summarize(ts, wall)
                sides[side].append(summary["output_throughput_tps"])
                bursts[side].append(summary)
            for i in range(min(3, clients)):
                for side in order:
                    t = _burst(s.url, name, _bodies(chats[i:i + 1], lengths[i:i + 1],
                                                    side == "structured"))[0][0]
                    b1[side].append(decode_rate([t]))
            # a schema the server has not seen, then the same schema again; each prompt new
            fresh = _format(_titled(PERSON, f"person {os.getpid()} {r}"))
            for case, k in (("new_schema", 1), ("cached_schema", 2)):
                body = {"messages": _chat(1000 + 10 * r + k), "max_tokens": 4,
                        **PHALANX_EXTRA, **fresh}
                t = _burst(s.url, name, [body])[0][0]
                ttft[case].append(t.ttft * 1e3)
    out.update(lengths=lengths, throughput_tps=sides, bursts=bursts, b1=b1, ttft=ttft)
    return out


def shape(raw: dict[str, Any]) -> dict[str, Any]:
    tps = {k: round(median(v), 1) for k, v in raw["throughput_tps"].items()}
    b1 = {k: round(median(v), 1) for k, v in raw["b1"].items()}
    ttft = {k: round(median(v), 1) for k, v in raw["ttft"].items()}
    # throughput: the median of each repeat's ratio (the two bursts of a repeat ran
    # seconds apart, on one machine state; repeats minutes apart differ by more)
    paired = [a / b for a, b in zip(raw["throughput_tps"]["structured"],
                                    raw["throughput_tps"]["unconstrained"], strict=True)]
    ratios = {"throughput": round(median(paired), 3),
              "decode_b1": round(b1["structured"] / b1["unconstrained"], 3)}
    return {
        "throughput_tps": tps, "throughput_tps_all": raw["throughput_tps"],
        "decode_tps_b1": b1,
        "grammar_compile_ms": {
            "new_schema_ttft_ms": ttft["new_schema"],
            "cached_schema_ttft_ms": ttft["cached_schema"],
            "new_schema_cost_ms": round(ttft["new_schema"] - ttft["cached_schema"], 1)},
        "output_tokens_per_client": raw["lengths"],
        "bursts": {k: v[-1] for k, v in raw["bursts"].items()},
        "ratios": ratios,
        "goals": {"throughput_0.9x": ratios["throughput"] >= 0.9},
    }


@click.command("structured")
@click.option("--model", "model_file", default=None,
              type=click.Path(dir_okay=False, exists=True, path_type=Path),
              help="a GGUF file [default: the real test model, SmolLM2-135M-Instruct Q4_1]")
@click.option("--clients", type=click.IntRange(1), default=16, show_default=True)
@click.option("--max-tokens", type=click.IntRange(2), default=64, show_default=True,
              help="the constrained answers' cap (the unconstrained side matches each)")
@click.option("--repeats", type=click.IntRange(1), default=3, show_default=True)
@click.option("--kv-cache-size", default="384M", show_default=True, type=BYTE_SIZE)
@click.option("--logs", default=None, type=click.Path(file_okay=False, path_type=Path),
              help="keep the server's log here [default: a temporary directory]")
@click.option("--quick", is_flag=True, help="tiny sizes (a smoke test): 4 clients, 16 "
                                            "tokens, 1 repeat")
@click.option("--json", "as_json", is_flag=True)
def command(model_file: Path | None, clients: int, max_tokens: int, repeats: int,
            kv_cache_size: int, logs: Path | None, quick: bool, as_json: bool) -> None:
    """Structured outputs (a JSON schema) against unconstrained on the real model:
    16-client throughput, b1 decode, grammar compile time."""
    if quick:
        clients, max_tokens, repeats = 4, 16, 1
    gguf = model_file or fetch()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="phx-bench-structured-") as tmp:
        where = logs or Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        raw = run(gguf, clients, max_tokens, repeats, kv_cache_size, where)
    result = {"cpu": cpu(), "model": gguf.name, **shape(raw)}
    result["setup"] = {"model": str(gguf), "tp": 1, "clients": clients,
                       "max_tokens": max_tokens, "repeats": repeats, "streamed": True,
                       "threads": len(os.sched_getaffinity(0)),
                       "kv_cache_size": kv_cache_size,
                       "loadavg_1m": round(os.getloadavg()[0], 2), "quick": quick,
                       "wall_s": round(time.monotonic() - t0, 1)}
    if not as_json:
        print(f"# CPU: {result['cpu']['model']}, {result['setup']['threads']} threads")
    emit(result, as_json)
