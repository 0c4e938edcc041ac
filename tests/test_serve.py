"""phalanx serve through real HTTP: the official openai client, raw requests, real ranks.

One server (TP 2, the embedded model, a disk tier in a temp dir) answers the API tests;
the restart, signal and rank-death tests start their own.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from serve_util import Server, model_env, pages_prompt
from waits import wait_for

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def model_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("model-home")


@pytest.fixture(scope="module")
def server(model_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    disk = tmp_path_factory.mktemp("serve-disk")
    # --no-web-ui here (the page's own tests, tests/test_serve_web.py, start one with it)
    s = Server("--tp", "2", "--prefix-cache-disk", str(disk), "--no-web-ui",
               env=model_env(model_home))
    yield s
    assert s.stop() == 0


def client(s: Server, key: str = "unused") -> openai.OpenAI:
    c: openai.OpenAI = s.openai(key)
    return c


def test_the_servers_connections_send_without_waiting_for_acks() -> None:
    """The socket uvicorn serves on, under asyncio as uvicorn runs it: the connections
    it accepts have Nagle's algorithm off. With it on, a kept-alive connection's first
    event waited for the client's delayed ACK of the response headers (40 ms on every
    request after the first, with the openai client's pooled connections)."""
    import asyncio
    import socket

    from phalanx.serve.server import listen_socket

    async def accepted_nodelay() -> int:
        loop = asyncio.get_running_loop()
        got: asyncio.Future[int] = loop.create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                conn = transport.get_extra_info("socket")
                got.set_result(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        sock = listen_socket("127.0.0.1", 0)
        server = await loop.create_server(Probe, sock=sock)
        try:
            _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            try:
                return await asyncio.wait_for(got, 30)
            finally:
                writer.close()
        finally:
            server.close()
            await server.wait_closed()

    assert asyncio.run(accepted_nodelay()) != 0


def test_no_web_ui_makes_the_page_a_404_and_keeps_the_state(server: Server) -> None:
    for path in ("/", "/web/app.js"):
        r = server.client.get(path)
        assert r.status_code == 404 and "no route" in r.json()["error"]["message"], r.text
    state = server.client.get("/state")
    assert state.status_code == 200 and state.json()["tensor_parallel_size"] == 2


def test_completions_and_chat_through_the_openai_client(server: Server) -> None:
    c = client(server)
    (model,) = [m.id for m in c.models.list().data]
    out = c.completions.create(model=model, prompt="The sky is", max_tokens=8,
                               temperature=0)
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 8
    assert out.usage.prompt_tokens_details is not None  # always present
    assert out.usage.prompt_tokens_details.cached_tokens == 0
    streamed = "".join(
        ch.choices[0].text for ch in c.completions.create(
            model=model, prompt="The sky is", max_tokens=8, temperature=0, stream=True)
        if ch.choices)
    assert streamed == out.choices[0].text  # greedy: the same text either way

    chat = c.chat.completions.create(model=model, max_tokens=6, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}])
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage is not None and chat.usage.completion_tokens == 6
    chunks = list(c.chat.completions.create(
        model=model, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Hello"}]))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == chat.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens_details is not None


def test_a_repeated_prefix_is_cached_and_answers_the_same(server: Server) -> None:
    c = client(server)
    prompt = pages_prompt(300, seed=1)  # several whole pages of 64 tokens
    first = c.completions.create(model=None, prompt=prompt, max_tokens=16,  # type: ignore[arg-type]
                                 temperature=0)
    again = c.completions.create(model=None, prompt=prompt, max_tokens=16,  # type: ignore[arg-type]
                                 temperature=0)
    assert first.usage is not None and again.usage is not None
    details = again.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens >= 64
    # the oracle: served from the cache equals computed without it (greedy)
    assert again.choices[0].text == first.choices[0].text


def _post(s: Server, path: str, body: bytes | dict[str, object],
          headers: dict[str, str] | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return s.client.post(path, content=content,
                         headers={"content-type": "application/json", **(headers or {})})


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"", 400, None),
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, "a"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "n": 129}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "best_f": 2}, 400, "best_f"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 100000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": [5] * 5000}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages[0].role"),
    ("/v1/nothing", {"prompt": "x"}, 404, None),
])
def test_bad_requests_are_client_errors_and_the_server_keeps_serving(
        server: Server, path: str, body: bytes | dict[str, object], status: int,
        param: str | None) -> None:
    r = _post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    ok = _post(server, "/v1/completions", {"prompt": "still here", "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_a_body_over_the_limit_is_413(server: Server) -> None:
    r = _post(server, "/v1/completions", b'{"prompt": "' + b"x" * (5 << 20) + b'"}')
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert _post(server, "/v1/completions", {"prompt": "ok", "max_tokens": 1}).status_code == 200


def test_tokenize_and_detokenize_round_trip(server: Server) -> None:
    ids = _post(server, "/tokenize", {"prompt": "hello world"}).json()["tokens"]
    assert ids and all(isinstance(i, int) for i in ids)
    text = _post(server, "/detokenize", {"tokens": ids}).json()["prompt"]
    assert text.endswith("hello world")
    chat = _post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200 and chat.json()["count"] > len(ids) - 2


def test_metrics_export_what_the_grafana_dashboard_queries(server: Server) -> None:
    _post(server, "/v1/completions", {"prompt": "count me", "max_tokens": 2})
    # a request whose whole pages go to the disk tier: the cache's gauges have figures
    _post(server, "/v1/completions", {"prompt": pages_prompt(260, seed=5), "max_tokens": 2})
    wait_for(lambda: server.metric("phalanx:cache_disk_records") > 0, 60,
             "the prompt's pages to reach the disk tier")
    text = server.client.get("/metrics").text
    exported = {re.sub(r"_(bucket|sum|count)$", "", line.split("{")[0].split(" ")[0])
                for line in text.splitlines() if line and not line.startswith("#")}
    exported |= {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "phalanx.json").read_text())
    queried = {re.sub(r"_(bucket|sum|count)$", "", name)
               for panel in dashboard["panels"] for target in panel["targets"]
               for name in re.findall(r"phalanx:[a-z0-9_]+", target["expr"])}
    assert queried, "the dashboard queries nothing"
    assert queried <= exported, f"the dashboard queries what the server does not export: " \
                                f"{sorted(queried - exported)}"
    assert server.metric("phalanx:request_success_total") >= 1
    assert server.metric("phalanx:ranks_alive") == 2
    # per rank and replicated: both ranks come to hold the same records, of real bytes
    records = wait_for(lambda: _settled(server, "phalanx:cache_disk_records"), 60,
                       "both ranks' disk tiers to hold the same records")
    assert set(records) == {'{rank="0"}', '{rank="1"}'} and min(records.values()) > 0
    sizes = server.metric_by_label("phalanx:cache_disk_bytes")
    assert set(sizes) == set(records) and min(sizes.values()) >= 64 * 1024
    # rank 0's one link (to rank 1): its window, all its credits back once idle
    assert server.metric_by_label("phalanx:replication_link_window") == {'{peer="1"}': 64.0}
    wait_for(lambda: server.metric_by_label("phalanx:replication_link_window_free")
             == {'{peer="1"}': 64.0}, 60, "the link to rank 1 to have every credit back")
    assert server.metric_by_label("phalanx:replication_link_pending") == {'{peer="1"}': 0.0}
    lines = server.client.get("/metrics").text.splitlines()
    assert "phalanx:uncertain_resources 0.0" in lines  # exported, and nothing is uncertain
    assert any(line.startswith("phalanx:cache_maintenance_queue ") for line in lines)
    # the requests above left pages to store: the gauge says so until they are on disk
    assert any(line.startswith("phalanx:cache_disk_stores_pending ") for line in lines)
    wait_for(lambda: server.metric("phalanx:cache_disk_stores_pending") == 0, 60,
             "the disk tier's stores to finish")
    queued = server.metric_by_label("phalanx:cache_maintenance_queued")
    assert set(queued) == set(records) and min(queued.values()) >= 0
    assert server.metric("phalanx:prefix_cache_queries_total") >= \
        server.metric("phalanx:prompt_tokens_computed_total") > 0


def _settled(server: Server, name: str) -> dict[str, float] | None:
    """A per-rank gauge once every rank reports the same value (None before)."""
    values = server.metric_by_label(name)
    return values if len(values) > 1 and len(set(values.values())) == 1 else None


def test_concurrent_clients_some_disconnecting_mid_stream(server: Server) -> None:
    prompts = [pages_prompt(20 + 13 * i, seed=i % 5) for i in range(16)]
    c = client(server)
    expected = [c.completions.create(model=None, prompt=p, max_tokens=12,  # type: ignore[arg-type]
                                     temperature=0).choices[0].text for p in prompts]

    def run(i: int) -> str | None:
        body = {"prompt": prompts[i], "max_tokens": 12 if i % 4 else 200, "temperature": 0,
                "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body,
                          timeout=120) as r:
            assert r.status_code == 200
            text = []
            for line in r.iter_lines():
                if i % 4 == 0 and len(text) >= 2:
                    return None  # disconnect mid-stream: the server must abort and free
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    text.append(chunk["choices"][0]["text"])
            return "".join(text)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(run, range(16)))
    for i, got in enumerate(results):
        if i % 4:
            assert got == expected[i], f"client {i} got another answer under concurrency"
    # the disconnected requests were aborted: nothing runs, and KV pages are free again
    wait_for(lambda: server.metric("phalanx:num_requests_running") == 0, 60,
             "the aborted requests to leave the batch")
    wait_for(lambda: server.metric("phalanx:kv_cache_usage_perc") == 0.0, 60,
             "the aborted requests' KV pages to be freed")


