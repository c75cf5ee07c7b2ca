"""A JSON part and whole objects in one body (docs/API.md "One request per update"): framing only.

Two requests use it. A subscriber whose update is small asks ``GET /v1/models/{model}/plan?inline=N``
and, when the plan's bytes are at most N, gets the plan *and* the manifests and objects it names
in one answer (``Content-Type: application/vnd.weightsync.plan-bundle``): one round trip per
update instead of a plan, then a batch of object reads. A publisher whose version is small sends
``POST /v1/models/{model}/versions`` (publishVersion) with the begin's JSON and the version's
objects in one body (``application/vnd.weightsync.publish-bundle``): one request per version
instead of begin, uploads and commit. The body is

    magic "WSPB" | version u8 (1) | 3 zero bytes
    parts: name length u16 LE | name (ASCII) | size u64 LE | size bytes

The first part holds JSON and is named ``plan`` (the plan as getPlan answers it) or ``publish``
(publishVersion's request); each other part is named by an object's SHA-256 (64 hex) and holds
the whole object. Readers check every object against its name, as for any object read, or, for the
parts a plan bundle's answer names an xxh3-128 for (XXH3_HEADER: taken by a server that checked those
bytes against their names), by that digest. Shared by
the service and the client: this module imports nothing of weightsync but the errors and the
digest check.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import AsyncIterator, Collection, Iterator
from concurrent.futures import Executor, Future
from typing import Any

import numpy as np
import xxhash

from weightsync import errors
from weightsync.common import is_digest

MEDIA_TYPE = "application/vnd.weightsync.plan-bundle"
PUBLISH_MEDIA_TYPE = "application/vnd.weightsync.publish-bundle"
CHECKED_HEADER = "Weightsync-Checked"
"""A plan bundle's answer header, ``sha256``: the server checked every part's bytes against its name (docs/API.md
"One request per update"); the reference client hashes the objects all the same (docs/FORMAT.md §10.3)."""
XXH3_HEADER = "Weightsync-Xxh3"
"""With ``Weightsync-Checked``: ``name=xxh3-128 hex`` of the bundle's largest parts (up to XXH3_PARTS), comma-
separated, taken by the server of the bytes it checked against their names. A reader checks those parts' transfer
with it (~10+ GB/s) instead of hashing them (SHA-256): the two checks together are the server's SHA-256 and a
128-bit check of the way between (docs/API.md "One request per update")."""
XXH3_PARTS = 64
"""The most parts a bundle's XXH3_HEADER names (its largest): the header stays a few KiB."""
MAGIC = b"WSPB"
VERSION = 1
_HEAD = struct.Struct("<4sB3x")
_NAME = struct.Struct("<H")
_SIZE = struct.Struct("<Q")
PLAN = "plan"
PUBLISH = "publish"
MAX_INLINE = 64 << 20
"""The most object bytes a server puts in one answer (a larger update is fetched the usual way)."""


def transfer_digest(data: bytes | memoryview) -> str:
    """The XXH3_HEADER value of a part's bytes: their xxh3-128, hex."""
    return xxhash.xxh3_128_hexdigest(data)


def format_transfer_digests(digests: dict[str, str]) -> str:
    """XXH3_HEADER's value for `digests` (part name → :func:`transfer_digest`)."""
    return ",".join(f"{name}={value}" for name, value in digests.items())


def parse_transfer_digests(value: str) -> dict[str, str]:
    """XXH3_HEADER's entries (part name → xxh3-128 hex); any entry that is not an object's name and a 32-hex value is
    left out (its part is hashed as any other)."""
    out = {}
    for entry in value.split(","):
        name, _, digest = entry.strip().partition("=")
        if is_digest(name) and len(digest) == 32 and all(c in "0123456789abcdef" for c in digest):
            out[name] = digest
    return out


def head() -> bytes:
    """The bundle's first bytes."""
    return _HEAD.pack(MAGIC, VERSION)


def part_header(name: str, size: int) -> bytes:
    """What precedes a part's `size` bytes."""
    raw = name.encode("ascii")
    return _NAME.pack(len(raw)) + raw + _SIZE.pack(size)


def part_overhead(name: str) -> int:
    return _NAME.size + len(name) + _SIZE.size


