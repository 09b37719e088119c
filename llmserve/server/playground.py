"""The browser playground and dashboard: one page (ui/index.html, ui/app.js, ui/app.css, shipped
in the package) served at /, /playground and /dashboard; --no-playground leaves them out.

The page and its assets carry no secret and are served without the API key (the page asks for it
and sends it with each API call); everything they fetch is on this server, which the
Content-Security-Policy enforces. The dashboard polls GET /stats/live (server/live.py).
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

PAGES = ("/", "/playground", "/dashboard")
ASSETS = {"/ui/app.js": ("app.js", "text/javascript"), "/ui/app.css": ("app.css", "text/css")}
OPEN_PATHS = (*PAGES, *ASSETS)  # served without the API key
CSP = "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; connect-src 'self'; frame-ancestors 'none'"


@cache
def _read(name: str) -> bytes:
    return resources.files("llmserve.server").joinpath("ui", name).read_bytes()


def _respond(name: str, media_type: str) -> Response:
    return Response(_read(name), media_type=media_type,
                    headers={"Content-Security-Policy": CSP, "Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"})


async def page(request: Request) -> Response:
    return _respond("index.html", "text/html; charset=utf-8")


async def asset(request: Request) -> Response:
    return _respond(*ASSETS[request.url.path])


routes = [Route(p, page, methods=["GET"]) for p in PAGES] + [Route(p, asset, methods=["GET"]) for p in ASSETS]
