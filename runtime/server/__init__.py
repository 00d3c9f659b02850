"""OpenAI-compatible HTTP server over the embedded :class:`runtime.Engine` (``python -m runtime.serve``)."""

from .app import ServerSettings, create_app

__all__ = ["ServerSettings", "create_app"]
