"""Model-based sequences: random interleavings of publish, crash, retry, GC and reads against a reference model.

A hypothesis RuleBasedStateMachine drives one ``Ops`` (in-process; SQLite catalog,
filesystem store, a settable clock) and keeps its own model of what must be true: which
versions are committed with which bytes, the head, the retention setting, live leases,
and the pending publishes a crash left behind. Rules: publish (delta or keyframe), publish
with a stale parent (StaleParent at begin), a publish that loses the race at commit
(StaleParent at commit, then retried on the new head), a publisher that crashes after
some step of the protocol (and is aborted, resumed or left to expire), a retried commit
(idempotent), GC with a clock advance, retention changes, leases, materialize and
incremental pull-plan checks of a random committed version.

Invariants after every step: the visible versions and head equal the model's; every
object and manifest a committed version references is in the store, and so is every
object a live pending publish had uploaded; a sample of committed versions (the head
and one more, rotating) materializes byte for byte. At the end of each sequence
``fsck --read-data`` finds no dangling reference, and after the clock passes every grace
period ``fsck --repair`` leaves nothing to report.

CI: max_examples=15, stateful_step_count=15, derandomize=True (a fixed seed). ``--long``:
max_examples=200, stateful_step_count=40, same derandomized generation.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import sys
import tempfile
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np
import pytest
from _crash_util import FATAL, T0, Clock
from _versions import checkpoint, model_files, next_step
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from weightsync import errors
from weightsync.catalog import Catalog
from weightsync.catalog.engine import make_engine
from weightsync.codec import Checkpoint, CheckpointFile, Decoder, Encoder, FrameRef
from weightsync.codec.pack import pack
from weightsync.ops import Ops, OpsSettings, fsck, gc

MODEL = "m"
GRACE = timedelta(minutes=5)
PENDING_TTL = timedelta(minutes=30)
LEASE_TTL = timedelta(minutes=10)
KEYFRAME_INTERVAL = 3
STOPS = ("begin", "some-objects", "objects", "manifest")


class Stats:
    sequences = 0
    steps = 0
    rules: dict[str, int] = {}

    @classmethod
    def reset(cls) -> None:
        cls.sequences, cls.steps, cls.rules = 0, 0, {}

    @classmethod
    def count(cls, rule: str) -> None:
        cls.steps += 1
        cls.rules[rule] = cls.rules.get(rule, 0) + 1


def files_digest(files: dict[str, bytes]) -> str:
    h = hashlib.sha256()
    for p in sorted(files):
        h.update(p.encode() + b"\0" + hashlib.sha256(files[p]).digest())
    return h.hexdigest()


def ck_files(ck: Checkpoint) -> dict[str, bytes]:
    return {f.layout.path: f.data.tobytes() for f in ck.files}


@dataclass
class Ref:
    """The model of one committed version."""

    parent: int | None
    kind: str
    tensors: dict
    ck: Checkpoint
    digest: str
    publish_id: str
    manifest: str


@dataclass
class Pending:
    """A publish a crash left behind: what it was publishing and what it had uploaded."""

    publish_id: str
    parent: int | None
    expires: datetime
    tensors: dict
    ck: Checkpoint
    base: Checkpoint | None
    present: set[str] = field(default_factory=set)


class Stopped(Exception):
    """The simulated publisher stopped: args are the Begin and the manifest digest (when it got that far)."""


class OpsMachine(RuleBasedStateMachine):
    """One model, one Ops, and the reference model it must agree with."""

    scratch: Path = Path(tempfile.gettempdir())
    template: Path | None = None

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="mb-", dir=self.scratch))
        db = self.dir / "catalog.db"
        shutil.copyfile(self.template, db)
        self.clock = Clock(datetime.fromisoformat(T0))
        from weightsync.store.fs import FsStore

        self.loop = asyncio.new_event_loop()
        self.ops = Ops(
            Catalog(make_engine(f"sqlite:///{db}")),
            FsStore(self.dir / "store", fsync=False),
            OpsSettings(gc_grace=GRACE, pending_ttl=PENDING_TTL, lease_ttl=LEASE_TTL, store_concurrency=4),
            clock=self.clock,
        )
        self.committed: dict[int, Ref] = {}
        self.head: int | None = None
        self.top = 0  # numbers are never reused, deleted ones included
        self.keep_last: int | None = None
        self.leases: dict[int, datetime] = {}
        self.pending: list[Pending] = []
        self.tick = 0
        Stats.sequences += 1

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def teardown(self) -> None:
        try:
            if sys.exc_info()[0] is None:  # a failing step already reported; do not mask it
                self.run(self._final_checks())
        finally:
            self.run(self.ops.store.close())
            self.ops.catalog.close()
            self.loop.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    # --- publishing helpers -------------------------------------------------------------

    def _content(self, seed: int, fresh: bool) -> tuple[dict, Checkpoint]:
        if fresh or self.head is None:
            t = model_files(seed % 1000, n=4)
        else:
            t = next_step(self.committed[self.head].tensors, seed, fraction=0.01 + (seed % 5) / 100)
        return t, checkpoint(t, seed)

    async def _publish(
        self,
        ck: Checkpoint,
        base: Checkpoint | None,
        parent: int | None,
        *,
        keyframe: bool = False,
        stop: str | None = None,
        publish_id: str | None = None,
        object_bytes: int = 1 << 15,
        key: str | None = None,
    ):
        """The SDK's protocol over Ops: begin, encode, check objects, upload the missing, manifest, commit."""
        ops = self.ops
        begin = await ops.begin_publish(MODEL, parent=parent, keyframe=keyframe, publish_id=publish_id)
        if stop == "begin":
            raise Stopped(begin, None)
        use = base if begin.kind == "delta" else None
        encoded = Encoder(chunk_bytes=1 << 14, threads=1).encode(ck, use)
        manifest, objects = pack(encoded, target_bytes=object_bytes)
        manifest.model, manifest.parent = MODEL, parent
        data = manifest.encode()
        digest = hashlib.sha256(data).hexdigest()
        listed = [(o.digest, len(o.data)) for o in objects] + [(digest, len(data))]
        missing = set(await ops.missing_objects(MODEL, begin.publish_id, listed))
        for i, o in enumerate(objects):
            if o.digest in missing:
                await ops.put_bytes(o.data, expected_digest=o.digest)
                if stop == "some-objects" and i == 0:
                    raise Stopped(begin, None)
        if stop in ("some-objects", "objects"):
            raise Stopped(begin, None)
        if digest in missing:
            await ops.put_bytes(data, expected_digest=digest)
        if stop == "manifest":
            raise Stopped(begin, digest)
        version = await ops.commit_publish(
            MODEL, begin.publish_id, manifest_digest=digest, idempotency_key=key or begin.publish_id
        )
        return version, begin, digest

    def _land(self, version, tensors, ck, parent, publish_id, digest) -> None:
        expected = self.top + 1
        assert version.number == expected, f"committed as v{version.number}, expected v{expected}"
        assert version.parent == parent
        self.top = version.number
        self.committed[version.number] = Ref(
            parent, version.kind, tensors, ck, files_digest(ck_files(ck)), publish_id, digest
        )
        self.head = version.number

    # --- rules --------------------------------------------------------------------------

    @initialize()
    def create(self) -> None:
        m = self.run(self.ops.create_model(MODEL, keyframe_interval=KEYFRAME_INTERVAL))
        assert m.created_at == self.clock.now  # the Ops clock, like every other timestamp

    @rule(
        seed=st.integers(0, 10_000),
        keyframe=st.booleans(),
        fresh=st.booleans(),
        object_bytes=st.sampled_from([1 << 12, 1 << 15, 1 << 20]),
    )
    def publish(self, seed, keyframe, fresh, object_bytes) -> None:
        Stats.count("publish")
        tensors, ck = self._content(seed, fresh)
        parent = self.head
        base = self.committed[parent].ck if parent is not None else None
        v, begin, digest = self.run(self._publish(ck, base, parent, keyframe=keyframe, object_bytes=object_bytes))
        self._land(v, tensors, ck, parent, begin.publish_id, digest)

    @precondition(lambda self: self.head is not None)
    @rule(seed=st.integers(0, 10_000), which=st.integers(0, 100))
    def publish_with_stale_parent(self, seed, which) -> None:
        Stats.count("publish_with_stale_parent")
        choices = [n for n in self.committed if n != self.head] + [None]
        parent = choices[which % len(choices)]
        _, ck = self._content(seed, True)
        with pytest.raises(errors.StaleParent) as exc:
            self.run(self._publish(ck, None, parent))
        assert exc.value.current_head == self.head

    @rule(seed=st.integers(0, 10_000), seed2=st.integers(0, 10_000), abort=st.booleans())
    def lose_race_then_retry(self, seed, seed2, abort) -> None:
        """A begins on the head; B commits first; A's commit gets StaleParent; A retries on the new head."""
        Stats.count("lose_race_then_retry")
        parent = self.head
        base = self.committed[parent].ck if parent is not None else None
        a_tensors, a_ck = self._content(seed, False)
        try:
            self.run(self._publish(a_ck, base, parent, stop="manifest"))
            raise AssertionError("the publish did not stop")
        except Stopped as s:
            a_begin, a_manifest = s.args
        b_tensors, b_ck = self._content(seed2, False)
        v, begin, digest = self.run(self._publish(b_ck, base, parent))
        self._land(v, b_tensors, b_ck, parent, begin.publish_id, digest)
        # A uploaded everything before B committed: its commit now loses the compare-and-swap.
        with pytest.raises(errors.StaleParent) as exc:
            self.run(self.ops.commit_publish(MODEL, a_begin.publish_id, manifest_digest=a_manifest))
        assert exc.value.current_head == self.head
        if abort:
            self.run(self.ops.abort_publish(MODEL, a_begin.publish_id))
        else:
            self._leave_pending(a_begin, a_tensors, a_ck, base, parent)
        parent = self.head
        v, begin, digest = self.run(self._publish(a_ck, self.committed[parent].ck, parent))
        self._land(v, a_tensors, a_ck, parent, begin.publish_id, digest)

    def _leave_pending(self, begin, tensors, ck, base, parent) -> None:
        present = {d for d in self._held(begin.publish_id) if self._exists(d)}
        self.pending.append(Pending(begin.publish_id, parent, begin.expires_at, tensors, ck, base, present))

    @rule(seed=st.integers(0, 10_000), stop=st.sampled_from(STOPS), abort=st.booleans(), keyframe=st.booleans())
    def crash_mid_publish(self, seed, stop, abort, keyframe) -> None:
        Stats.count("crash_mid_publish")
        tensors, ck = self._content(seed, False)
        parent = self.head
        base = self.committed[parent].ck if parent is not None else None
        try:
            self.run(self._publish(ck, base, parent, stop=stop, keyframe=keyframe))
            raise AssertionError("the publish did not stop")
        except Stopped as s:
            begin = s.args[0]
        if abort:
            self.run(self.ops.abort_publish(MODEL, begin.publish_id))
        else:
            self._leave_pending(begin, tensors, ck, base, parent)

    def _held(self, publish_id: str) -> set[str]:
        from sqlalchemy import select

        from weightsync.catalog.schema import VersionObjectRow, VersionRow

        with self.ops.catalog._read() as s:
            vid = s.scalar(select(VersionRow.id).where(VersionRow.publish_id == publish_id))
            return set(s.scalars(select(VersionObjectRow.digest).where(VersionObjectRow.version_id == vid)))

    def _exists(self, digest: str) -> bool:
        return self.run(self.ops.store.exists(digest))

    @precondition(lambda self: bool(self.pending))
    @rule(which=st.integers(0, 100))
    def resume_pending(self, which) -> None:
        """The crashed publisher comes back with its publish id and finishes (or learns it is too late)."""
        Stats.count("resume_pending")
        p = self.pending.pop(which % len(self.pending))
        live = self.clock.now < p.expires
        if live and p.parent == self.head:
            v, begin, digest = self.run(self._publish(p.ck, p.base, p.parent, publish_id=p.publish_id))
            assert begin.publish_id == p.publish_id
            self._land(v, p.tensors, p.ck, p.parent, p.publish_id, digest)
        else:
            expected = errors.StaleParent if live else (errors.StaleParent, errors.PublishNotFound, errors.Conflict)
            with pytest.raises(expected):
                self.run(self._publish(p.ck, p.base, p.parent, publish_id=p.publish_id))

    @precondition(lambda self: bool(self.committed))
    @rule(which=st.integers(0, 100))
    def retry_commit(self, which) -> None:
        Stats.count("retry_commit")
        nums = sorted(self.committed)
        n = nums[which % len(nums)]
        ref = self.committed[n]
        v = self.run(
            self.ops.commit_publish(MODEL, ref.publish_id, manifest_digest=ref.manifest, idempotency_key=ref.publish_id)
        )
        assert v.number == n

    @rule(minutes=st.sampled_from([0, 1, 4, 6, 20, 45, 120]))
    def run_gc(self, minutes) -> None:
        Stats.count("gc")
        self.clock.advance(minutes=minutes)
        now = self.clock.now
        self.run(gc(self.ops))
        self.leases = {n: t for n, t in self.leases.items() if t > now}
        if self.keep_last is not None and self.committed:
            ordered = sorted(self.committed, reverse=True)
            roots = set(ordered[: self.keep_last]) | {self.head} | set(self.leases)
            keep = set()
            for r in roots:
                keep.update(self._chain(r))
            for n in list(self.committed):
                if n not in keep:
                    del self.committed[n]

    def _chain(self, n: int) -> list[int]:
        out = [n]
        while self.committed[out[-1]].kind == "delta":
            out.append(self.committed[out[-1]].parent)
        return out

    @rule(keep=st.sampled_from([None, 1, 2, 3]))
    def set_retention(self, keep) -> None:
        Stats.count("set_retention")
        self.run(self.ops._db(self.ops.catalog.update_model_settings, MODEL, keep_last=keep))
        self.keep_last = keep

    @precondition(lambda self: bool(self.committed))
    @rule(which=st.integers(0, 100))
    def materialize(self, which) -> None:
        Stats.count("materialize")
        nums = sorted(self.committed)
        self._check_materializes(nums[which % len(nums)])

    @precondition(lambda self: bool(self.committed))
    @rule(which=st.integers(0, 100), have_which=st.integers(0, 100), hold=st.booleans())
    def pull_check(self, which, have_which, hold) -> None:
        """Plan from a held version to another and apply the plan's steps: the bytes must be the target's."""
        Stats.count("pull_check")
        nums = sorted(self.committed)
        want = nums[which % len(nums)]
        have = ([None] + nums)[have_which % (len(nums) + 1)]
        plan = self.run(self.ops.plan(MODEL, have=have, want=want, holder="reader" if hold else None))
        assert plan.target == want
        if hold:
            self.leases[want] = self.clock.now + LEASE_TTL
        start = self.run(self.ops.materialize(MODEL, have)) if have is not None else None
        files = self.run(_apply_plan(self.ops, plan, start))
        assert files_digest(files) == self.committed[want].digest, f"pull v{have} -> v{want} differs"

    @precondition(lambda self: bool(self.leases))
    @rule(which=st.integers(0, 100))
    def release_lease(self, which) -> None:
        Stats.count("release_lease")
        nums = sorted(self.leases)
        n = nums[which % len(nums)]
        self.run(self.ops.release_lease(MODEL, n, "reader"))
        del self.leases[n]

    # --- invariants ---------------------------------------------------------------------

    def _check_materializes(self, n: int) -> None:
        got = self.run(self.ops.materialize(MODEL, n))
        files = {p: a.tobytes() for p, a in got.files.items()}
        assert files_digest(files) == self.committed[n].digest, f"v{n} materializes to other bytes"

    @invariant()
    def visible_versions_are_the_model(self) -> None:
        got = [v.number for v in self.run(self.ops.list_versions(MODEL, limit=None))]
        assert got == sorted(self.committed), f"visible {got}, model {sorted(self.committed)}"
        assert self.run(self.ops.get_model(MODEL)).head == self.head

    @invariant()
    def referenced_objects_exist(self) -> None:
        stored = self.run(_stored(self.ops))
        for n, ref in self.committed.items():
            manifest = self.run(self.ops.load_manifest(ref.manifest))
            missing = (set(manifest.objects()) | {ref.manifest}) - stored
            assert not missing, f"v{n} references objects no longer in the store: {sorted(missing)[:3]}"
        for p in self.pending:
            if p.expires <= self.clock.now:
                continue  # expired: GC may reclaim what it uploaded
            lost = p.present - stored
            assert not lost, f"GC deleted objects of live pending publish {p.publish_id}: {sorted(lost)[:3]}"

    @invariant()
    def sample_materializes(self) -> None:
        """The head materializes, and an incremental pull from a rotating committed version reaches it."""
        if not self.committed:
            return
        self.tick += 1
        nums = sorted(self.committed)
        self._check_materializes(self.head)
        have = nums[self.tick % len(nums)]
        if have != self.head:
            plan = self.run(self.ops.plan(MODEL, have=have))
            files = self.run(_apply_plan(self.ops, plan, self.run(self.ops.materialize(MODEL, have))))
            assert files_digest(files) == self.committed[self.head].digest, f"pull v{have} -> head differs"

    async def _final_checks(self) -> None:
        report = await fsck(self.ops, read_data=True)
        fatal = [(p.code, p.number, p.detail) for p in report.problems if p.code in FATAL]
        assert not fatal, fatal
        self.clock.advance(hours=2)
        await fsck(self.ops, repair=True)
        self.clock.advance(hours=2)
        await fsck(self.ops, repair=True)
        report = await fsck(self.ops, read_data=True)
        assert report.problems == [], [(p.code, p.detail) for p in report.problems]
        for n, ref in self.committed.items():
            got = await self.ops.materialize(MODEL, n)
            assert files_digest({p: a.tobytes() for p, a in got.files.items()}) == ref.digest


