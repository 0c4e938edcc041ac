"""The web page at ``GET /`` (issue 47) in a real browser, against a real server.

Debian's Chromium (``/usr/bin/chromium``, as installed: no browser is downloaded) driven
by playwright. One ``phalanx serve`` (TP 2, the embedded model, a disk tier, an API key)
for the whole module, one browser; each test opens its own page, so none depends on
another's order. The tests skip, saying why, where Chromium or playwright is missing
(``.ci/run`` installs Chromium where apt-get can).

A screenshot of the page after a chat is written under the test's tmp dir and, when
``PHALANX_TEST_ARTIFACTS`` names a directory, there too.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from serve_util import Server, model_env
from waits import wait_for

CHROMIUM = os.environ.get("PHALANX_CHROMIUM", "/usr/bin/chromium")  # Debian's
KEY = "web-test-key"
WAIT_MS = 60_000  # a loaded 2-core machine: what any one wait on the page may take
# the flags a headless Chromium needs here: no sandbox as root, no network of its own,
# no /dev/shm segments (the session's leak check counts those)
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--disable-dev-shm-usage"]


# ways a script turns a string into markup: the page uses none of them
_HTML_SINKS = re.compile(r"\.(inner|outer)HTML\s*=|insertAdjacentHTML|document\.write"
                         r"|createContextualFragment|\beval\(|new Function")


def _playwright() -> Any:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (the dev extra installs it)")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"no Chromium at {CHROMIUM}: `apt-get install chromium` (.ci/run tries)")
    return sync_playwright


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    sync_playwright = _playwright()
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    home = tmp_path_factory.mktemp("web-home")
    s = Server("--tp", "2", "--prefix-cache-disk", str(home / "disk"), "--api-key", KEY,
               env=model_env(home))
    yield s
    assert s.stop() == 0


@pytest.fixture
def page(browser: Any, server: Server) -> Iterator[Any]:
    """The page, opened and given the key (it asks for it: the server has one)."""
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    context.set_default_timeout(WAIT_MS)
    p = context.new_page()
    errors: list[str] = []
    p.on("pageerror", lambda exc: errors.append(str(exc)))
    p.goto(server.url + "/?poll=200")
    p.locator("#keyform").wait_for(state="visible")
    p.fill("#apikey", KEY)
    p.press("#apikey", "Enter")
    p.locator("#keyform").wait_for(state="hidden")
    yield p
    context.close()
    assert errors == [], errors  # no script error on the page


def _ask(page: Any, question: str, max_tokens: int = 24) -> Any:
    """Type a question, send it with Enter; the answer's element once it finished."""
    page.fill("#temperature", "0")
    page.fill("#maxtokens", str(max_tokens))
    before = page.locator(".msg.assistant").count()
    page.fill("#prompt", question)
    page.press("#prompt", "Enter")
    answer = page.locator(".msg.assistant").nth(before)
    page.wait_for_function(
        "n => document.querySelectorAll('.msg.assistant')[n].dataset.state !== 'streaming'",
        arg=before)
    return answer