def encode(plan_json: bytes, objects: dict[str, bytes], *, first: str = PLAN) -> bytes:
    """A whole bundle (tests and small bodies): the JSON part named `first`, then `objects` by digest."""
    return b"".join(chunks(plan_json, objects, first=first))


def chunks(json_part: bytes, objects: dict[str, bytes], *, first: str) -> list[bytes]:
    """A bundle's bytes as a list of pieces (headers and the objects themselves, uncopied)."""
    out = [head() + part_header(first, len(json_part)), json_part]
    for digest, data in objects.items():
        out += [part_header(digest, len(data)), data]
    return out


def _check_name(name: str, first: bool, first_name: str, what: str, error: type[errors.WeightsyncError]) -> None:
    if first != (name == first_name) or (not first and not is_digest(name)):
        raise error(f"{what}: unexpected part {name!r}")


def parts(
    body: bytes | memoryview, *, first: str = PLAN, error: type[errors.WeightsyncError] = errors.BadResponse
) -> Iterator[tuple[str, memoryview]]:
    """The (name, bytes) parts of a whole bundle, the JSON part (named `first`) first; `error` on anything
    malformed (:class:`Receiver`'s checks, fed the body at once, its objects not hashed)."""
    receiver = Receiver(first=first, error=error, hashed=False)
    receiver.feed(body)
    for name, data, _ in receiver.parts():
        yield name, data


HASH_AHEAD = 1 << 20
"""A body of at least this many bytes (its length known) has its objects hashed on a thread of their own,
in steps of this many bytes, while the rest arrives."""