async def _stored(ops) -> set[str]:
    return {i.digest async for i in ops.store.list()}


async def _apply_plan(ops, plan, start) -> dict[str, bytes]:
    """What a subscriber does with a plan: decode each step's frames onto the previous state."""
    decoder = Decoder(threads=1)
    current = start
    for step in plan.steps:
        manifest = await ops.load_manifest(step.manifest)
        blobs = {d: await ops.fetch_verified(d) for d in step.objects}
        base = None
        if current is not None and manifest.kind == "delta":
            base = Checkpoint(
                [CheckpointFile(f.layout, current.files[f.path]) for f in current.manifest.files],
                single_file=current.manifest.single_file,
            )
        outputs = [np.empty(f.size, dtype=np.uint8) for f in manifest.files]

        def read(ref: FrameRef, blobs=blobs) -> memoryview:
            return memoryview(blobs[ref.object])[ref.offset : ref.offset + ref.length]

        decoder.decode(manifest, read, outputs, base, verify_segments=True)
        from weightsync.ops import Materialized

        current = Materialized(manifest, {f.path: out for f, out in zip(manifest.files, outputs, strict=True)})
    assert current is not None
    return {p: a.tobytes() for p, a in current.files.items()}


def _scratch(tmp_path: Path) -> Path:
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        d = shm / f"ws-mb-{uuid.uuid4().hex[:12]}"
        d.mkdir()
        return d
    return tmp_path


