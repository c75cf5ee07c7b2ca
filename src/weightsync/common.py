"""Small primitives every layer shares: names and digests, exact reads, backoff, sizes, the version.

This module sits beside :mod:`weightsync.errors` on the lowest floor: it imports nothing of
weightsync but the errors, so codec, store, catalog, ops, service and client may all use it.
"""

from __future__ import annotations

import gc
import os
import random
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from weightsync import errors

__all__ = [
    "DIGEST_PATTERN",
    "MODEL_NAME_MAX",
    "MODEL_NAME_PATTERN",
    "VERSION",
    "Backoff",
    "check_digest",
    "check_model_name",
    "gc_paused",
    "human_bytes",
    "is_digest",
    "model_path_name",
    "pread_exact",
    "removal_message",
    "removed_content",
]

VERSION = "0.1.0"
"""The package version (pyproject.toml reads it from here)."""

DIGEST_PATTERN = re.compile(r"[0-9a-f]{64}")
"""A SHA-256 digest as stored objects are named: 64 lowercase hex digits (use ``fullmatch``)."""

MODEL_NAME_PART = r"[A-Za-z0-9][A-Za-z0-9._-]*"
MODEL_NAME_PATTERN = re.compile(rf"{MODEL_NAME_PART}(?:/{MODEL_NAME_PART})?")
"""A model name's shape (docs/DESIGN.md "Concepts"; use ``fullmatch``): ``name`` or Hugging Face-style
``Org/Name``. :func:`check_model_name` adds the length cap and the reserved words."""
MODEL_NAME_MAX = 96
RESERVED_NAME_PARTS = frozenset({"versions", "plan", "publishes", "watch", "events", "replicas", "pin"})
"""Words of the API's model routes: the part after ``/`` may not be one (``Org/versions`` would read as a route)."""


def is_digest(value: object) -> bool:
    """True if ``value`` is a lowercase hex SHA-256 digest."""
    return isinstance(value, str) and DIGEST_PATTERN.fullmatch(value) is not None


def check_digest(value: object) -> str:
    """Return ``value`` if it is a lowercase hex SHA-256 digest, else raise InvalidDigest."""
    if not is_digest(value):
        raise errors.InvalidDigest(f"not a lowercase hex SHA-256 digest: {value!r:.80}")
    assert isinstance(value, str)
    return value


def check_model_name(name: object) -> str:
    """Return ``name`` if it is a valid model name, else raise InvalidName.

    Letters of both cases, digits and ``._-``, starting with a letter or digit, with at most one
    ``/`` (``Org/Name``, each part starting with a letter or digit); at most 96 characters; no
    ``--`` (local paths map ``/`` to ``--``) or ``..``; the part after ``/`` is not a word of the
    API's routes. Case is preserved and compared exactly.
    """
    if not isinstance(name, str) or MODEL_NAME_PATTERN.fullmatch(name) is None:
        raise errors.InvalidName(
            f"invalid model name {name!r:.140}: use letters, digits and ._- (at most one /, as in Org/Name), "
            "starting with a letter or digit"
        )
    if len(name) > MODEL_NAME_MAX:
        raise errors.InvalidName(f"invalid model name {name!r:.140}: longer than {MODEL_NAME_MAX} characters")
    if "--" in name or ".." in name:
        raise errors.InvalidName(f"invalid model name {name!r:.140}: '--' and '..' are not allowed")
    if "/" in name and name.split("/", 1)[1] in RESERVED_NAME_PARTS:
        words = ", ".join(sorted(RESERVED_NAME_PARTS))
        raise errors.InvalidName(f"invalid model name {name!r:.140}: the part after / may not be one of {words}")
    return name


def model_path_name(name: str) -> str:
    """A model name as one local path component (caches, default checkouts): ``Org/Name`` → ``Org--Name``."""
    return check_model_name(name).replace("/", "--")


def pread_exact(fd: int, n: int, offset: int) -> bytes:
    """Read exactly ``n`` bytes of ``fd`` at ``offset``; StoreError if the file ends first.

    Immutable objects never shrink: a short read means someone truncated one, and a caller
    must never get fewer bytes than it was promised.
    """
    parts: list[bytes] = []
    while n:
        b = os.pread(fd, n, offset)
        if not b:
            raise errors.StoreError(f"file shrank while reading at offset {offset}")
        parts.append(b)
        n -= len(b)
        offset += len(b)
    return b"".join(parts)