class Receiver:
    """A bundle received in chunks (an answer's body), each object part hashed (SHA-256) as its bytes arrive.

    ``feed`` every chunk in order, then ``finish`` for the JSON part (named `first`) and
    {name: (bytes, SHA-256 hex of them)} of the object parts: a reader compares each hash with
    the name without another pass over the bytes, and the hashing runs while the rest of the
    body is still on its way. However the body is cut into chunks, the same parts and the same
    `error`s on anything malformed (raised by ``feed`` as soon as it shows, or by ``finish``);
    :func:`parts` reads a whole body with it, unhashed (``hashed=False``); the parts named in `unhashed`
    come with no hash (their reader checks them by their XXH3_HEADER digest instead).

    With `size` (the body's length, known from its header) the bytes land in one buffer of that
    size, never copied again (a longer body is `error`). With `hasher` too (an executor of **one**
    thread: a part's steps must run in order), a body of at least HASH_AHEAD bytes has its objects
    hashed on that thread, HASH_AHEAD bytes at a time, while the receiving thread waits for the
    next chunk: a large update's hashing then costs the receiver little more than the transfer
    (SHA-256 runs at ~2 GB/s a core, a loopback transfer at about that); :meth:`finish_pending`
    hands back the hashes still being taken as futures, so the caller reads the JSON part (and
    checks what it needs first) while the objects are still hashing. Any other body is hashed on
    the receiving thread as it arrives: handing a small body's hashing to another thread saved
    nothing (the receiver's next work is Python, which holds the GIL that thread needs between
    its steps).
    """

    def __init__(
        self,
        *,
        first: str = PLAN,
        error: type[errors.WeightsyncError] = errors.BadResponse,
        hashed: bool = True,
        size: int | None = None,
        hasher: Executor | None = None,
        unhashed: Collection[str] = (),
    ) -> None:
        self._size = size
        # Without a size, a growing bytearray; with one, a buffer of that size (np.empty: its pages are touched
        # once, by the bytes arriving, where a bytearray would zero them first).
        self._buf = bytearray()
        self._view = memoryview(self._buf) if size is None else np.empty(size, dtype=np.uint8).data
        self._len = 0  # bytes received
        self._first, self._error, self._hashed = first, error, hashed
        self._unhashed = frozenset(unhashed)  # parts not hashed (SHA-256): their reader checks them another way
        self._what = f"{first} bundle"
        self._headed = False  # the magic and version checked
        self._at = _HEAD.size  # where the next part's header starts
        # The part arriving: name, start, size, hasher (None: the JSON part, or not hashing).
        self._part: tuple[str, int, int, Any] | None = None
        self._hashed_to = 0  # where the current part's bytes not yet hashed start
        self._done: list[tuple[str, int, int, str | Future[str] | None]] = []
        self._pool = hasher if hashed and size is not None and size >= HASH_AHEAD else None  # None: hash here

    def feed(self, chunk: bytes | memoryview) -> None:
        n = len(chunk)
        if self._size is None:
            self._view.release()
            self._buf += chunk
            self._view = memoryview(self._buf)
        elif self._len + n > self._size:
            raise self._error(f"{self._what}: longer than its {self._size} bytes")
        else:
            self._view[self._len : self._len + n] = chunk
        self._took(n)

    def space(self) -> memoryview | None:
        """The rest of a sized body's buffer, for a reader that receives straight into it and then calls
        :meth:`took`: no copy between the socket and the buffer. None without a `size`."""
        return None if self._size is None else self._view[self._len :]

    def took(self, n: int) -> None:
        """`n` bytes were received at the start of :meth:`space`: parse and hash them as :meth:`feed` would."""
        if self._size is None or not 0 <= n <= self._size - self._len:
            raise ValueError(
                f"took({n}): the buffer has {0 if self._size is None else self._size - self._len} bytes left"
            )
        self._took(n)

    def _took(self, n: int) -> None:
        self._len += n
        if not self._headed:
            if self._len < _HEAD.size:
                return
            self._check_head()
        while True:
            if self._part is None and not self._next_header():
                return
            assert self._part is not None
            name, start, size, hasher = self._part
            end = start + size
            upto = min(self._len, end)
            if upto < end:
                if (
                    hasher is not None
                    and upto > self._hashed_to
                    and (self._pool is None or upto - self._hashed_to >= HASH_AHEAD)
                ):
                    self._hash(hasher, self._view[self._hashed_to : upto], False)
                    self._hashed_to = upto
                return
            # The part's last bytes and its digest in one step (one hand-off to the hashing thread).
            digest = None if hasher is None else self._hash(hasher, self._view[self._hashed_to : end], True)
            self._done.append((name, start, size, digest))
            self._part, self._at = None, end

    def _hash(self, hasher: Any, data: memoryview, last: bool) -> Any:
        """Hash `data` into `hasher` (its hex digest when `last`): here, or in order on the hashing thread
        (a Future) for a body hashed ahead."""
        if self._pool is None:
            return _hash_step(hasher, data, last)
        return self._pool.submit(_hash_step, hasher, data, last)

    def _check_head(self) -> None:
        magic, version = _HEAD.unpack_from(self._view)
        if magic != MAGIC:
            raise self._error(f"{self._what}: bad magic")
        if version != VERSION:
            raise self._error(f"{self._what}: version {version}, this side reads {VERSION}")
        self._headed = True

    def _next_header(self) -> bool:
        """Parse the header of the part at ``_at`` when all of it arrived; whether it did."""
        at, buf = self._at, self._view
        if at + _NAME.size > self._len:
            return False
        (n,) = _NAME.unpack_from(buf, at)
        if at + _NAME.size + n + _SIZE.size > self._len:
            return False
        try:
            name = bytes(buf[at + _NAME.size : at + _NAME.size + n]).decode("ascii")
        except UnicodeDecodeError:
            raise self._error(f"{self._what}: a part name is not ASCII") from None
        (size,) = _SIZE.unpack_from(buf, at + _NAME.size + n)
        _check_name(name, not self._done, self._first, self._what, self._error)
        hasher = hashlib.sha256() if self._done and self._hashed and name not in self._unhashed else None
        self._part = (name, at + _NAME.size + n + _SIZE.size, size, hasher)
        self._hashed_to = self._part[1]
        return True

    def parts(self) -> list[tuple[str, memoryview, str | None]]:
        """Every part in order, the JSON part first: (name, bytes, SHA-256 hex; None for the JSON part or when
        not hashed); `error` if the body ended inside a part or holds no JSON part."""
        return [(name, data, h.result() if isinstance(h, Future) else h) for name, data, h in self._parts()]

    def _parts(self) -> list[tuple[str, memoryview, str | Future[str] | None]]:
        """:meth:`parts`, the hashes still being taken as futures."""
        if not self._headed:  # fewer bytes than the bundle's head
            raise self._error(f"{self._what}: bad magic")
        if self._part is not None or self._at != self._len:
            truncated = self._part[0] if self._part is not None else None
            what = "truncated part header" if truncated is None else f"part {truncated!r} is truncated"
            raise self._error(f"{self._what}: {what}")
        if not self._done:
            raise self._error(f"{self._what}: no {self._first}")
        return [(name, self._view[a : a + n], h) for name, a, n, h in self._done]

    def finish(self) -> tuple[memoryview, dict[str, tuple[memoryview, str | None]]]:
        """(the JSON part, {object name: (its bytes, their SHA-256 hex; None when not `hashed`)}), as :meth:`parts`
        checks them."""
        json_part, pending = self.finish_pending()
        return json_part, {
            name: (data, h.result() if isinstance(h, Future) else h) for name, (data, h) in pending.items()
        }

    def finish_pending(self) -> tuple[memoryview, dict[str, tuple[memoryview, str | Future[str] | None]]]:
        """:meth:`finish` without waiting for the hashing thread: a hash still being taken is a Future of it."""
        (_, json_part, _), *objects = self._parts()
        return json_part, {name: (data, h) for name, data, h in objects}


