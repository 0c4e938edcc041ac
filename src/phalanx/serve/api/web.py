"""``GET /``: the web page, from static files shipped in the package (issue 47).

The page (``phalanx/serve/webui/``: one HTML file, its script, its markdown renderer and
its style sheet) is read once, when the app is built, and answered from memory: no
build step, no CDN, nothing outside the server. A fixed table names the files, so no
request path ever reaches the file system. Every response carries a Content Security
Policy allowing this origin's own scripts, styles and requests only: even a renderer
bug could not run an inline script or send a byte elsewhere.
"""

from __future__ import annotations

from importlib import resources

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

__all__ = ["web_routes"]

_FILES = {  # URL path -> (file in phalanx/serve/webui, content type)
    "/": ("index.html", "text/html; charset=utf-8"),
    "/web/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/web/markdown.js": ("markdown.js", "text/javascript; charset=utf-8"),
    "/web/style.css": ("style.css", "text/css; charset=utf-8"),
}

_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                               "img-src 'self' data:; connect-src 'self'; "
                               "base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def web_routes() -> list[Route]:
    """The page's routes, its files read now (a missing one fails the server's start,
    not a visitor's request)."""
    root = resources.files("phalanx.serve").joinpath("webui")
    routes = []
    for path, (name, content_type) in _FILES.items():
        body = root.joinpath(name).read_bytes()

        async def answer(request: Request, body: bytes = body,
                         content_type: str = content_type) -> Response:
            return Response(body, media_type=content_type, headers=_HEADERS)

        routes.append(Route(path, answer, methods=["GET"]))
    return routes