def _screenshot(page: Any, tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    page.screenshot(path=str(path), full_page=True)
    out = os.environ.get("PHALANX_TEST_ARTIFACTS")
    if out:
        os.makedirs(out, exist_ok=True)
        shutil.copy(path, Path(out) / name)
    return path


def test_a_question_streams_its_answer_and_a_repeat_shows_the_cached_tokens(
        page: Any, tmp_path: Path) -> None:
    question = "Tell me about the ranks of a phalanx. " * 12  # whole 64-token pages
    first = _ask(page, question)
    assert first.get_attribute("data-state") == "done"
    assert first.locator(".body").inner_text().strip(), "no answer appeared"
    assert page.locator(".msg.user").first.inner_text().strip() == question.strip()
    page.click("#newchat")  # the same prompt again: its pages come from the cache
    again = _ask(page, question)
    cached = int(again.get_attribute("data-cached") or 0)
    assert cached >= 64, again.locator(".meta").inner_text()
    meta = again.locator(".meta").inner_text()
    assert f"cached {cached} of" in meta and "memory" in meta and "disk" in meta, meta
    assert page.locator(".msg.assistant").count() == 1  # the new chat cleared the first
    # the state panel follows: the memory tier served those tokens
    page.wait_for_function(
        "() => document.querySelector('#tier-memory .hits').textContent !== '0'"
        " && document.querySelector('#tier-memory .hits').textContent !== ''")
    assert page.locator("#plotbox svg polyline.tps").count() >= 1
    page.locator("#running").filter(has_text="0").wait_for()  # at rest for the picture
    shot = _screenshot(page, tmp_path, "web-ui-chat.png")
    assert shot.stat().st_size > 10_000


def test_escape_stops_a_stream_and_the_server_aborts_it(page: Any, server: Server) -> None:
    # greedy, this prompt runs 1,113 tokens before the embedded model's EOS: seconds
    # here, Escape comes well before its end
    page.fill("#temperature", "0")
    page.fill("#maxtokens", "1800")
    page.fill("#prompt", "Write a very long story.")
    page.press("#prompt", "Enter")
    answer = page.locator(".msg.assistant").last
    page.wait_for_function(
        "() => { const a = [...document.querySelectorAll('.msg.assistant')].pop();"
        " return a.querySelector('.body').textContent.length > 0; }")
    page.locator("#running").filter(has_text="1").wait_for()  # the page sees it running
    page.keyboard.press("Escape")
    page.wait_for_function(
        "() => [...document.querySelectorAll('.msg.assistant')].pop().dataset.state"
        " !== 'streaming'")
    assert answer.get_attribute("data-state") == "stopped"
    assert answer.get_attribute("data-finish") is None  # it did not run to its end
    # A clock that does not depend on the machine's speed: a request of 100 tokens run
    # beside it. Not aborted, the stopped one (1,113 tokens, a few dozen in) would still
    # run when this one is done; aborted, it left the batch steps ago.
    server.openai(KEY).completions.create(
        model="phalanx-tiny", prompt="a clock", max_tokens=100, temperature=0,
        extra_body={"ignore_eos": True})
    wait_for(lambda: server.metric("phalanx:num_requests_running") == 0, 2,
             "the stopped stream to have left the batch")
    page.locator("#running").filter(has_text="0").wait_for()  # and the page shows it


def test_a_killed_rank_turns_dead_then_alive_after_the_heal(page: Any, server: Server) -> None:
    restarts = int(httpx.get(server.url + "/state", timeout=30).json()["restarts"])
    rank1 = page.locator("#ranks tr.rank[data-rank='1']")
    rank1.and_(page.locator("[data-alive='true']")).wait_for()
    victim = server.rank_pids()[1]
    os.kill(victim, signal.SIGKILL)
    rank1.and_(page.locator("[data-alive='false']")).wait_for()
    assert rank1.locator(".status").inner_text() == "dead"
    rank1.and_(page.locator("[data-alive='true']")).wait_for(timeout=180_000)
    page.locator("#restarts").filter(has_text=str(restarts + 1)).wait_for()
    page.locator("#health.ok").wait_for()
    assert victim not in server.rank_pids().values()
    wait_for(lambda: server.health() == 200, 60, "the healed server's /health")


def test_the_state_is_open_as_metrics_and_holds_nothing_secret(server: Server) -> None:
    state = httpx.get(server.url + "/state", timeout=30)
    assert state.status_code == 200  # no key, as /metrics
    assert httpx.get(server.url + "/v1/models", timeout=30).status_code == 401
    body = state.text
    assert KEY not in body and "/" not in body.replace("/s", ""), body
    doc = state.json()
    assert doc["api_key_required"] is True and doc["tensor_parallel_size"] == 2
    assert doc["model"] == "phalanx-tiny" and len(doc["ranks"]) == 2
    # the same figures as /metrics: one source
    metrics = server.metric_by_label("phalanx:rank_weight_bytes")
    assert {f'{{rank="{r["rank"]}"}}': float(r["weight_bytes"]) for r in doc["ranks"]} == metrics


def test_the_page_is_static_and_confined(server: Server) -> None:
    page = httpx.get(server.url + "/", timeout=30)
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp
    assert "http" not in page.text.replace("http-equiv", "")  # nothing from elsewhere
    for asset in ("/web/app.js", "/web/markdown.js", "/web/style.css"):
        r = httpx.get(server.url + asset, timeout=30)
        assert r.status_code == 200 and not _HTML_SINKS.search(r.text), asset
        assert r.headers["x-content-type-options"] == "nosniff"
    # only the page's own files are open: nothing else under /web/, the rest keyed
    assert httpx.get(server.url + "/web/nothing.js", timeout=30).status_code == 404
    assert httpx.get(server.url + "/pyproject.toml", timeout=30).status_code == 401


def test_the_markdown_renderer_escapes_everything(page: Any) -> None:
    source = ("# Title <b>x</b>\n\nSome **bold** and `code <i>` and a "
              "[link](javascript:alert(1)) and [ok](https://example.org).\n\n"
              "```python\nprint('<script>alert(1)</script>')\n```\n\n"
              "- one\n- <img src=x onerror=alert(1)>\n")
    out = page.evaluate("""src => {
        const box = document.createElement('div');
        box.appendChild(window.phalanxMarkdown.render(src));
        return {html: box.innerHTML, imgs: box.querySelectorAll('img,script').length,
                code: box.querySelector('pre code').textContent,
                lang: box.querySelector('pre code').className,
                links: [...box.querySelectorAll('a')].map(a => a.href),
                h1: box.querySelector('h1').textContent,
                strong: box.querySelector('strong').textContent,
                items: box.querySelectorAll('li').length};
    }""", source)
    assert out["imgs"] == 0, out["html"]
    assert out["code"] == "print('<script>alert(1)</script>')" and out["lang"] == "language-python"
    assert out["links"] == ["https://example.org/"], out["links"]
    assert out["h1"] == "Title <b>x</b>" and out["strong"] == "bold" and out["items"] == 2
    assert "&lt;img" in out["html"]


def test_the_rates_are_over_the_window_and_restart_with_the_engine() -> None:
    """/state's rates from the Samples /metrics renders (no server: the Metrics and the
    window as the app holds them)."""
    from phalanx.serve.api.metrics import Metrics
    from phalanx.serve.api.state import RateWindow

    metrics, window = Metrics("m"), RateWindow(window_s=10)
    stats = {"prefix_cache_queries": 0, "prefix_cache_hits_memory": 0}
    assert window.add(0.0, metrics.sample(stats))["tokens_per_s"] is None  # one point
    metrics.generated(50)
    rates = window.add(5.0, metrics.sample({"prefix_cache_queries": 200,
                                            "prefix_cache_hits_memory": 50}))
    assert rates["tokens_per_s"] == 10 and rates["hit_rate_memory"] == 0.25
    metrics.generated(30)
    rates = window.add(20.0, metrics.sample({"prefix_cache_queries": 200,
                                             "prefix_cache_hits_memory": 50}))
    assert rates["tokens_per_s"] == 2 and rates["hit_rate_memory"] is None  # 5 s .. 20 s
    # a restarted engine counts its cache from 0: a new window, never a negative rate
    rates = window.add(21.0, metrics.sample({"prefix_cache_queries": 10,
                                             "prefix_cache_hits_memory": 0}))
    assert rates["tokens_per_s"] is None and rates["window_s"] == 0
    body, _ = metrics.sample({"prefix_cache_queries": 10}).render()
    assert b'phalanx:generation_tokens_total{model_name="m"} 80.0' in body