def _hash_step(hasher: Any, data: memoryview, last: bool) -> str | None:
    hasher.update(data)
    return hasher.hexdigest() if last else None


class StreamedBundle:
    """A bundle read as it arrives (a request body): the JSON part whole, then each object as a stream.

    ``await json_part()`` first (at most `max_json` bytes), then ``async for name, size, body in
    objects()``; each `body` must be read to its end before the next part.
    Raises `error` on anything malformed, truncated included.
    """

    def __init__(
        self,
        chunks: AsyncIterator[bytes],
        *,
        first: str,
        max_json: int,
        error: type[errors.WeightsyncError] = errors.InvalidArgument,
    ) -> None:
        self._chunks = chunks
        self._buf = bytearray()
        self._done = False
        self._first = first
        self._max_json = max_json
        self._error = error
        self._what = f"{first} bundle"

    async def _fill(self, n: int) -> bool:
        """Buffer at least `n` bytes; False when the body ends first."""
        while len(self._buf) < n and not self._done:
            try:
                self._buf += await self._chunks.__anext__()
            except StopAsyncIteration:
                self._done = True
        return len(self._buf) >= n

    async def _take(self, n: int, what: str) -> bytes:
        if not await self._fill(n):
            raise self._error(f"{self._what}: truncated {what}")
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    async def _header(self) -> tuple[str, int] | None:
        """The next part's (name, size); None at the body's end."""
        if not await self._fill(1):
            return None
        (n,) = _NAME.unpack(await self._take(_NAME.size, "part header"))
        raw = await self._take(n + _SIZE.size, "part header")
        try:
            name = raw[:n].decode("ascii")
        except UnicodeDecodeError:
            raise self._error(f"{self._what}: a part name is not ASCII") from None
        return name, _SIZE.unpack_from(raw, n)[0]

    async def json_part(self) -> bytes:
        """The first part's bytes (after the bundle's head)."""
        magic, version = _HEAD.unpack(await self._take(_HEAD.size, "head"))
        if magic != MAGIC:
            raise self._error(f"{self._what}: bad magic")
        if version != VERSION:
            raise self._error(f"{self._what}: version {version}, this side reads {VERSION}")
        got = await self._header()
        if got is None:
            raise self._error(f"{self._what}: no {self._first}")
        name, size = got
        _check_name(name, True, self._first, self._what, self._error)
        if size > self._max_json:
            raise self._error(f"{self._what}: the {name} part has {size} bytes, at most {self._max_json} are read")
        return await self._take(size, f"{name} part")

    async def objects(self) -> AsyncIterator[tuple[str, int, AsyncIterator[bytes]]]:
        """Each object part as (digest, size, its bytes as they arrive)."""
        while (got := await self._header()) is not None:
            name, size = got
            _check_name(name, False, self._first, self._what, self._error)
            yield name, size, self._body(name, size)

    async def _body(self, name: str, size: int) -> AsyncIterator[bytes]:
        left = size
        while left:
            if not self._buf and not await self._fill(1):
                raise self._error(f"{self._what}: part {name!r} is truncated")
            piece = bytes(self._buf[:left])
            del self._buf[: len(piece)]
            left -= len(piece)
            yield piece
