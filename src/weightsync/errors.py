"""Every exception weightsync raises on purpose, in one module, and the error contract of the API and the CLI.

Callers catch :class:`WeightsyncError` for "any weightsync failure" or a
subclass for one cause. Each class names a cause, not a location: the same
:class:`DigestMismatch` is raised by the store, the service and the client.
Messages are one line and never contain secrets (tokens).

The classes are also the one error table (docs/API.md "Errors"): each carries, as
class attributes inherited by its subclasses, the problem ``code`` and HTTP ``status``
the service answers with, the problem ``title``, the CLI's ``exit_code`` and, for
404s, the ``resource`` that is missing. The service's problem+json rendering, the
client's problem → exception mapping (:func:`problem_class`) and the CLI's exit codes
(:func:`exit_code_of`) are all derived from these attributes. Giving a class its own
``code`` is the one line that adds a problem code to the API.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

# CLI exit codes (README "Exit codes"; docs/API.md "Errors").
EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_CONFLICT = 3
EXIT_AUTH = 4
EXIT_UNAVAILABLE = 5
EXIT_NOT_FOUND = 6

# A problem's ``type`` is this URL plus its code (docs/API.md "Errors").
PROBLEM_BASE = "https://weightsync.dev/problems/"

# (code, resource) -> the class a client raises for that problem; filled by WeightsyncError.__init_subclass__.
_RAISED_FOR: dict[tuple[str, str | None], type[WeightsyncError]] = {}


class WeightsyncError(Exception):
    """Base class of every error weightsync raises on purpose; its class attributes are its API contract.

    A class that sets ``code`` or ``resource`` in its own body is the class a client
    raises for that (code, resource) problem, unless it also sets ``client_raises =
    False`` (several server-side causes can share one code, e.g. ``unavailable``).
    Two classes claiming the same problem is an import-time TypeError, so the table
    cannot become ambiguous.
    """

    code: ClassVar[str] = "internal"
    title: ClassVar[str] = "Internal error"
    exit_code: ClassVar[int] = EXIT_ERROR
    resource: ClassVar[str | None] = None
    client_raises: ClassVar[bool] = True
    # Instance attributes with class defaults: a client sets them from the answer it received.
    status: int = 500
    problem: Mapping[str, Any] | None = None  # the problem+json body a client received (None: raised locally)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__dict__
        if ("code" in own or "resource" in own) and own.get("client_raises", True):
            key = (cls.code, cls.resource)
            other = _RAISED_FOR.get(key)
            if other is not None:
                raise TypeError(f"{cls.__name__} and {other.__name__} both claim problem {key}")
            _RAISED_FOR[key] = cls

    def problem_members(self) -> dict[str, Any]:
        """Extension members the service adds to this error's problem+json body (besides ``resource``)."""
        return {}

    @classmethod
    def from_problem(cls, message: str, problem: Mapping[str, Any]) -> WeightsyncError:
        """The exception a client raises for a problem+json body of this class's code (inverse of problem_members)."""
        return cls(message)


def problem_class(code: str, resource: str | None = None) -> type[WeightsyncError] | None:
    """The class a client raises for problem ``code`` (and 404 ``resource``); None for a code no class claims."""
    return _RAISED_FOR.get((code, resource))


def problem_classes() -> dict[tuple[str, str | None], type[WeightsyncError]]:
    """Every (code, resource) a class claims, and that class (a copy): the whole error table."""
    return dict(_RAISED_FOR)


def exit_code_of(exc: BaseException) -> int:
    """The CLI exit status for ``exc``: its class's ``exit_code``, 1 for anything that is not a WeightsyncError."""
    return exc.exit_code if isinstance(exc, WeightsyncError) else EXIT_ERROR


# --- codec and file formats (docs/FORMAT.md) -------------------------------------------


class FormatError(WeightsyncError):
    """Encoded bytes (frame, container, manifest) are malformed."""

    # The service meets malformed bytes only in what a publisher sent: a manifest (or what it names).
    code, status, title = "bad-manifest", 422, "Malformed manifest"


class BadMagic(FormatError):
    """The bytes do not start with the expected magic number."""


