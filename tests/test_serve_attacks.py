"""One request never takes the server down (issue 45): each way a hostile or careless
client stopped or wedged ``phalanx serve``, attacked again from outside over real HTTP.

One server answers them all (TP 1, the embedded model, a small admission queue). Two
failpoints are armed in it from the start: ``serve.api.tokenize`` hangs a large
prompt's tokenization (so the test can see whether the event loop still answers
meanwhile) and ``engine.step.encode`` slows every step a little (so a stream is still
running when the last test's SIGTERM's deadline passes). The last test stops it.
"""

from __future__ import annotations

import concurrent.futures
import json
import signal
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from serve_util import Server, model_env
from waits import wait_for

# 2 running + 2 waiting: a request may carry at most 4 prompts
SLOTS = 4
HEADER_TIMEOUT_S = 2
HANG_S = 8  # how long the large prompt's tokenization hangs (then it fails)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    home = tmp_path_factory.mktemp("attacks-home")
    env = {**model_env(home), "PHALANX_FAILPOINTS":
           f"serve.api.tokenize=hang:{HANG_S};engine.step.encode=delay:0.01"}
    s = Server("--tp", "1", "--no-prefix-cache-disk", "--max-num-seqs", "2",
               "--max-waiting", "2", "--shutdown-timeout", "1",
               "--header-timeout", str(HEADER_TIMEOUT_S), env=env)
    yield s
    if s.proc.poll() is None:
        assert s.stop() == 0


def _post(s: Server, path: str, body: bytes | dict[str, Any]) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return s.client.post(path, content=content, headers={"content-type": "application/json"})


def _still_serving(s: Server) -> None:
    """/health is 200 with no restart, and a plain request is answered."""
    health = s.client.get("/health")
    assert health.status_code == 200, health.text
    assert health.json()["restarts"] == 0
    ok = _post(s, "/v1/completions", {"prompt": "still here", "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def _idle(s: Server) -> bool:
    return (s.metric("phalanx:num_requests_running") == 0
            and s.metric("phalanx:num_requests_waiting") == 0)


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "x", "seed": 2**64}, "seed"),
    ({"prompt": "x", "seed": -(2**63) - 1}, "seed"),
    ({"prompt": "x", "top_k": 2**64}, "top_k"),
    ({"prompt": "x", "max_tokens": 2**64}, "max_tokens"),
    ({"prompt": "x", "stop_token_ids": [2**64]}, "stop_token_ids[0]"),
    ({"prompt": [2**40]}, "prompt[0]"),
])
def test_an_out_of_range_number_is_a_400_and_the_engine_lives(
        server: Server, body: dict[str, Any], param: str) -> None:
    """seed = 2**64 once passed validation, failed the plan's encoding, killed the
    engine and spent a restart: four such requests stopped the server."""
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    _still_serving(server)


def test_a_seed_at_the_edges_of_its_range_is_served(server: Server) -> None:
    for seed in (2**63 - 1, -(2**63)):
        r = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2, "seed": seed})
        assert r.status_code == 200, r.text
    _still_serving(server)


def _hold_a_slot(s: Server) -> Any:
    """A stream that holds one admission slot until the context manager exits."""
    return httpx.stream("POST", s.url + "/v1/completions", timeout=120, json={
        "prompt": "hold a slot", "ignore_eos": True, "stream": True})


def test_a_fan_out_is_admitted_all_or_none(server: Server) -> None:
    """300 prompts against 272 free slots once admitted 272, answered 503 and never
    aborted them: every other request got 503 for minutes."""
    many = _post(server, "/v1/completions", {"prompt": ["x"] * (SLOTS + 1), "max_tokens": 2})
    assert many.status_code == 400, many.text
    assert many.json()["error"]["param"] == "prompt"
    with _hold_a_slot(server) as held:
        assert held.status_code == 200
        lines = held.iter_lines()
        next(lines)  # the slot is held now: SLOTS - 1 are free
        busy = _post(server, "/v1/completions", {"prompt": ["x"] * SLOTS, "max_tokens": 1000,
                                                 "ignore_eos": True})
        assert busy.status_code == 503, busy.text
        assert busy.headers["retry-after"]
        # nothing of the refused request was admitted: the free slots serve a fan-out
        fits = _post(server, "/v1/completions", {"prompt": ["y"] * (SLOTS - 1),
                                                 "max_tokens": 2})
        assert fits.status_code == 200, fits.text
        assert len(fits.json()["choices"]) == SLOTS - 1
    wait_for(lambda: _idle(server), 60, "the held stream's request to be aborted")
    _still_serving(server)


