"""Crash scenarios of the multi-part publish (docs/API.md "Multi-part publish"; issue 14).

Importing this module registers them in ``_crash_util.SCENARIOS`` (the zygote imports it).
Every version of the model is published by two ranks: rank 0 holds ``shard-1.safetensors``,
rank 1 ``shard-2.safetensors``, and both carry the same ``config.json`` (stored once by the
merge). Each rank diffs against its own previous part, as the SDK does.

- ``publish-parts-v2-delta``: v1 committed in parts; the operation is both ranks of v2 in rank
  order: begin, checkObjects (the part manifest held too), the uploads, commitPart; the last
  part stores the merged manifest and commits it; the commit record follows.
- ``publish-parts-v2-race``: both ranks of v2 have uploaded their part and rank 0's part is
  recorded; the operation is rank 1's first commitPart racing rank 0's resent one (the SDK's
  wait loop), interleaved deterministically on one event loop (every catalog call and store
  I/O yields once), so that both see the group complete and both merge and commit.

After each crash the checker asserts: nothing partial is visible (v2 is committed whole, or
not at all); the ranks restart and publish their parts again (one whose group committed meanwhile
learns it at begin, StaleParent, and resends its commitPart), which commits exactly one v2,
byte-identical to the union of the parts, the answers "pending" until it commits and v2 after;
``fsck --read-data`` finds nothing dangling; the next step (v3, in parts) commits; after the
pending TTL and GC grace ``fsck --repair`` leaves nothing to report, a catalog rebuilt from the
store equals the live one (but for the part manifests' references: no commit record names them),
and every version still materializes.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import timedelta
from pathlib import Path

import _crash_util
from _crash_util import (
    CHUNK_BYTES,
    MODEL,
    OBJECT_BYTES,
    Clock,
    CrashPoints,
    Env,
    Scenario,
    close_ops,
    files_of,
    fsck_clean_after_repair,
    fsck_no_dangling,
    install_catalog_hooks,
    install_fs_hooks,
    install_store_hooks,
    materializes,
    open_ops,
    rebuild_matches,
    sharded_versions,
    visible,
)

WORLD = 2
RANKS: tuple[tuple[str, ...], ...] = (
    ("shard-1.safetensors", "config.json"),
    ("shard-2.safetensors", "config.json"),
)


def parts_versions(count: int, *, seed: int = 7):
    """`count` consecutive versions of the two-shard model (every tensor name held by one shard only)."""
    return sharded_versions(count, seed=seed, distinct=True)


def part_of(ck, rank: int):
    """Rank `rank`'s part of version checkpoint `ck`: the files it holds."""
    from weightsync.codec import Checkpoint

    files = files_of(ck)
    return Checkpoint.from_bytes({p: files[p] for p in RANKS[rank]})


def step_of(number: int) -> int:
    """The training step version `number` is published as (ranks join a group by parent and step)."""
    return 100 * number


async def send_part(ops, versions, number: int, rank: int, *, stop_after: str | None = None):
    """Rank `rank` publishes its part of version `number` (on `number - 1`, against its own previous part)."""
    from _publish import publish_part

    parent = number - 1 if number > 1 else None
    base = part_of(versions[parent - 1], rank) if parent else None
    return await publish_part(
        ops,
        MODEL,
        part_of(versions[number - 1], rank),
        base,
        parent,
        rank=rank,
        world=WORLD,
        step=step_of(number),
        stop_after=stop_after,
        chunk_bytes=CHUNK_BYTES,
        object_bytes=OBJECT_BYTES,
    )


async def publish_in_parts(ops, versions, number: int) -> int:
    """Every rank of version `number`, in rank order; the version's number (the last part commits it)."""
    result = None
    for rank in range(WORLD):
        result, _, _ = await send_part(ops, versions, number, rank)
    assert result is not None and result.committed, result
    return result.version.number


def _yielding_io() -> None:
    """Run every `asyncio.to_thread` inline after one yield to the loop: concurrent tasks then interleave
    at each store call, in the same order on every run (a crash child only; nothing else runs there)."""

    async def to_thread(fn, /, *args, **kwargs):
        await asyncio.sleep(0)
        return fn(*args, **kwargs)

    asyncio.to_thread = to_thread


