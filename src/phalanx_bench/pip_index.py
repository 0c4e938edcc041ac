"""Finds one release file through the package index pip is configured to use.

The benchmarks' anchors are built from source packages on the registry. A user behind a
mirror (a company proxy, an air-gapped index) reaches the registry only through the
index pip is configured with, so the file is looked up there, the way pip would: the
index is ``PIP_INDEX_URL``, else ``index-url`` from pip's configuration (``pip config
list``: the ``download``, then ``install``, then ``global`` section, pip's own order of
a command's section over ``global``), else PyPI. Extra indexes are not searched: on
this machine they are local ``file://`` trees that do not hold the anchors, and one
index keeps the answer reproducible.

The project page is asked for as PEP 691 JSON and parsed as PEP 503 HTML where the
index answers HTML (older mirrors). Addresses are resolved against the page (mirrors
often answer with relative ones). The index's credentials (``https://user:pass@host``)
are sent to that index's own addresses only, and never printed; pip's ``cert`` setting
(``PIP_CERT``) names the CA bundle, as for pip.
"""

from __future__ import annotations

import ast
import json
import os
import re
import ssl
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

from ._errors import BenchError

__all__ = ["DEFAULT_INDEX", "IndexUnreadable", "Release", "find_sdist", "index_url", "open_url",
           "redact"]

DEFAULT_INDEX = "https://pypi.org/simple"
# pip's own Accept header: JSON preferred, HTML taken from an index without PEP 691
ACCEPT = ("application/vnd.pypi.simple.v1+json, application/vnd.pypi.simple.v1+html;q=0.2, "
          "text/html;q=0.01")
_SECTIONS = ("download", "install", "global")


class IndexUnreadable(BenchError):
    """The index could not be read, or does not list the wanted file."""


@dataclass(frozen=True)
class Release:
    """One file of a project's page: its absolute address and the sha256 the index gave."""

    url: str
    filename: str
    sha256: str | None


def _pip_config() -> dict[str, str]:
    """pip's merged configuration (``section.key`` -> value); empty without pip."""
    try:
        done = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    out: dict[str, str] = {}
    for line in done.stdout.splitlines() if done.returncode == 0 else []:
        key, sep, value = line.partition("=")
        if not sep:
            continue
        try:
            out[key.strip()] = str(ast.literal_eval(value.strip()))
        except (ValueError, SyntaxError):
            out[key.strip()] = value.strip().strip("'\"")
    return out


def index_url(config: dict[str, str] | None = None) -> str:
    """The main index pip would use here (no trailing slash)."""
    env = os.environ.get("PIP_INDEX_URL", "").strip()
    if env:
        return env.rstrip("/")
    cfg = _pip_config() if config is None else config
    for key in (":env:.index-url", *(f"{s}.index-url" for s in _SECTIONS)):
        if cfg.get(key, "").strip():
            return cfg[key].strip().rstrip("/")
    return DEFAULT_INDEX


def _cafile(config: dict[str, str]) -> str | None:
    cert = os.environ.get("PIP_CERT") or next(
        (config[k] for k in (":env:.cert", *(f"{s}.cert" for s in _SECTIONS)) if config.get(k)),
        None)
    return cert if cert and Path(cert).is_file() else None


def redact(url: str) -> str:
    """``url`` without its password, for messages."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def _opener(index: str, config: dict[str, str]) -> tuple[urllib.request.OpenerDirector, str]:
    """An opener that sends the index's credentials to the index's addresses only
    (never to a file host elsewhere), and the index's address without them."""
    parts = urllib.parse.urlsplit(index)
    handlers: list[urllib.request.BaseHandler] = [
        urllib.request.HTTPSHandler(context=ssl.create_default_context(cafile=_cafile(config)))]
    if parts.username is not None:
        host = parts.hostname or ""
        bare = urllib.parse.urlunsplit(
            parts._replace(netloc=host + (f":{parts.port}" if parts.port else "")))
        users = urllib.request.HTTPPasswordMgrWithPriorAuth()
        users.add_password(None, bare, urllib.parse.unquote(parts.username),
                           urllib.parse.unquote(parts.password or ""), is_authenticated=True)
        handlers.append(urllib.request.HTTPBasicAuthHandler(users))
        index = bare
    return urllib.request.build_opener(*handlers), index


