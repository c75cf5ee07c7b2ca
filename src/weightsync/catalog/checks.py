"""Argument checks of the catalog's public methods, run before any transaction opens.

Each raises a named error of :mod:`weightsync.errors`: ``InvalidName`` and ``InvalidDigest`` for
names and digests, ``InvalidArgument`` for any other caller-supplied value outside its rules
(the service answers 422), ``IncompletePublish`` for an object listed with two sizes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

from .. import errors
from ..common import check_digest, check_model_name
from .schema import KINDS

__all__ = [
    "DEFAULT_PENDING_TTL",
    "DEFAULT_SETTINGS",
    "LABEL_MAX",
    "TOKEN_MAX",
    "UNSET",
    "digest",
    "finite_nonneg",
    "json_object",
    "kind",
    "label",
    "nonneg",
    "object_refs",
    "positive_ttl",
    "settings",
    "utc",
    "validate_model_name",
]


#: Longest publish id or idempotency key.
TOKEN_MAX = 128
#: Longest subscriber, site, host or lease holder.
LABEL_MAX = 255

#: How long a pending publish lives when the caller does not say.
DEFAULT_PENDING_TTL = timedelta(hours=1)

#: Settings of a new model when the caller does not give them.
DEFAULT_SETTINGS: dict[str, Any] = {"keyframe_interval": 20, "max_chain_ratio": 0.5, "keep_last": None}


class Unset:
    """The type of :data:`UNSET`: "the caller did not give this setting" (None means "keep all")."""

    def __repr__(self) -> str:
        return "UNSET"


#: Default of optional settings, told apart from an explicit None.
UNSET: Any = Unset()


def validate_model_name(name: str) -> str:
    """Return ``name`` if it is a valid model name (common.check_model_name), else raise InvalidName."""
    return check_model_name(name)


def digest(d: str) -> str:
    """Return ``d`` if it is a lowercase hex SHA-256 digest, else raise InvalidDigest."""
    return check_digest(d)


def nonneg(name: str, v: int) -> int:
    """Return ``v`` if it is an integer >= 0 (not a bool), else raise InvalidArgument."""
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise errors.InvalidArgument(f"{name} must be a non-negative integer, not {v!r}")
    return v


def finite_nonneg(name: str, v: float) -> float:
    """Return ``v`` if it is a finite number >= 0 (not a bool), else raise InvalidArgument."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise errors.InvalidArgument(f"{name} must be a finite number >= 0, not {v!r}")
    return v


def label(name: str, v: str, limit: int = LABEL_MAX) -> str:
    """Return ``v`` if it is a non-empty string of at most ``limit`` characters, else raise InvalidArgument."""
    if not isinstance(v, str) or not 0 < len(v) <= limit:
        raise errors.InvalidArgument(f"{name} must be a non-empty string of at most {limit} characters")
    return v


def kind(v: str, parent: int | None) -> str:
    """Return ``v`` if it is a known version kind that fits ``parent`` (a delta needs one), else InvalidArgument."""
    if v not in KINDS:
        raise errors.InvalidArgument(f"kind must be one of {KINDS}, not {v!r}")
    if v == "delta" and parent is None:
        raise errors.InvalidArgument("a delta needs a parent")
    return v


def json_object(name: str, v: dict[str, Any] | None) -> dict[str, Any]:
    """Return ``v`` (None: ``{}``) as it reads back from the database; InvalidArgument if not a JSON object."""
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise errors.InvalidArgument(f"{name} must be a JSON object")
    try:
        # Round-trip so the stored value is exactly what reading it back gives.
        out: dict[str, Any] = json.loads(json.dumps(v, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise errors.InvalidArgument(f"{name} is not JSON-serializable: {exc}") from None
    return out


def utc(now: datetime | None) -> datetime:
    """Return ``now`` in UTC (None: the current time); InvalidArgument for a naive timestamp."""
    if now is None:
        return datetime.now(UTC)
    if now.tzinfo is None:
        raise errors.InvalidArgument("timestamps must be timezone-aware")
    return now.astimezone(UTC)


def positive_ttl(ttl: timedelta | float) -> timedelta:
    """Return ``ttl`` (seconds or a timedelta) as a timedelta; InvalidArgument unless positive."""
    out = ttl if isinstance(ttl, timedelta) else timedelta(seconds=ttl)
    if out <= timedelta(0):
        raise errors.InvalidArgument("ttl must be positive")
    return out


def settings(keyframe_interval: Any, max_chain_ratio: Any, keep_last: Any) -> dict[str, Any]:
    """Return the given (not :data:`UNSET`) model settings as a dict; InvalidArgument for a bad one."""
    out: dict[str, Any] = {}
    if keyframe_interval is not UNSET:
        if isinstance(keyframe_interval, bool) or not isinstance(keyframe_interval, int) or keyframe_interval < 1:
            raise errors.InvalidArgument(f"keyframe_interval must be an integer >= 1, not {keyframe_interval!r}")
        out["keyframe_interval"] = keyframe_interval
    if max_chain_ratio is not UNSET:
        if (
            isinstance(max_chain_ratio, bool)
            or not isinstance(max_chain_ratio, (int, float))
            or not math.isfinite(max_chain_ratio)
            or max_chain_ratio <= 0
        ):
            raise errors.InvalidArgument(f"max_chain_ratio must be a finite number > 0, not {max_chain_ratio!r}")
        out["max_chain_ratio"] = float(max_chain_ratio)
    if keep_last is not UNSET:
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
            raise errors.InvalidArgument(f"keep_last must be None (keep all) or an integer >= 1, not {keep_last!r}")
        out["keep_last"] = keep_last
    return out


def object_refs(objects: Iterable[tuple[str, int]]) -> dict[str, int]:
    """Return ``objects`` [(digest, size)] as digest -> size; IncompletePublish if one is listed with two sizes."""
    out: dict[str, int] = {}
    for d, size in objects:
        digest(d)
        nonneg("object size", size)
        if out.setdefault(d, size) != size:
            raise errors.IncompletePublish(f"object {d} is listed with sizes {out[d]} and {size}")
    return out
