"""The authorization contract of docs/API.md as data: which scope each operationId needs, and who may pass.

Both the API fuzzer (test_api_fuzz.py) and the role x endpoint matrix (test_security.py)
read the live ``/openapi.json`` and look every operationId up here; an operation missing
from :data:`REQUIRED_SCOPE` fails those tests, so a new endpoint cannot ship without an
authorization decision.
"""

from __future__ import annotations

import fnmatch

from _sec_server import PRINCIPALS

# operationId -> the scope it needs (None: public), and whether the {model} path parameter
# (or createModel's body "name") is checked against the token's model patterns.
REQUIRED_SCOPE: dict[str, tuple[str | None, bool]] = {
    "health": (None, False),
    "ready": (None, False),
    "metrics": (None, False),
    "listModels": ("read", False),  # 200 for any reader, filtered to the models it may see
    "createModel": ("publish", True),
    "getModel": ("read", True),
    "listVersions": ("read", True),
    "getVersion": ("read", True),
    "getLineage": ("read", True),
    "getManifest": ("read", True),
    "getPlan": ("read", True),
    "beginPublish": ("publish", True),
    "checkObjects": ("publish", True),
    "commitPublish": ("publish", True),
    "publishVersion": ("publish", True),
    "commitPart": ("publish", True),
    "abortPublish": ("publish", True),
    "watchModel": ("read", True),
    "streamEvents": ("read", True),
    "putObject": ("publish", False),  # objects are content-addressed and shared by every model
    "getObject": ("read", False),
    "headObject": ("read", False),
    "presignObject": ("read", False),
    "reportReplica": ("read", True),
    "listReplicas": ("read", True),
    "relayHeartbeat": ("read", False),  # a relay's own token upstream is a read token
    "listRelays": ("read", False),
    "fsck": ("admin", False),
    "gc": ("admin", False),
    "getInfo": ("read", False),
    "updateModel": ("publish", True),
    "deleteModel": ("admin", True),
    "pinModel": ("publish", True),
    "unpinModel": ("publish", True),
}

_IMPLIED = {"read": {"read"}, "publish": {"read", "publish"}, "admin": {"read", "publish", "admin"}}
# The callers of the matrix: no header, an unknown token, and the configured principals.
CALLERS = ["none", "bad", "reader", "publisher", "admin", "other"]


def operations(schema: dict) -> list[tuple[str, str, str]]:
    """(operationId, METHOD, path) of every operation in an OpenAPI document."""
    out = []
    for path, item in schema["paths"].items():
        for method, op in item.items():
            if method in ("get", "put", "post", "delete", "head", "patch", "options"):
                out.append((op["operationId"], method.upper(), path))
    return sorted(out)


def allowed(operation_id: str, caller: str, model: str | None) -> bool | None:
    """Whether ``caller`` may use the operation on ``model``: True, False, or None when the server cannot
    know yet (an invalid model name may be refused before or after the token is checked)."""
    scope, model_scoped = REQUIRED_SCOPE[operation_id]
    if scope is None:
        return True
    if caller in ("none", "bad"):
        return False
    scopes, patterns = PRINCIPALS[caller]
    have = set().union(*(_IMPLIED[s] for s in scopes))
    if scope not in have:
        return False
    if model_scoped:
        if not isinstance(model, str):
            return None
        return any(fnmatch.fnmatchcase(model, p) for p in patterns)
    return True


def expected_denial(operation_id: str, caller: str, model: str | None) -> int | None:
    """The status a denied caller must get (401 unauthenticated, 403 forbidden); None if allowed."""
    if allowed(operation_id, caller, model) is not False:
        return None
    return 401 if caller in ("none", "bad") else 403