def test_model_based_sequences(tmp_path, capsys, long_run):
    scratch = _scratch(tmp_path)
    try:
        template = scratch / "template.db"
        Catalog.open(f"sqlite:///{template}").close()
        OpsMachine.scratch, OpsMachine.template = scratch, template
        Stats.reset()
        examples, steps = (200, 40) if long_run else (15, 15)
        run_state_machine_as_test(
            OpsMachine,
            settings=settings(
                max_examples=examples,
                stateful_step_count=steps,
                derandomize=True,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
                print_blob=True,
            ),
        )
        with capsys.disabled():
            print(
                f"\n[model-based] {Stats.sequences} sequences x <= {steps} steps = {Stats.steps} rule steps "
                f"(max_examples={examples}, derandomize=True) -> 0 violations; rules: "
                f"{dict(sorted(Stats.rules.items()))}"
            )
    finally:
        if scratch != tmp_path:
            shutil.rmtree(scratch, ignore_errors=True)


def test_resumed_begin_returns_the_pending_publish(tmp_path):
    """Regression (found by the --long run): beginning again with a pending publish's id must return that
    publish's kind (a forced keyframe stays a keyframe) and refuse another parent, or the commit fails."""
    from weightsync.store.fs import FsStore

    async def go() -> None:
        clock = Clock(datetime.fromisoformat(T0))
        ops = Ops(
            Catalog.open(f"sqlite:///{tmp_path / 'c.db'}"), FsStore(tmp_path / "store"), OpsSettings(), clock=clock
        )
        try:
            t = model_files(1, n=2)
            first = await ops.begin_publish(MODEL, parent=None)
            manifest, objects = pack(Encoder(threads=1).encode(checkpoint(t, 0), None))
            manifest.model = MODEL
            for o in objects:
                await ops.put_bytes(o.data)
            digest = (await ops.put_bytes(manifest.encode())).digest
            await ops.commit_publish(MODEL, first.publish_id, manifest_digest=digest)
            forced = await ops.begin_publish(MODEL, parent=1, keyframe=True)
            again = await ops.begin_publish(MODEL, parent=1, publish_id=forced.publish_id)
            assert (again.publish_id, again.kind) == (forced.publish_id, "keyframe")
        finally:
            await ops.store.close()
            ops.catalog.close()

    asyncio.run(go())