def test_an_api_key_is_required_when_set(model_home: Path) -> None:
    s = Server("--tp", "1", "--no-prefix-cache-disk",
               env={**model_env(model_home), "PHALANX_API_KEY": "s3cret"})
    try:
        assert s.client.get("/v1/models").status_code == 401
        wrong = s.client.get("/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        assert s.client.get("/health").status_code == 200
        out = client(s, "s3cret").completions.create(model=None, prompt="hi",  # type: ignore[arg-type]
                                                     max_tokens=2)
        assert out.usage is not None and out.usage.completion_tokens == 2
    finally:
        assert s.stop() == 0


def test_a_restart_on_the_same_disk_dir_serves_disk_hits(model_home: Path,
                                                         tmp_path: Path) -> None:
    prompt = pages_prompt(400, seed=3)
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
    s = Server("--tp", "2", "--prefix-cache-disk", str(tmp_path), env=model_env(model_home))
    try:
        first = _post(s, "/v1/completions", body).json()
        # stores go to disk behind the request: wait until rank 0's disk tier has them
        wait_for(lambda: s.metric("phalanx:cache_disk_records") > 0, 60,
                 "the prompt's pages to reach the disk tier")
    finally:
        assert s.stop() == 0
    s = Server("--tp", "2", "--prefix-cache-disk", str(tmp_path), env=model_env(model_home))
    try:
        again = _post(s, "/v1/completions", body).json()
        assert again["usage"]["cached_tokens_disk"] >= 64
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
        assert s.metric("phalanx:prefix_cache_hits_disk_total") == \
            again["usage"]["cached_tokens_disk"]
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
    finally:
        assert s.stop() == 0


def test_sigterm_during_load_exits_zero_and_leaves_nothing(model_home: Path,
                                                           tmp_path: Path) -> None:
    s = Server("--tp", "2", "--prefix-cache-disk", str(tmp_path), env=model_env(model_home))
    ranks = s.rank_pids()
    assert sorted(ranks) == [0, 1]

    def stream() -> int:
        try:
            with httpx.stream("POST", s.url + "/v1/completions", timeout=120, json={
                    "prompt": pages_prompt(50), "max_tokens": 300, "stream": True}) as r:
                return sum(1 for _ in r.iter_lines())
        except httpx.HTTPError:
            return -1

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(stream) for _ in range(4)]
        wait_for(lambda: s.metric("phalanx:num_requests_running") >= 1, 60,
                 "requests to be running")
        assert s.stop(signal.SIGTERM) == 0
        for f in futs:
            f.result(timeout=120)
    for pid in ranks.values():
        assert not psutil_alive(pid), f"rank pid {pid} outlived the server"


