"""The HTTP service: a thin FastAPI edge over :mod:`weightsync.ops` (docs/API.md).

``create_app(settings)`` builds the ASGI app; ``Settings`` is its one configuration
class (``WEIGHTSYNC_*`` environment variables). Both are imported lazily: the client-only
install imports :mod:`weightsync.service.cli` (for the ``serve`` command) without having
FastAPI, SQLAlchemy or uvicorn, and importing this package must not pull them in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from weightsync.service.app import create_app
    from weightsync.service.settings import Settings

__all__ = ["Settings", "create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from weightsync.service.app import create_app

        return create_app
    if name == "Settings":
        from weightsync.service.settings import Settings

        return Settings
    raise AttributeError(f"module 'weightsync.service' has no attribute {name!r}")
