"""One router per resource; each route parses, calls one ops function, renders.

Model routes take the name in the path as ``{model:model}``: a name may hold one ``/``
(``Org/Name``), so the segment is matched by :class:`ModelNameConvertor`, registered here
before the routers are built.
"""

from starlette.convertors import Convertor, register_url_convertor

from weightsync.common import MODEL_NAME_PART, RESERVED_NAME_PARTS


class ModelNameConvertor(Convertor[str]):
    """A model name in a URL path: ``name`` or ``Org/Name`` whose second part is not a route word."""

    regex = rf"{MODEL_NAME_PART}(?:/(?!(?:{'|'.join(sorted(RESERVED_NAME_PARTS))})(?:/|$)){MODEL_NAME_PART})?"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("model", ModelNameConvertor())

from weightsync.service.routes import admin, health, ledger, models, objects, relays, server, ui, versions  # noqa: E402

ROUTERS = [
    health.router,
    server.router,
    models.router,
    versions.router,
    objects.router,
    ledger.router,
    relays.router,
    admin.router,
    ui.router,
]

__all__ = ["ROUTERS", "ModelNameConvertor"]