class UnsupportedVersion(FormatError):
    """The format version (or a flag bit) is one this reader does not know."""


class TruncatedInput(FormatError):
    """The input ends before a declared length is satisfied."""


class LimitExceeded(FormatError):
    """A declared size exceeds a cap or disagrees with what the context expects."""


class TooLarge(LimitExceeded):
    """A request body or object is over the receiver's size cap (HTTP 413)."""

    code, status, title = "too-large", 413, "Too large"


class CorruptData(FormatError):
    """A checksum does not match, or a compressed section does not decode."""


class ChecksumMismatch(CorruptData):
    """A decoded result does not hash to its recorded xxh3-128."""


class BaseMismatch(WeightsyncError):
    """A delta is being applied to bytes other than the base it was made against."""

    code, status, title, exit_code = "base-mismatch", 409, "Base mismatch", EXIT_CONFLICT


class UnsupportedDtype(WeightsyncError):
    """A tensor dtype the codec does not know."""


class SafetensorsError(FormatError):
    """A .safetensors file (header or layout) is invalid."""


class InvalidCheckpoint(FormatError):
    """A checkpoint must not be published: a safetensors file that does not parse, no safetensors weights, pickles.

    Raised by the publisher before anything is uploaded, and by the service for a
    manifest that describes such a version (codec/validate.py).
    """

    code, status, title = "invalid-checkpoint", 422, "Invalid checkpoint"


# --- lookups that found nothing ---------------------------------------------------------


class NotFound(WeightsyncError):
    """Something named does not exist; subclasses say what (``resource``). A 404 without ``resource``."""

    code, status, title, exit_code = "not-found", 404, "Not found", EXIT_NOT_FOUND


# --- store ----------------------------------------------------------------------------


class StoreError(WeightsyncError):
    """The object store failed in a way that retrying will not fix."""


class StoreUnavailable(StoreError):
    """A transient store failure (5xx, throttling, timeout): safe to retry."""

    code, status, title, exit_code = "unavailable", 503, "Store unavailable", EXIT_UNAVAILABLE
    client_raises = False  # a client raises ServerUnavailable for "unavailable"


class ObjectNotFound(StoreError, NotFound):
    """No object with that digest exists in the store."""

    resource = "object"
    exit_code = EXIT_ERROR  # a server missing an object it listed is a fault, not a name the user mistyped


class InvalidRange(StoreError):
    """A byte range is negative or reaches past the end of the object."""

    code, status, title = "bad-range", 416, "Range not satisfiable"


class Unsupported(StoreError):
    """The store lacks the capability the operation needs (see its ``capabilities``)."""

    code, status, title = "not-supported", 404, "Not supported"


class DigestMismatch(WeightsyncError):
    """Bytes do not hash to the digest the caller claimed."""

    code, status, title = "digest-mismatch", 422, "Digest mismatch"


class InvalidDigest(WeightsyncError):
    """A string is not a lowercase hex SHA-256 digest."""

    code, status, title = "invalid-digest", 422, "Invalid digest"


# --- catalog and operations -----------------------------------------------------------


class CatalogError(WeightsyncError):
    """The catalog database failed."""


class CatalogUnavailable(CatalogError):
    """The catalog database cannot be reached: safe to retry later."""

    code, status, title, exit_code = "unavailable", 503, "Catalog unavailable", EXIT_UNAVAILABLE
    client_raises = False  # a client raises ServerUnavailable for "unavailable"


class SchemaVersionError(CatalogError):
    """The catalog database's schema revision is not the one this code expects (newer, or not migrated)."""


class InvalidName(WeightsyncError):
    """A model or file name breaks the naming rules."""

    code, status, title = "invalid-name", 422, "Invalid name"


class InvalidArgument(WeightsyncError):
    """A caller-supplied value breaks its rules (a setting, a count, a state): a client error, not a server fault."""

    code, status, title = "invalid-argument", 422, "Invalid argument"


class ModelNotFound(NotFound):
    """No model with that name."""

    resource = "model"


class VersionNotFound(NotFound):
    """No (visible) version with that number."""

    resource = "version"


