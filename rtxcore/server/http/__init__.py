"""The HTTP server: OpenAI-compatible and native routes on Starlette, run by uvicorn (see ``server/launcher.py``)."""

from rtxcore.server.http.app import build_app

__all__ = ["build_app"]
