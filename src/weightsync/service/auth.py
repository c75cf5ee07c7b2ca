"""Bearer tokens: scopes and model-name patterns (docs/API.md "Auth").

A token entry is ``{name, token_sha256 | token, scopes, models}``. Only SHA-256 hashes
are kept in memory; a presented token is hashed and compared with
``hmac.compare_digest`` against every entry. Tokens never appear in messages, logs or
errors: entries are named by their ``name`` (or their position).

Scopes nest: ``admin`` ⊇ ``publish`` ⊇ ``read``. ``models`` are patterns (case-sensitive) a
model name must match: ``*`` matches any characters but ``/``, ``**`` any characters, ``?`` one
character but ``/``; so ``policy-*`` does not match ``Org/policy-7b``, ``Org/*`` matches every
model of ``Org``, and the default ``["**"]`` every model. With no entries at all the
service runs in anonymous development mode: everyone is admin, but only on loopback.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weightsync.common import is_digest
from weightsync.service.settings import ConfigError, Settings, is_loopback

__all__ = ["SCOPES", "AuthDenied", "Principal", "TokenTable"]

SCOPES = ("read", "publish", "admin")
_IMPLIED = {"read": {"read"}, "publish": {"read", "publish"}, "admin": {"read", "publish", "admin"}}
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")


@functools.lru_cache(maxsize=1024)
def model_pattern(pattern: str) -> re.Pattern[str]:
    """A token's model pattern as a regex: ``**`` any characters, ``*`` any but ``/``, ``?`` one but ``/``."""
    out: list[str] = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out), re.DOTALL)


class AuthDenied(Exception):
    """Authentication (401) or authorization (403) failed; the message is safe to show."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


@dataclass(frozen=True)
class Principal:
    """Who is calling: a token's name, its (expanded) scopes and model patterns."""

    name: str
    scopes: frozenset[str]
    models: tuple[str, ...]
    anonymous: bool = False

    def may_use(self, model: str) -> bool:
        return any(model_pattern(p).fullmatch(model) is not None for p in self.models)

    def require(self, scope: str, model: str | None = None) -> None:
        """Raise AuthDenied(403) unless this principal has ``scope`` (and may touch ``model``)."""
        if scope not in self.scopes:
            raise AuthDenied(403, f"token {self.name!r} lacks the {scope!r} scope")
        if model is not None and not self.may_use(model):
            raise AuthDenied(403, f"token {self.name!r} may not access model {model!r}")


@dataclass(frozen=True)
class _Entry:
    name: str
    sha256: bytes
    scopes: frozenset[str]
    models: tuple[str, ...]


ANONYMOUS = Principal("anonymous", frozenset(SCOPES), ("**",), anonymous=True)