@dataclass(frozen=True)
class Backoff:
    """Bounded exponential backoff with full jitter: the one retry policy of store, client and watch.

    Retry number ``attempt`` (from 0) waits a uniform random time in
    ``[0, min(cap, base * 2**attempt)]`` ("full jitter" spreads out clients that failed
    together); ``attempts`` is the number of tries in all, the first included. A server's
    ``Retry-After`` (seconds) replaces the random wait, bounded by ``3 * cap``.
    Thread-safe: instances are immutable.
    """

    attempts: int = 6
    base: float = 0.2
    cap: float = 10.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise errors.InvalidArgument(f"attempts must be at least 1, not {self.attempts}")
        if self.base < 0 or self.cap < 0:
            raise errors.InvalidArgument("backoff delays must not be negative")

    def ceiling(self, attempt: int) -> float:
        """The longest wait before retry number ``attempt`` (0-based)."""
        return min(self.cap, self.base * (2.0 ** min(max(attempt, 0), 62)))

    def delay(self, attempt: int, retry_after: str | None = None, *, rng: random.Random | None = None) -> float:
        """The wait before retry number ``attempt`` (0-based), honouring a server's Retry-After.

        ``rng`` makes the jitter reproducible (tests, seeded wrappers); default: the module's.
        """
        if retry_after:
            try:
                seconds = float(retry_after)
            except ValueError:
                seconds = -1.0
            if seconds >= 0:
                return min(seconds, self.cap * 3)
        return (rng or random).uniform(0, self.ceiling(attempt))


_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: float) -> str:
    """A byte count for people, in binary units: ``512 B``, ``1.5 KiB``, ``45.4 MiB``."""
    value = float(n)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def removed_content(old: dict[str, set[str]], new: dict[str, set[str]], *, single_file: bool = False) -> list[str]:
    """What a version drops of its parent: files (by path) and ``path:tensor`` of the files it keeps.

    `old` and `new` map each file's path to the names of its tensors. With `single_file` both
    hold one file, which may be renamed: it is compared with the other's one file.
    """
    pairs: list[tuple[str, set[str], set[str] | None]]
    if single_file and len(old) == len(new) == 1:
        pairs = [(path, names, next(iter(new.values()))) for path, names in old.items()]
    else:
        pairs = [(path, names, new.get(path)) for path, names in old.items()]
    out: list[str] = []
    for path, names, kept in sorted(pairs):
        if kept is None:
            out.append(path)
        else:
            out += [f"{path}:{name}" for name in sorted(names - kept)]
    return out


def removal_message(parent: int | None, dropped: list[str]) -> str:
    """The one-line refusal of a version that drops `dropped` (from :func:`removed_content`) of v`parent`."""
    more = f" and {len(dropped) - 3} more" if len(dropped) > 3 else ""
    return (
        f"version {parent} has {len(dropped)} file(s) or tensor(s) this version drops ({', '.join(dropped[:3])}{more}):"
        " publish with allow_removals (CLI --allow-removals) if that is intended"
    )


_gc_lock = threading.Lock()
_gc_depth = 0
_gc_restore = False


@contextmanager
def gc_paused() -> Iterator[None]:
    """Hold Python's cyclic garbage collector off for the block (reference counting still frees everything else).

    A model of tens of thousands of tensors makes tens of thousands of small objects per
    publish, prepare and apply (manifest entries, views, checksums); each allocation burst
    set off full collections that walk the whole process heap, about half of those calls'
    time at 20,000 tensors (docs/SCALE-RUNS.md "Many tensors"). Cycles made inside the block are
    collected after it. Re-entrant and thread-safe: the collector comes back when the last
    block open in the process ends, and only if it was on when the first one began.
    """
    global _gc_depth, _gc_restore
    with _gc_lock:
        if _gc_depth == 0:
            _gc_restore = gc.isenabled()
            gc.disable()
        _gc_depth += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_depth -= 1
            if _gc_depth == 0 and _gc_restore:
                gc.enable()