def test_one_failing_prompt_of_a_fan_out_aborts_its_siblings(server: Server) -> None:
    """A choice that fails before the response starts (here a token id outside the
    vocabulary) fails the request, and its siblings are aborted, not left running."""
    r = _post(server, "/v1/completions", {
        "prompt": [[5, 6, 7], [5, 6, 7], [10**8]], "max_tokens": 1000, "ignore_eos": True})
    assert r.status_code == 400, r.text
    assert "vocabulary" in r.json()["error"]["message"]
    wait_for(lambda: _idle(server), 60, "the sibling choices to be aborted")
    _still_serving(server)


@pytest.mark.parametrize("where", ["a field of any JSON", "content part"])
def test_deeply_nested_json_is_a_400(server: Server, where: str) -> None:
    deep = b"[" * 200_000 + b"]" * 200_000
    if where == "a field of any JSON":  # (an unknown field is refused by its name first)
        body = b'{"prompt": "x", "logit_bias": ' + deep + b"}"
        path = "/v1/completions"
    else:
        body = (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "x", '
                b'"extra": ' + deep + b"}]}]}")
        path = "/v1/chat/completions"
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    assert "nested too deeply" in r.json()["error"]["message"]
    _still_serving(server)


def test_a_large_prompt_is_tokenized_off_the_event_loop(server: Server) -> None:
    """A prompt just under the body limit took 3.7 s to tokenize on the event loop, and
    /health did not answer meanwhile. Its tokenization hangs here for HANG_S (the
    failpoint); /health, asked over and over until the large request ends, must answer
    every time within half of that (on the loop, the asks during the hang time out)."""
    big = "word " * 400_000  # 2 MB: over the off-loop threshold, under the body limit
    answered = 0
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        # a connection of its own: the failpoint's 500 closes it
        pending = pool.submit(httpx.post, server.url + "/v1/completions", timeout=120,
                              json={"prompt": big, "max_tokens": 1})
        while not pending.done():
            health = httpx.get(server.url + "/health", timeout=HANG_S / 2)
            assert health.status_code == 200
            answered += 1
        failed = pending.result()
    assert failed.status_code == 500 and "FailpointError" in failed.text, failed.text
    assert answered > 1
    _still_serving(server)


def test_a_client_sending_its_headers_slowly_is_dropped(server: Server) -> None:
    """Clients that never finish their headers held their connections for as long as
    they liked; past the header deadline each is answered 408 and closed."""
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    slow = [socket.create_connection((host, int(port)), timeout=60) for _ in range(20)]
    try:
        for conn in slow:
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
        _still_serving(server)  # others are served meanwhile
        for conn in slow:  # each read returns (a 408, then the close) within its timeout
            answer = b""
            while chunk := conn.recv(4096):
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
            assert b"request_timeout" in answer
    finally:
        for conn in slow:
            conn.close()


def test_openapi_describes_the_routes(server: Server) -> None:
    doc = server.client.get("/openapi.json").json()
    assert doc["openapi"].startswith("3.1")
    assert {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize",
            "/v1/models",
            "/health", "/state"} <= set(doc["paths"])
    seed = doc["components"]["schemas"]["CompletionRequest"]["properties"]["seed"]
    assert {"minimum": -(2**63), "maximum": 2**63 - 1}.items() <= seed["anyOf"][0].items()


def test_streams_past_the_shutdown_timeout_end_with_an_error_event(server: Server) -> None:
    """Last (it stops the server): past --shutdown-timeout, in-flight streams ended
    with neither an error event nor [DONE]; the client saw a cut connection."""
    with _hold_a_slot(server) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        next(lines)
        server.proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]", rest[-3:]
    error = json.loads(rest[-2].removeprefix("data: "))["error"]
    assert "shutdown-timeout" in error["message"], error
    assert server.wait_exit(120) == 0
