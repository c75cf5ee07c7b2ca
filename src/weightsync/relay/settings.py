"""The relay's configuration: the service's settings plus the upstream it mirrors (``WEIGHTSYNC_*``)."""

from __future__ import annotations

import socket

from pydantic import Field, SecretStr, field_validator

from weightsync.service.settings import Settings

__all__ = ["RelaySettings"]


class RelaySettings(Settings):
    """Everything a relay needs: where to listen and store (as ``serve``), and what to mirror from where."""

    upstream: str = Field(description="Root URL of the server (origin or relay) this relay mirrors.")
    upstream_token: SecretStr | None = Field(None, description="Bearer token (read scope) for the upstream.")
    models: str | None = Field(
        None,
        description="Comma-separated patterns of the models to mirror (token pattern rules: *, **, ?); default all.",
    )
    site: str | None = Field(None, description="This relay's site, given with the replica reports it forwards.")
    relay_poll_s: float = Field(
        5.0, gt=0, le=300, description="How often the upstream's model list is read (new models, missed events)."
    )
    prefetch_concurrency: int = Field(4, ge=1, le=64, description="Objects fetched from the upstream at once.")
    upstream_timeout_s: float = Field(60.0, gt=0, description="Timeout of one upstream request (seconds).")
    heartbeat_s: float = Field(10.0, gt=0, le=3600, description="How often the relay reports itself upstream.")
    evict_keep: int | None = Field(
        None,
        ge=1,
        description="Keep the object bytes of the chains of each model's newest N versions (and of pinned and "
        "leased chains), evict the others' (fetched again on demand); default: keep every byte.",
    )
    evict_interval_s: float = Field(300.0, gt=0, description="How often eviction runs (with evict_keep).")

    @field_validator("upstream")
    @classmethod
    def _root_url(cls, v: str) -> str:
        from weightsync import errors
        from weightsync.client._http import check_server_url

        try:
            return check_server_url(v)
        except errors.InvalidArgument as exc:
            raise ValueError(str(exc)) from None

    @field_validator("workers")
    @classmethod
    def _one_worker(cls, v: int) -> int:
        if v != 1:
            raise ValueError("a relay runs one worker process (its fetches are single-flight within it)")
        return v

    def model_patterns(self) -> list[str]:
        """The ``models`` patterns as a list (``["**"]``: every model)."""
        if not self.models:
            return ["**"]
        return [p.strip() for p in self.models.split(",") if p.strip()] or ["**"]

    def site_name(self) -> str:
        """The site given, else this host's name."""
        return self.site or socket.gethostname()
