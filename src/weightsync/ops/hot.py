"""The bytes of recently written or read small objects, kept by the server for the plans that follow.

Every follower asks for the newest version right after its commit, and a small update comes in
the plan's own answer (docs/API.md "One request per update"): the same few objects (the manifest,
a packed object of frames) are read from the store once per follower. The server has those bytes
in hand when the publish uploads them; keeping them saves each plan its store reads (a worker
thread each, on the filesystem; a round trip each, on S3).

Objects are immutable (named by their SHA-256), so an entry is never stale; an object the
server deletes (GC) is dropped first. Only the event loop's thread touches the cache.

Every entry hashes to its name (the store computed the digest of what it wrote, or the read
that kept it hashed it): a plan bundle whose parts all come from here, or were hashed on
reading, says so to its reader (``Weightsync-Checked``), with the xxh3-128 of its largest parts
(``Weightsync-Xxh3``), taken here as each entry is kept, right after that check: the reader
checks those parts' way across with it instead of hashing them.
"""

from __future__ import annotations

from collections import OrderedDict

from weightsync.bundle import transfer_digest


class HotObjects:
    """Objects' bytes by digest, the least recently used dropped beyond `budget` bytes in all.

    Objects larger than `largest` bytes are not kept (large updates are streamed from the store);
    a budget of 0 keeps nothing.
    """

    def __init__(self, budget: int, largest: int) -> None:
        self.budget = max(0, budget)
        self.largest = min(largest, self.budget)
        # Each entry's bytes and their transfer digest (weightsync.bundle.transfer_digest), taken as it was kept.
        self._entries: OrderedDict[str, tuple[bytes, str]] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def held_bytes(self) -> int:
        return self._bytes

    def get(self, digest: str) -> bytes | None:
        entry = self._entries.get(digest)
        if entry is None:
            return None
        self._entries.move_to_end(digest)
        return entry[0]

    def put(self, digest: str, data: bytes) -> None:
        """Keep `data`, which the caller checked hashes to `digest` (the store computed it, or named it)."""
        if len(data) > self.largest or digest in self._entries:
            return
        kept = bytes(data)  # bytes are immutable: no copy when they are bytes already
        self._entries[digest] = (kept, transfer_digest(kept))
        self._bytes += len(kept)
        while self._bytes > self.budget:
            _, (gone, _) = self._entries.popitem(last=False)
            self._bytes -= len(gone)

    def transfer_digest(self, digest: str) -> str | None:
        """The xxh3-128 of a kept entry's bytes, taken when it was kept; None if it is not kept."""
        entry = self._entries.get(digest)
        return None if entry is None else entry[1]

    def drop(self, digest: str) -> None:
        entry = self._entries.pop(digest, None)
        if entry is not None:
            self._bytes -= len(entry[0])