def hash_token(token: str) -> str:
    """The hex SHA-256 a token file's ``token_sha256`` holds."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


class TokenTable:
    """The configured tokens; an empty table means anonymous development mode."""

    def __init__(self, entries: Iterable[_Entry] = ()) -> None:
        self._entries = tuple(entries)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def anonymous(self) -> bool:
        return not self._entries

    @property
    def names(self) -> list[str]:
        return [e.name for e in self._entries]

    @classmethod
    def from_settings(cls, settings: Settings) -> TokenTable:
        """Load ``token_file`` and ``tokens``; ConfigError (one line, no secrets) on anything wrong."""
        raw: list[tuple[str, Any]] = []
        if settings.token_file is not None:
            raw += [(f"{settings.token_file}", e) for e in _read_file(settings.token_file)]
        if settings.tokens is not None and settings.tokens.get_secret_value().strip():
            raw += [
                ("WEIGHTSYNC_TOKENS", e) for e in _parse_json(settings.tokens.get_secret_value(), "WEIGHTSYNC_TOKENS")
            ]
        entries: list[_Entry] = []
        seen_names: set[str] = set()
        seen_hashes: set[bytes] = set()
        for i, (source, item) in enumerate(raw):
            entry = _entry(item, f"{source}: token entry {i + 1}")
            if entry.name in seen_names:
                raise ConfigError(f"{source}: token name {entry.name!r} is used twice")
            if entry.sha256 in seen_hashes:
                raise ConfigError(f"{source}: token {entry.name!r} has the same secret as another entry")
            seen_names.add(entry.name)
            seen_hashes.add(entry.sha256)
            entries.append(entry)
        return cls(entries)

    def authenticate(self, token: str | None) -> Principal:
        """The principal ``token`` names; AuthDenied(401) if missing or unknown."""
        if self.anonymous:
            return ANONYMOUS
        if not token:
            raise AuthDenied(401, "missing bearer token")
        presented = hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()
        found: _Entry | None = None
        for e in self._entries:  # compare with every entry: the time taken says nothing about which matched
            if hmac.compare_digest(presented, e.sha256):
                found = e
        if found is None:
            raise AuthDenied(401, "unknown bearer token")
        return Principal(found.name, found.scopes, found.models)

    def check_server_address(self, server: tuple[str, int] | None) -> None:
        """Anonymous mode answers only on loopback, whatever address the server was bound to."""
        if self.anonymous and server is not None and not is_loopback(str(server[0])):
            raise AuthDenied(401, "no tokens are configured: anonymous access is allowed on loopback only")


def _read_file(path: Path) -> list[Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read token file {path}: {exc.strerror or exc}") from None
    if path.suffix.lower() == ".toml":
        import tomllib

        try:
            doc = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML ({_first_line(exc)})") from None
        return _entries_of(doc, str(path))
    return _parse_json(text, str(path))


def _parse_json(text: str, source: str) -> list[Any]:
    try:
        doc = json.loads(text)
    except ValueError as exc:
        # The position only: the message of a JSON error can quote the (secret) text.
        pos = getattr(exc, "pos", None)
        raise ConfigError(f"{source}: not valid JSON" + (f" (at character {pos})" if pos is not None else "")) from None
    return _entries_of(doc, source)


def _entries_of(doc: Any, source: str) -> list[Any]:
    if isinstance(doc, dict) and set(doc) == {"tokens"}:
        doc = doc["tokens"]
    if not isinstance(doc, list):
        raise ConfigError(f'{source}: expected a list of token entries (or {{"tokens": [...]}})')
    return doc


def _entry(item: Any, where: str) -> _Entry:
    if not isinstance(item, dict):
        raise ConfigError(f"{where}: expected an object with name, token_sha256 (or token), scopes, models")
    unknown = set(item) - {"name", "token", "token_sha256", "scopes", "models"}
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}")
    name = item.get("name")
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ConfigError(f"{where}: name must be 1-64 characters of letters, digits and ._@-")
    where = f"{where} ({name!r})"
    has_plain, has_hash = "token" in item, "token_sha256" in item
    if has_plain == has_hash:
        raise ConfigError(f"{where}: give exactly one of token_sha256 and token")
    if has_hash:
        h = item["token_sha256"]
        if not isinstance(h, str) or not is_digest(h.lower()):
            raise ConfigError(f"{where}: token_sha256 must be 64 hex characters")
        digest = bytes.fromhex(h)
    else:
        t = item["token"]
        if not isinstance(t, str) or len(t) < 16:
            raise ConfigError(f"{where}: token must be a string of at least 16 characters")
        digest = hashlib.sha256(t.encode("utf-8")).digest()
    scopes = item.get("scopes")
    if isinstance(scopes, str):
        scopes = [scopes]
    if not isinstance(scopes, list) or not scopes or any(s not in _IMPLIED for s in scopes):
        raise ConfigError(f"{where}: scopes must be a non-empty list of {', '.join(SCOPES)}")
    models = item.get("models", ["**"])
    if isinstance(models, str):
        models = [models]
    if not isinstance(models, list) or not models or any(not isinstance(m, str) or not m for m in models):
        raise ConfigError(f"{where}: models must be a non-empty list of name patterns")
    expanded = frozenset().union(*(_IMPLIED[s] for s in scopes))
    return _Entry(name, digest, expanded, tuple(models))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
