"""The soak benchmark's requests: a fixed mix over plain ``http.client``.

Standard library only, on purpose: a disconnect mid-stream must close the very socket
after the first chunk (no client pool in between deciding to drain it or keep it), a
malformed body must go out byte for byte, and phalanx's core dependencies have no HTTP
client (httpx is the bench extra's, for the other benchmarks).

The mix is a schedule of the request index (the same for every run and seed): every
100th request at offset 50 is a bad one (unknown model, malformed JSON, max_tokens over
the context, in turn), every 10th at offset 5 is streamed (16-64 tokens, EOS ignored)
and dropped after its first chunk, the rest are short chat or completion requests,
streamed or not, with 1-8 output tokens; the seed varies their prompts and sampling.
"""

from __future__ import annotations

import http.client
import json
import random
from dataclasses import dataclass

__all__ = ["Client", "Outcome", "Request", "plan"]

_WORDS = ("the", "a", "cat", "river", "stone", "light", "quiet", "morning", "city",
          "sings", "runs", "over", "under", "green", "old", "story", "of", "and")
_BAD = ("unknown_model", "malformed_json", "over_context")
_BAD_STATUS = {"unknown_model": 404, "malformed_json": 400, "over_context": 400}


@dataclass(frozen=True)
class Request:
    """One request of the mix: where it goes, its body, and how the client reads it."""

    index: int
    kind: str  # "chat", "completion", "disconnect", or one of _BAD
    route: str
    body: bytes
    stream: bool

    @property
    def bad(self) -> bool:
        return self.kind in _BAD_STATUS

    @property
    def expected_status(self) -> int:
        return _BAD_STATUS.get(self.kind, 200)


@dataclass(frozen=True)
class Outcome:
    """What the client saw: the status (0: no response), and whether the body was whole
    (a complete JSON reply, or a stream ending in ``data: [DONE]``; a disconnect counts
    as whole once its first chunk came)."""

    status: int
    whole: bool
    error: str = ""


def plan(index: int, model: str, seed: int) -> Request:
    """Request ``index`` of the mix."""
    rng = random.Random(seed * 1_000_003 + index)
    prompt = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 12)))
    chat = rng.random() < 0.5
    body: dict[str, object] = {"model": model, "max_tokens": rng.randint(1, 8)}
    if rng.random() < 0.5:
        body["temperature"] = 0.0
    else:
        body.update(temperature=1.0, top_p=0.9, seed=rng.randint(0, 1 << 30))
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    route = "/v1/chat/completions" if chat else "/v1/completions"
    position = index % 100
    if position == 50:
        kind = _BAD[(index // 100) % len(_BAD)]
        if kind == "malformed_json":
            raw = json.dumps(body).encode()
            return Request(index, kind, route, raw[: len(raw) // 2], False)
        if kind == "unknown_model":
            body["model"] = model + "-nonexistent"
        else:
            body["max_tokens"] = 10_000_000
        return Request(index, kind, route, json.dumps(body).encode(), False)
    stream = position % 10 == 5 or rng.random() < 0.5
    if position % 10 == 5:  # long enough that the drop comes mid-stream
        body.update(max_tokens=rng.randint(16, 64), ignore_eos=True)
    if stream:
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    kind = "disconnect" if position % 10 == 5 else ("chat" if chat else "completion")
    return Request(index, kind, route, json.dumps(body).encode(), stream)


class Client:
    """One keep-alive connection per client thread, reopened after a disconnect."""

    def __init__(self, host: str, port: int, timeout: float = 300.0) -> None:
        self._host, self._port, self._timeout = host, port, timeout
        self._conn: http.client.HTTPConnection | None = None
        self._used = False  # the connection served a request: the server may close it

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self._conn, self._used = None, False

    def send(self, req: Request) -> Outcome:
        """Send ``req`` and read its reply as the mix says; a kept-alive connection the
        server closed meanwhile is reopened and the request sent again, once (nothing
        was read from it, so the server never saw it)."""
        for attempt in (0, 1):
            reused = self._used
            if self._conn is None:
                self._conn = http.client.HTTPConnection(self._host, self._port,
                                                        timeout=self._timeout)
            try:
                self._conn.request("POST", req.route, body=req.body,
                                   headers={"Content-Type": "application/json"})
                resp = self._conn.getresponse()
            except (http.client.RemoteDisconnected, BrokenPipeError,
                    ConnectionResetError) as exc:
                self.close()
                if reused and attempt == 0:
                    continue
                return Outcome(0, False, f"{type(exc).__name__}: {exc}")
            except OSError as exc:
                self.close()
                return Outcome(0, False, f"{type(exc).__name__}: {exc}")
            self._used = True
            try:
                return self._read(req, resp)
            except (OSError, http.client.HTTPException) as exc:
                self.close()
                return Outcome(resp.status, False, f"{type(exc).__name__}: {exc}")
        raise AssertionError("unreachable")  # the loop returns on its second attempt

    def _read(self, req: Request, resp: http.client.HTTPResponse) -> Outcome:
        if req.kind == "disconnect" and resp.status == 200:
            first = b""
            while not first.startswith(b"data: "):
                first = resp.readline()
                if not first:
                    break
            # the client goes away after the first chunk: the socket closes with the
            # rest of the stream unread (the server sees a reset or a broken pipe)
            resp.close()
            self.close()
            return Outcome(200, first.startswith(b"data: "))
        data = resp.read()
        if resp.will_close:
            self.close()
        if resp.status != 200:
            return Outcome(resp.status, _is_error_body(data))
        if req.stream:
            lines = [ln for ln in data.split(b"\n") if ln.startswith(b"data: ")]
            return Outcome(200, bool(lines) and lines[-1] == b"data: [DONE]")
        try:
            reply = json.loads(data)
        except ValueError:
            return Outcome(200, False, "the reply is not JSON")
        return Outcome(200, bool(reply.get("choices")))


def _is_error_body(data: bytes) -> bool:
    """OpenAI's error shape: ``{"error": {"message": ...}}``."""
    try:
        body = json.loads(data)
    except ValueError:
        return False
    return isinstance(body, dict) and isinstance(body.get("error"), dict) \
        and "message" in body["error"]
