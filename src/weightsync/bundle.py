"""The plan-with-objects answer of getPlan (docs/API.md "One request per update"): framing only.

A subscriber whose update is small asks ``GET /v1/models/{model}/plan?inline=N`` and, when the
plan's bytes are at most N, gets the plan *and* the manifests and objects it names in one
answer (``Content-Type: application/vnd.weightsync.plan-bundle``): one round trip per update
instead of a plan, then a batch of object reads. The body is

    magic "WSPB" | version u8 (1) | 3 zero bytes
    parts: name length u16 LE | name (ASCII) | size u64 LE | size bytes

The first part is named ``plan`` and holds the plan's JSON (as getPlan answers it); each
other part is named by an object's SHA-256 (64 hex) and holds the whole object. Readers
check every object against its name, as for any object read. Shared by the service (which
writes it) and the client (which reads it): this module imports nothing of weightsync but the
errors and the digest check.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

from weightsync import errors
from weightsync.common import is_digest

MEDIA_TYPE = "application/vnd.weightsync.plan-bundle"
MAGIC = b"WSPB"
VERSION = 1
_HEAD = struct.Struct("<4sB3x")
_NAME = struct.Struct("<H")
_SIZE = struct.Struct("<Q")
PLAN = "plan"
MAX_INLINE = 64 << 20
"""The most object bytes a server puts in one answer (a larger update is fetched the usual way)."""


def head() -> bytes:
    """The bundle's first bytes."""
    return _HEAD.pack(MAGIC, VERSION)


def part_header(name: str, size: int) -> bytes:
    """What precedes a part's `size` bytes."""
    raw = name.encode("ascii")
    return _NAME.pack(len(raw)) + raw + _SIZE.pack(size)


def part_overhead(name: str) -> int:
    return _NAME.size + len(name) + _SIZE.size


def encode(plan_json: bytes, objects: dict[str, bytes]) -> bytes:
    """A whole bundle (tests and small answers): the plan, then `objects` by digest."""
    out = [head(), part_header(PLAN, len(plan_json)), plan_json]
    for digest, data in objects.items():
        out += [part_header(digest, len(data)), data]
    return b"".join(out)


def parts(body: bytes | memoryview) -> Iterator[tuple[str, memoryview]]:
    """The (name, bytes) parts of a bundle, plan first; BadResponse on anything malformed."""
    view = memoryview(body)
    if len(view) < _HEAD.size or _HEAD.unpack_from(view)[0] != MAGIC:
        raise errors.BadResponse("plan bundle: bad magic")
    if view[4] != VERSION:
        raise errors.BadResponse(f"plan bundle: version {view[4]}, this client reads {VERSION}")
    at = _HEAD.size
    first = True
    while at < len(view):
        if at + _NAME.size > len(view):
            raise errors.BadResponse("plan bundle: truncated part header")
        (n,) = _NAME.unpack_from(view, at)
        at += _NAME.size
        if at + n + _SIZE.size > len(view):
            raise errors.BadResponse("plan bundle: truncated part header")
        try:
            name = bytes(view[at : at + n]).decode("ascii")
        except UnicodeDecodeError:
            raise errors.BadResponse("plan bundle: a part name is not ASCII") from None
        at += n
        (size,) = _SIZE.unpack_from(view, at)
        at += _SIZE.size
        if size > len(view) - at:
            raise errors.BadResponse(f"plan bundle: part {name!r} is truncated")
        if first != (name == PLAN) or (not first and not is_digest(name)):
            raise errors.BadResponse(f"plan bundle: unexpected part {name!r}")
        yield name, view[at : at + size]
        at += size
        first = False
    if first:
        raise errors.BadResponse("plan bundle: no plan")