class PartsScenario(Scenario):
    """Version `new` of the two-rank model, published in parts on top of `new - 1` (committed in parts)."""

    def __init__(self, new: int, *, race: bool = False) -> None:
        self.new, self.race = new, race
        self.before = list(range(1, new))
        self.name = f"publish-parts-v{new}-" + ("race" if race else "delta" if new > 1 else "keyframe")

    def setup(self, work: Path, env: Env) -> None:
        from _publish import Stopped

        async def go():
            ops = open_ops(work, env, Clock(env.start), migrate=True)
            try:
                versions = parts_versions(self.new + 1)
                for n in self.before:
                    await publish_in_parts(ops, versions, n)
                if self.race:  # both parts uploaded and held; rank 0's recorded, the group pending
                    result, _, _ = await send_part(ops, versions, self.new, 0)
                    assert not result.committed
                    with contextlib.suppress(Stopped):
                        await send_part(ops, versions, self.new, 1, stop_after="manifest")
                        raise AssertionError("rank 1 was meant to stop before its commitPart")
            finally:
                await close_ops(ops)

        asyncio.run(go())

    def run(self, work: Path, env: Env, cp: CrashPoints) -> None:
        versions = parts_versions(self.new + 1)

        async def go():
            ops = open_ops(work, env, Clock(env.start + timedelta(minutes=1)), sequential=True)
            install_catalog_hooks(cp, ops.catalog)
            if env.store == "fs":
                install_fs_hooks(cp)
            else:
                install_store_hooks(cp, ops.store)
            if self.race:
                _yielding_io()

                async def yielding(fn, *args, **kwargs):
                    await asyncio.sleep(0)
                    return fn(*args, **kwargs)

                ops._db = yielding
                digests = {r: self._part_digest(versions, self.new, r) for r in range(WORLD)}
                answers = await asyncio.gather(
                    *(
                        ops.commit_part(
                            MODEL,
                            self._publish_id(),
                            rank=r,
                            world=WORLD,
                            manifest_digest=digests[r],
                        )
                        for r in (1, 0)  # rank 1's first part, rank 0's resent one
                    )
                )
                assert all(a.committed and a.version.number == self.new for a in answers), answers
            else:
                await publish_in_parts(ops, versions, self.new)
            await ops.drain()  # the commit record, written off the last part's answer (the service drains too)
            cp.completed()

        asyncio.run(go())

    def _publish_id(self) -> str:
        from weightsync.ops.core import parts_id

        return parts_id(MODEL, self.new - 1 if self.new > 1 else None, step_of(self.new))

    @staticmethod
    def _part_digest(versions, number: int, rank: int) -> str:
        """The digest of rank `rank`'s part manifest of version `number` (encoding is deterministic)."""
        import hashlib

        from weightsync.codec import Encoder
        from weightsync.codec.pack import pack

        parent = number - 1 if number > 1 else None
        encoded = Encoder(chunk_bytes=CHUNK_BYTES, threads=1, frames_per_file=True).encode(
            part_of(versions[number - 1], rank), part_of(versions[parent - 1], rank) if parent else None
        )
        manifest, _ = pack(encoded, target_bytes=OBJECT_BYTES)
        manifest.model, manifest.parent, manifest.step = MODEL, parent, step_of(number)
        return hashlib.sha256(manifest.encode()).hexdigest()

    def check(self, work: Path, env: Env) -> list[str]:
        return asyncio.run(self._check(work, env))

    async def _check(self, work: Path, env: Env) -> list[str]:
        versions = parts_versions(self.new + 1)
        clock = Clock(env.start + timedelta(minutes=2))
        ops = open_ops(work, env, clock, sequential=True)
        out: list[str] = []
        head_before = self.before[-1] if self.before else None
        try:
            nums, head = await visible(ops)
            if nums == self.before and head == head_before:
                landed = False
            elif nums == self.before + [self.new] and head == self.new:
                landed = True
            else:
                return [f"partially visible: versions {nums}, head {head} (before {self.before})"]
            for n in nums:
                if msg := await materializes(ops, n, files_of(versions[n - 1])):
                    out.append(msg)
            out += await fsck_no_dangling(ops)
            # The ranks restart, in rank order, and publish their parts again: each joins the group
            # the crash left (if any); one whose group committed meanwhile (a crash after the commit,
            # or another rank's retry completed it) is told so at begin (StaleParent) and resends its
            # commitPart, as the SDK's wait loop does, answered from the part manifests v2 keeps.
            from weightsync import errors

            answers: list[str] = []
            for rank in range(WORLD):
                try:
                    try:
                        got, _, _ = await send_part(ops, versions, self.new, rank)
                    except errors.StaleParent:
                        digest = self._part_digest(versions, self.new, rank)
                        got = await ops.commit_part(
                            MODEL, self._publish_id(), rank=rank, world=WORLD, manifest_digest=digest
                        )
                    answers.append(f"v{got.version.number}" if got.committed else "pending")
                except Exception as exc:  # noqa: BLE001 - any failure is the finding
                    out.append(f"rank {rank} retried: {type(exc).__name__}: {exc}")
            first = answers.index(f"v{self.new}") if f"v{self.new}" in answers else len(answers)
            if (
                answers != ["pending"] * first + [f"v{self.new}"] * (WORLD - first)
                or first == WORLD
                or (landed and first != 0)
            ):
                out.append(f"retried parts answered {answers}: expected pending ones, then v{self.new} for the rest")
            if (await visible(ops)) != (self.before + [self.new], self.new):
                out.append(f"after the retried parts: versions, head {await visible(ops)}")
            if msg := await materializes(ops, self.new, files_of(versions[self.new - 1])):
                out.append("after the retried parts: " + msg)
            try:  # the next step commits: no group is left wedging the model
                nxt = await publish_in_parts(ops, versions, self.new + 1)
                if nxt != self.new + 1:
                    out.append(f"the next step committed as v{nxt}, not v{self.new + 1}")
            except Exception as exc:  # noqa: BLE001
                out.append(f"the next step failed: {type(exc).__name__}: {exc}")
            out += await fsck_clean_after_repair(ops, clock)
            # No commit record names a version's part manifests, so a rebuilt catalog lacks their
            # references (and the parts' rows): compared without them.
            parts = frozenset(self._part_digest(versions, n, r) for n in range(1, self.new + 2) for r in range(WORLD))
            out += await rebuild_matches(ops, work, env.empty_catalog, unrecorded=parts)
            for n in range(1, self.new + 2):
                if msg := await materializes(ops, n, files_of(versions[n - 1])):
                    out.append("after repair: " + msg)
        finally:
            await close_ops(ops)
        return out


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (PartsScenario(1), PartsScenario(2), PartsScenario(2, race=True))}
_crash_util.SCENARIOS.update(SCENARIOS)