def open_url(opener: urllib.request.OpenerDirector, url: str,
             timeout: float) -> tuple[bytes, str, str]:
    """(body, content type, final address) of ``url``; a ``file:`` directory reads its
    ``index.html``, as pip reads a local index."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "file":
        path = Path(urllib.request.url2pathname(parts.path))
        if path.is_dir():
            url = urllib.parse.urljoin(url.rstrip("/") + "/", "index.html")
    req = urllib.request.Request(url, headers={"Accept": ACCEPT})
    with opener.open(req, timeout=timeout) as r:
        return r.read(), str(r.headers.get("Content-Type") or "text/html"), str(r.geturl())


class _Anchors(HTMLParser):
    """PEP 503: one ``<a href>`` per file, its text the filename; ``<base>`` honoured."""

    def __init__(self) -> None:
        super().__init__()
        self.base: str | None = None
        self.links: list[tuple[str, str]] = []
        self._href: str | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        href = dict(attrs).get("href")
        if tag == "base" and href and self.base is None:
            self.base = href
        elif tag == "a" and href:
            self._href, self._text = href, []

    def handle_data(self, data: str) -> None:
        if self._href is not None:
            self._text.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag == "a" and self._href is not None:
            self.links.append((self._href, "".join(self._text).strip()))
            self._href = None


def _files(body: bytes, ctype: str, page: str) -> list[Release]:
    """Every file of a project page, addresses made absolute against the page."""
    if ctype.split(";")[0].strip().endswith("+json"):
        meta = json.loads(body)
        return [Release(urllib.parse.urljoin(page, str(f["url"])), str(f["filename"]),
                        (f.get("hashes") or {}).get("sha256")) for f in meta.get("files", [])]
    parser = _Anchors()
    parser.feed(body.decode("utf-8", errors="replace"))
    base = urllib.parse.urljoin(page, parser.base) if parser.base else page
    out = []
    for href, text in parser.links:
        url, frag = urllib.parse.urldefrag(urllib.parse.urljoin(base, href))
        name = text or urllib.parse.unquote(urllib.parse.urlsplit(url).path.rsplit("/", 1)[-1])
        algo, _, digest = frag.partition("=")
        out.append(Release(url, name, digest if algo == "sha256" and digest else None))
    return out


def _normal(name: str) -> str:
    """PEP 503 normalisation (applied to a whole ``name-version`` stem alike)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def find_sdist(project: str, version: str, index: str | None = None,
               timeout: float = 60.0) -> tuple[Release, urllib.request.OpenerDirector]:
    """The ``.tar.gz`` sdist of ``project`` ``version`` on the index pip would use, and an
    opener to download it with (the index's credentials and CA bundle)."""
    config = _pip_config()
    where = (index or index_url(config)).rstrip("/")
    opener, bare = _opener(where, config)
    page = f"{bare}/{_normal(project)}/"
    try:
        body, ctype, final = open_url(opener, page, timeout)
    except urllib.error.HTTPError as exc:
        exc.close()   # its response's socket, kept alive by the chained error otherwise
        raise IndexUnreadable(f"{redact(page)}: HTTP {exc.code} ({project} is not on the index "
                          f"pip uses here, {redact(where)})") from exc
    except (urllib.error.URLError, OSError) as exc:
        raise IndexUnreadable(f"cannot read {redact(page)}: {exc}") from exc
    try:
        files = _files(body, ctype, final)
    except (ValueError, KeyError, TypeError) as exc:
        raise IndexUnreadable(f"{redact(page)}: not a PEP 691/503 project page ({exc})") from exc
    want = _normal(f"{project}-{version}")
    for f in files:
        if f.filename.endswith(".tar.gz") and _normal(f.filename[:-len(".tar.gz")]) == want:
            return f, opener
    raise IndexUnreadable(f"{redact(page)} lists no sdist of {project} {version} "
                      f"({len(files)} files)")
