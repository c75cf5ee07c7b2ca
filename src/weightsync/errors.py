"""Every exception weightsync raises on purpose, in one module.

Callers catch :class:`WeightsyncError` for "any weightsync failure" or a
subclass for one cause. Each class names a cause, not a location: the same
:class:`DigestMismatch` is raised by the store, the service and the client.
Messages are one line and never contain secrets (tokens).
"""

from __future__ import annotations


class WeightsyncError(Exception):
    """Base class of every error weightsync raises on purpose."""


# --- codec and file formats (docs/FORMAT.md) -------------------------------------------


class FormatError(WeightsyncError):
    """Encoded bytes (frame, container, manifest) are malformed."""


class BadMagic(FormatError):
    """The bytes do not start with the expected magic number."""


class UnsupportedVersion(FormatError):
    """The format version (or a flag bit) is one this reader does not know."""


class TruncatedInput(FormatError):
    """The input ends before a declared length is satisfied."""


class LimitExceeded(FormatError):
    """A declared size exceeds a cap or disagrees with what the context expects."""


class CorruptData(FormatError):
    """A checksum does not match, or a compressed section does not decode."""


class ChecksumMismatch(CorruptData):
    """A decoded result does not hash to its recorded xxh3-128."""


class BaseMismatch(WeightsyncError):
    """A delta is being applied to bytes other than the base it was made against."""


class UnsupportedDtype(WeightsyncError):
    """A tensor dtype the codec does not know."""


class SafetensorsError(FormatError):
    """A .safetensors file (header or layout) is invalid."""


# --- store ----------------------------------------------------------------------------


class StoreError(WeightsyncError):
    """The object store failed in a way that retrying will not fix."""


class StoreUnavailable(StoreError):
    """A transient store failure (5xx, throttling, timeout): safe to retry."""


class ObjectNotFound(StoreError):
    """No object with that digest exists in the store."""


class InvalidRange(StoreError):
    """A byte range is negative or reaches past the end of the object."""


class Unsupported(StoreError):
    """The store lacks the capability the operation needs (see its ``capabilities``)."""


class DigestMismatch(WeightsyncError):
    """Bytes do not hash to the digest the caller claimed."""


class InvalidDigest(WeightsyncError):
    """A string is not a lowercase hex SHA-256 digest."""


# --- catalog and operations -----------------------------------------------------------


class CatalogError(WeightsyncError):
    """The catalog database failed."""


class CatalogUnavailable(CatalogError):
    """The catalog database cannot be reached: safe to retry later."""


class SchemaVersionError(CatalogError):
    """The catalog database's schema revision is not the one this code expects (newer, or not migrated)."""


class InvalidName(WeightsyncError):
    """A model or file name breaks the naming rules."""


class InvalidArgument(WeightsyncError):
    """A caller-supplied value breaks its rules (a setting, a count, a state): a client error, not a server fault."""


class ModelNotFound(WeightsyncError):
    """No model with that name."""


class VersionNotFound(WeightsyncError):
    """No (visible) version with that number."""


class Conflict(WeightsyncError):
    """Compare-and-swap lost: the stated parent is no longer the model's head."""


class StaleParent(Conflict):
    """The stated parent is not the model's head; ``current_head`` holds the head (None: no version yet)."""

    def __init__(self, message: str, *, current_head: int | None) -> None:
        super().__init__(message)
        self.current_head = current_head


class PublishNotFound(WeightsyncError):
    """No pending publish with that id (never begun, committed elsewhere or expired)."""


class IncompletePublish(WeightsyncError):
    """A commit names objects the store does not hold."""


# --- client ---------------------------------------------------------------------------


class ClientError(WeightsyncError):
    """The server answered with an error the client cannot recover from."""


class AuthError(ClientError):
    """Missing, invalid or insufficient token (HTTP 401/403)."""


class ServerUnavailable(ClientError):
    """The server cannot be reached, or kept answering 5xx/503 after the client's retries: retry later."""


class ReloadRequired(WeightsyncError):
    """An update cannot be applied in place into the caller's tensors (a tensor added, or its dtype or shape changed): load the version afresh."""
