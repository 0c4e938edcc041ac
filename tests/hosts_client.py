"""A client of a multi-host ``phalanx serve``, run inside node 0's namespace (the test's
own process cannot reach the namespaces' addresses). Prints JSON lines.

``answers URL PROMPT``: the same greedy completion twice (the second from the prefix
cache), a streamed chat, ``/health``. ``stream URL``: one long streamed completion,
printing ``{"event": "streaming"}`` at its first token and then how it ended, then
``/health`` until it is not 200 (bounded).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import httpx
import openai


def _emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def answers(url: str, prompt: str) -> None:
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    model = c.models.list().data[0].id
    outs = [c.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
            for _ in range(2)]
    chunks = list(c.chat.completions.create(
        model=model, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}, messages=[{"role": "user", "content": "Hi"}]))
    health = httpx.get(f"{url}/health", timeout=30)
    ids = httpx.post(f"{url}/tokenize", json={"prompt": prompt}, timeout=30).json()["tokens"]
    _emit(event="answers", prompt_ids=ids, records=_stored(url),
          texts=[o.choices[0].text for o in outs],
          cached=[o.usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
                  for o in outs],
          prompt_tokens=outs[0].usage.prompt_tokens,  # type: ignore[union-attr]
          chat="".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices),
          chat_usage=chunks[-1].usage is not None, health=health.status_code)


def _stored(url: str) -> dict[str, float]:
    """Each rank's disk tier records once every rank holds the prompt's (the stores run
    in the background after the answer): rank -> records, read from /metrics."""
    deadline = time.monotonic() + 60
    records: dict[str, float] = {}
    while time.monotonic() < deadline:
        records = {}
        for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
            if line.startswith("phalanx:cache_disk_records{"):
                rank = line.split('rank="', 1)[1].split('"', 1)[0]
                records[rank] = float(line.rsplit(" ", 1)[1])
        if records and min(records.values()) >= 1:
            return records
        time.sleep(0.1)
    return records


def stream(url: str) -> None:
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    model = c.models.list().data[0].id
    started = None
    try:
        for chunk in c.completions.create(model=model, prompt="Once upon a time",
                                          max_tokens=3000, temperature=0, stream=True,
                                          extra_body={"ignore_eos": True}):
            if started is None and chunk.choices and chunk.choices[0].text:
                started = time.monotonic()
                _emit(event="streaming")
        _emit(event="ended", error=None)
    except Exception as exc:  # noqa: BLE001  the test reads how it ended
        _emit(event="ended", error=f"{type(exc).__name__}: {exc}",
              after_s=None if started is None else time.monotonic() - started)
    deadline = time.monotonic() + 30
    status = 200
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{url}/health", timeout=5)
            status = r.status_code
            if status != 200:
                _emit(event="health", status=status, body=r.text)
                return
        except httpx.HTTPError as exc:  # the server exited already
            _emit(event="health", status=None, body=str(exc))
            return
        time.sleep(0.1)
    _emit(event="health", status=status, body="")


if __name__ == "__main__":
    if sys.argv[1] == "answers":
        answers(sys.argv[2], sys.argv[3])
    else:
        stream(sys.argv[2])
