"""The service's configuration: one pydantic-settings class, read from ``WEIGHTSYNC_*`` variables.

Every field is also settable as a keyword (the ``serve`` command passes its flags that
way, and they win over the environment). docs/DEPLOY.md has the table of variables.
"""

from __future__ import annotations

import functools
import ipaddress
from datetime import timedelta
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["ConfigError", "Settings", "describe_validation_error", "is_loopback"]


class ConfigError(ValueError):
    """The service configuration is unusable; the message is one line and names the setting."""


class Settings(BaseSettings):
    """Everything the service needs to start. Immutable once built."""

    model_config = SettingsConfigDict(env_prefix="WEIGHTSYNC_", extra="ignore", frozen=True)

    data: Path = Field(Path("weightsync-data"), description="Directory of the embedded catalog and store.")
    host: str = Field("127.0.0.1", description="Address to bind.")
    port: int = Field(8400, ge=0, le=65535)
    catalog: str | None = Field(None, description="Catalog URL (default sqlite:///<data>/catalog.db).")
    store: str | None = Field(None, description="Store URL: a path or s3://bucket/prefix (default <data>/store).")
    s3_endpoint: str | None = Field(None, description="S3 endpoint URL (MinIO, SeaweedFS, …); default AWS.")
    s3_region: str | None = None
    s3_access_key_id: str | None = None
    s3_secret_access_key: SecretStr | None = None
    # Shorter than the clients' own timeouts, so a stalled store fails a request (503) before
    # the client gives up and retries onto the same stall.
    s3_connect_timeout_s: float = Field(5.0, gt=0, description="S3 connect timeout (seconds).")
    s3_read_timeout_s: float = Field(20.0, gt=0, description="S3 read timeout (seconds).")
    token_file: Path | None = Field(None, description="JSON or TOML file of bearer tokens.")
    tokens: SecretStr | None = Field(None, description="Bearer tokens as JSON (same shape as the file).")
    pending_ttl_s: float = Field(3600.0, gt=0, description="How long a begun publish may take to commit.")
    gc_grace_s: float = Field(3600.0, ge=0, description="How long an unreferenced object survives GC.")
    lease_ttl_s: float = Field(600.0, gt=0, description="How long a plan's lease holds a chain.")
    max_object_size: int = Field(4 << 30, gt=0, description="Largest object accepted (bytes).")
    max_upload_body: int = Field(4 << 30, gt=0, description="Largest PUT body the service proxies (bytes).")
    max_json_body: int = Field(16 << 20, gt=0, description="Largest JSON request body (bytes).")
    object_memory: int = Field(
        64 << 20, ge=0, description="Bytes of small objects a process keeps in memory for the plans (0: none)."
    )
    workers: int = Field(1, ge=1, le=64)
    threads: int = Field(32, ge=4, le=512, description="Worker threads per process (catalog calls, hashing).")
    db_pool_size: int = Field(10, ge=1, le=200)
    presign: bool = Field(True, description="Hand out presigned S3 URLs when the store supports them.")
    presign_expires_s: int = Field(3600, ge=1, le=7 * 86400)
    watch_poll_s: float = Field(
        0.1, gt=0, le=10, description="Catalog poll interval of watch and events (one read per model for all of them)."
    )
    announce: bool = Field(
        True,
        description=(
            "PostgreSQL: tell the other processes on the catalog of commits, pins and deletions (NOTIFY), and hear "
            "theirs on one LISTEN connection, so their followers hear at once. Off behind a pooler that does not "
            "keep LISTEN (PgBouncer in transaction mode): followers of other processes then wait for the poll."
        ),
    )
    sse_keepalive_s: float = Field(15.0, gt=0, le=300)
    ui_stale_after_s: float = Field(
        300.0, gt=0, description="The dashboard marks a replica stale once it is this long behind the head (seconds)."
    )
    shutdown_grace_s: float = Field(10.0, ge=0, description="Wait this long for open requests at shutdown.")
    log_level: Literal["debug", "info", "warning", "error", "critical"] = "info"

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower(cls, v: object) -> object:
        return v.lower() if isinstance(v, str) else v

    def data_dir(self) -> Path:
        return self.data.expanduser().resolve()

    def catalog_url(self) -> str:
        return self.catalog or f"sqlite:///{self.data_dir() / 'catalog.db'}"

    def store_url(self) -> str:
        return self.store or str(self.data_dir() / "store")

    def is_s3(self) -> bool:
        return self.store_url().lower().startswith("s3://")

    def ops_settings(self):  # -> weightsync.ops.OpsSettings (imported lazily: it pulls in numpy)
        from weightsync.ops import OpsSettings

        return OpsSettings(
            pending_ttl=timedelta(seconds=self.pending_ttl_s),
            gc_grace=timedelta(seconds=self.gc_grace_s),
            lease_ttl=timedelta(seconds=self.lease_ttl_s),
            max_object_bytes=self.max_object_size,
            hot_object_bytes=self.object_memory,
            announce=self.announce,
        )

    def upload_cap(self) -> int:
        """Largest body ``PUT /v1/objects/{digest}`` accepts."""
        return min(self.max_object_size, self.max_upload_body)


@functools.lru_cache(maxsize=256)  # asked on every anonymous request, of the address it came in on
def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the service reachable from this machine only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def describe_validation_error(exc: ValidationError) -> str:
    """One line naming the first bad setting (never its value: it may be a secret)."""
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err.get("loc", ())) or "settings"
    return f"invalid setting {where} (WEIGHTSYNC_{where.upper()}): {err.get('msg', 'invalid')}"