class Conflict(WeightsyncError):
    """Compare-and-swap lost: the stated parent is no longer the model's head."""

    code, status, title, exit_code = "conflict", 409, "Conflict", EXIT_CONFLICT


class StaleParent(Conflict):
    """The stated parent is not the model's head; ``current_head`` holds the head (None: no version yet)."""

    code, title = "stale-parent", "Stale parent"

    def __init__(self, message: str, *, current_head: int | None) -> None:
        super().__init__(message)
        self.current_head = current_head

    def problem_members(self) -> dict[str, Any]:
        return {"current_head": self.current_head}

    @classmethod
    def from_problem(cls, message: str, problem: Mapping[str, Any]) -> WeightsyncError:
        head = problem.get("current_head")
        return cls(message, current_head=head if isinstance(head, int) and not isinstance(head, bool) else None)


class PublishNotFound(NotFound):
    """No pending publish with that id (never begun, committed elsewhere or expired)."""

    resource = "publish"
    exit_code = EXIT_ERROR  # the publisher's own session expired: not a name the user mistyped


class IncompletePublish(WeightsyncError):
    """A commit names objects the store does not hold."""

    code, status, title, exit_code = "incomplete-publish", 409, "Incomplete publish", EXIT_CONFLICT


class FormatNotReadable(WeightsyncError):
    """The version is stored in a manifest format the client says it cannot read (plan ``formats``): upgrade it."""

    code, status, title = "format-not-readable", 406, "Format not readable"


class RemovesContent(Conflict):
    """A version drops files or tensors its parent had, and the publisher did not say removals are intended."""

    code, title = "removes-content", "Version removes content"


class PartConflict(Conflict):
    """The parts of a multi-part publish disagree (a part with other content, a file or tensor two parts
    claim with other bytes, another world size, parent, step or removal choice, a step begun again on top of
    the version it committed): nothing is committed."""

    code, title = "part-conflict", "Conflicting parts"


class ParentPending(Conflict):
    """A part of the next step arrived while the version it builds on is still pending: retry shortly."""

    code, title = "parent-pending", "Parent pending"


class ReadOnly(WeightsyncError):
    """The server is a read-only relay (``weightsync relay``): publish and change models at its upstream.

    ``upstream`` is the URL to publish to instead (a problem+json member).
    """

    code, status, title = "read-only", 405, "Read-only relay"

    def __init__(self, message: str, *, upstream: str | None = None) -> None:
        super().__init__(message)
        self.upstream = upstream

    def problem_members(self) -> dict[str, Any]:
        return {"upstream": self.upstream}

    @classmethod
    def from_problem(cls, message: str, problem: Mapping[str, Any]) -> WeightsyncError:
        upstream = problem.get("upstream")
        return cls(message, upstream=upstream if isinstance(upstream, str) else None)


# --- client ---------------------------------------------------------------------------


class ClientError(WeightsyncError):
    """The server answered with an error the client cannot recover from."""


class BadResponse(ClientError):
    """The server's answer does not have the documented shape (a field missing or of the wrong type)."""


class AuthError(ClientError):
    """Missing, invalid or insufficient token (HTTP 401/403)."""

    code, status, title, exit_code = "unauthorized", 401, "Unauthorized", EXIT_AUTH


class Forbidden(AuthError):
    """The token is valid but lacks the scope or the model (HTTP 403)."""

    code, status, title = "forbidden", 403, "Forbidden"


class ServerUnavailable(ClientError):
    """The server cannot be reached, or kept answering 5xx/503 after the client's retries: retry later."""

    code, status, title, exit_code = "unavailable", 503, "Service unavailable", EXIT_UNAVAILABLE


class UnmanagedFiles(Conflict):
    """A pull would replace files in a directory weightsync does not manage: pull elsewhere, or adopt it."""

    client_raises = False  # raised by the client itself; on the wire it would be a plain conflict


class ReloadRequired(WeightsyncError):
    """An update cannot be applied in place into the caller's tensors: load the version afresh.

    Raised when a tensor was added, or its dtype or shape changed.
    """
