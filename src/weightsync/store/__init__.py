"""Content-addressed object store: immutable bytes named by their SHA-256 (docs/STORE.md).

The interface is :class:`ObjectStore`; providers are parallel modules
(``fs``, ``s3``) loaded only by :func:`open_store`, so importing this package
never imports aioboto3. Retry and fault injection are wrappers
(:class:`RetryingStore`, :class:`weightsync.store.faulty.FaultyStore`).

Typical use::

    async with RetryingStore(open_store("s3://bucket/prefix", create_bucket=True)) as store:
        result = await store.put(data)
        assert await store.get(result.digest) == data
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import unquote, urlsplit

from weightsync import errors
from weightsync.store.base import (
    DEFAULT_CHUNK_SIZE,
    Capabilities,
    ForwardingStore,
    ObjectInfo,
    ObjectStore,
    PresignedRequest,
    PutResult,
    sha256_hex,
    validate_digest,
)
from weightsync.store.retry import RetryingStore

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "Capabilities",
    "ForwardingStore",
    "ObjectInfo",
    "ObjectStore",
    "PresignedRequest",
    "PutResult",
    "RetryingStore",
    "open_store",
    "sha256_hex",
    "validate_digest",
]


def open_store(url: str | os.PathLike[str], **options: Any) -> ObjectStore:
    """Return the store ``url`` names, unopened; StoreError for a scheme no provider handles.

    * a plain path or ``file:///abs/path`` → :class:`weightsync.store.fs.FsStore`
      (options: ``fsync``, ``create``);
    * ``s3://bucket/optional/prefix`` → :class:`weightsync.store.s3.S3Store`
      (options: ``endpoint_url``, ``region``, ``access_key_id``,
      ``secret_access_key``, ``session_token``, ``create_bucket``,
      ``part_size``, ``max_concurrency``, ``verify_conditional_writes``, …;
      credentials default to the usual ``AWS_*`` environment variables).

    Providers are imported here, on demand: the S3 dependencies are only
    needed by processes that use S3.
    """
    text = os.fspath(url)
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    # One-letter "schemes" are Windows drive letters (C:\data), i.e. paths.
    if scheme == "" or len(scheme) == 1:
        from weightsync.store.fs import FsStore

        return FsStore(text, **options)
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise errors.StoreError(f"file URLs must name a local path, not host {parts.netloc!r}")
        from weightsync.store.fs import FsStore

        return FsStore(unquote(parts.path), **options)
    if scheme == "s3":
        if not parts.netloc:
            raise errors.StoreError("s3 URL has no bucket: expected s3://bucket/prefix")
        from weightsync.store.s3 import S3Store

        return S3Store(parts.netloc, unquote(parts.path).strip("/"), **options)
    raise errors.StoreError(f"unsupported store URL scheme {parts.scheme!r}")