def psutil_alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow  # a fault campaign: a rank killed, the engine healed (~18 s)
def test_a_killed_rank_fails_in_flight_requests_then_the_server_heals(
        model_home: Path, tmp_path: Path) -> None:
    prompt = pages_prompt(300, seed=4)
    # the restart's Worker start waits 6 s: a window in which to ask during the heal
    s = Server("--tp", "2", "--prefix-cache-disk", str(tmp_path), env={
        **model_env(model_home), "PHALANX_FAILPOINTS": "worker.start.ranks_spawned=delay:6@1"})
    try:
        warm = _post(s, "/v1/completions", {"prompt": prompt, "max_tokens": 4,
                                            "temperature": 0}).json()
        wait_for(lambda: s.metric("phalanx:cache_disk_records") > 0, 60,
                 "the prompt's pages to reach the disk tier")
        victim = s.rank_pids()[1]
        with httpx.stream("POST", s.url + "/v1/completions", timeout=120, json={
                "prompt": "a long answer", "max_tokens": 2000, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            next(lines)
            import os

            os.kill(victim, signal.SIGKILL)
            rest = "\n".join(lines)
        assert "rank" in rest and "error" in rest, rest[-500:]
        wait_for(lambda: s.health() == 503, 30, "/health to report the dead rank")
        wait_for(lambda: "restarting" in httpx.get(s.url + "/health").json()["reason"], 30,
                 "the heal to begin")
        # during the heal every request is a 503 with Retry-After (issue 45: prompts
        # were tokenized before the health check, and that was a 500)
        for path, body in [("/v1/completions", {"prompt": "during the heal"}),
                           ("/v1/chat/completions", {"messages": [
                               {"role": "user", "content": "during the heal"}]}),
                           ("/tokenize", {"prompt": "during the heal"})]:
            healing = httpx.post(s.url + path, json=body, timeout=30)
            assert healing.status_code == 503, healing.text
            assert healing.headers["retry-after"], healing.headers
            assert healing.json()["error"]["code"] == "engine_unavailable"
        wait_for(lambda: s.health() == 200, 180, "the server to restart its ranks")
        assert victim not in s.rank_pids().values()
        again = _post(s, "/v1/completions", {"prompt": prompt, "max_tokens": 4,
                                             "temperature": 0}).json()
        assert again["usage"]["cached_tokens_disk"] >= 64  # warm: the disk tier recovered
        assert again["choices"][0]["text"] == warm["choices"][0]["text"]
        assert s.metric("phalanx:engine_restarts") == 1
    finally:
        assert s.stop() == 0


def test_a_killed_rank_with_no_restart_exits_nonzero(model_home: Path) -> None:
    s = Server("--tp", "2", "--no-prefix-cache-disk", "--no-restart",
               env=model_env(model_home))
    ranks = s.rank_pids()
    import os

    os.kill(ranks[0], signal.SIGKILL)
    code = s.wait_exit(120)
    assert code != 0
    assert "no-restart" in "".join(x for x in s.stderr if x)
    for pid in ranks.values():
        assert not psutil_alive(pid)


def test_a_full_queue_is_503_with_retry_after_and_the_server_recovers(
        model_home: Path) -> None:
    s = Server("--tp", "1", "--no-prefix-cache-disk", "--max-num-seqs", "1",
               "--max-waiting", "0", env=model_env(model_home))
    try:
        # no max_tokens: the whole context (thousands of steps), and the slot is held
        # until the response ends, however soon the engine is done generating
        with httpx.stream("POST", s.url + "/v1/completions", timeout=120, json={
                "prompt": "hold the only slot", "ignore_eos": True, "stream": True}) as r:
            assert r.status_code == 200
            # keep the iterator: one dropped at once closes (httpcore) the connection,
            # a disconnect that aborts the request and frees its slot -- the flake
            lines = r.iter_lines()
            next(lines)  # the first chunk: the request holds its slot now
            busy = _post(s, "/v1/completions", {"prompt": "one more", "max_tokens": 2})
            assert busy.status_code == 503, busy.text
            assert busy.headers["retry-after"] and busy.json()["error"]["code"] == "server_busy"
        # the stream was closed: its slot frees, and the next request is answered
        wait_for(lambda: _post(s, "/v1/completions", {"prompt": "again",
                                                      "max_tokens": 2}).status_code == 200,
                 60, "the slot of the closed stream to free")
    finally:
        assert s.stop() == 0
