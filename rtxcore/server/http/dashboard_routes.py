"""``/dashboard``: a live page of the server's metrics, static HTML, CSS and JavaScript shipped in the package
(``rtxcore/server/http/dashboard/``). The page polls ``/metrics`` from the browser; nothing is built, and nothing is
fetched from elsewhere, so it works offline. Open like ``/metrics``: it shows nothing ``/metrics`` does not, but for
``/dashboard/fleet.json``, the peers' autoscaling signals (rtxcore.server.fleet) read from their own ``/metrics``."""

from __future__ import annotations

from importlib import resources

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rtxcore.server.fleet import FleetWatcher

_FILES = {"index.html": "text/html; charset=utf-8", "dashboard.js": "text/javascript; charset=utf-8",
          "dashboard.css": "text/css; charset=utf-8"}
_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}
PATHS = frozenset({"/dashboard", "/dashboard/dashboard.js", "/dashboard/dashboard.css", "/dashboard/fleet.json"})


class DashboardRoutes:
    def __init__(self, fleet: FleetWatcher | None = None) -> None:
        folder = resources.files("rtxcore.server.http") / "dashboard"
        self._files = {name: (folder / name).read_bytes() for name in _FILES}
        self._fleet = fleet

    def routes(self) -> list[Route]:
        return [Route("/dashboard", self._serve("index.html"), methods=["GET"]),
                # Assets of the page, not operations of the API: left out of spec/openapi.yaml.
                Route("/dashboard/dashboard.js", self._serve("dashboard.js"), methods=["GET"], include_in_schema=False),
                Route("/dashboard/dashboard.css", self._serve("dashboard.css"), methods=["GET"],
                      include_in_schema=False),
                Route("/dashboard/fleet.json", self._fleet_view, methods=["GET"], include_in_schema=False)]

    async def _fleet_view(self, request: Request) -> Response:
        view = self._fleet.view() if self._fleet is not None else {"configured": False}
        return JSONResponse(view, headers=_HEADERS)

    def _serve(self, name: str):
        body, media_type = self._files[name], _FILES[name]

        async def serve(request: Request) -> Response:
            return Response(body, media_type=media_type, headers=_HEADERS)
        return serve
