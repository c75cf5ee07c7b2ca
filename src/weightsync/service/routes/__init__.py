"""One router per resource; each route parses, calls one ops function, renders."""

from weightsync.service.routes import admin, health, ledger, models, objects, versions

ROUTERS = [health.router, models.router, versions.router, objects.router, ledger.router, admin.router]

__all__ = ["ROUTERS"]
