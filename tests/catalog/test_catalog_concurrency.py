"""Real threads on real connections: the head's compare-and-swap admits exactly one winner."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import pytest
from _catalog_util import digest, publish

from weightsync import errors
from weightsync.catalog import Catalog, Version

T = TypeVar("T")
THREADS = 8


def _race(fns: list[Callable[[], T]]) -> list[T | BaseException]:
    """Run ``fns`` in threads released together; return each result or exception."""
    barrier = threading.Barrier(len(fns))

    def go(fn: Callable[[], T]) -> T | BaseException:
        barrier.wait()
        try:
            return fn()
        except BaseException as exc:  # noqa: BLE001 - collected for the assertions
            return exc

    with ThreadPoolExecutor(len(fns)) as pool:
        return list(pool.map(go, fns))


@pytest.mark.parametrize("engines", ["shared", "per-thread"])
def test_racing_committers_one_wins(catalog: Catalog, db_url: str, engines: str) -> None:
    catalog.create_model("m")
    publish(catalog, "m", parent=None)
    # "per-thread": one Catalog (engine, pool) per committer, as separate service processes would have.
    cats = [catalog] * THREADS if engines == "shared" else [Catalog.open(db_url, migrate=False) for _ in range(THREADS)]
    try:
        pending = [c.begin_version("m", parent=1, kind="delta") for c in cats]

        def committer(c: Catalog, publish_id: str, i: int) -> Callable[[], Version]:
            return lambda: c.commit_version(
                "m",
                publish_id,
                parent=1,
                manifest_digest=digest(f"man{i}"),
                objects=[(digest(f"pack{i}"), i)],
                raw_bytes=10,
                stored_bytes=i,
                kind="delta",
            )

        results = _race([committer(c, p.publish_id, i) for i, (c, p) in enumerate(zip(cats, pending, strict=True))])
    finally:
        if engines == "per-thread":
            for c in cats:
                c.close()

    wins = [r for r in results if isinstance(r, Version)]
    losses = [r for r in results if not isinstance(r, Version)]
    assert len(wins) == 1, results
    assert all(isinstance(r, errors.StaleParent) and r.current_head == 2 for r in losses), losses
    assert wins[0].number == 2 and wins[0].parent == 1
    assert catalog.head("m") == wins[0]
    assert [v.number for v in catalog.list_versions("m")] == [1, 2]
    assert len(catalog.list_pending("m")) == THREADS - 1
    won = {d for d, _ in catalog.dump_committed()["versions"][1]["objects"]}
    losers = {digest(f"pack{i}") for i in range(THREADS)} - won
    assert len(losers) == THREADS - 1 and not losers & catalog.referenced_digests()


def test_racing_retries_of_one_commit_agree(catalog: Catalog) -> None:
    catalog.create_model("m")
    p = catalog.begin_version("m", parent=None, kind="keyframe")

    def commit() -> Version:
        return catalog.commit_version(
            "m",
            p.publish_id,
            parent=None,
            manifest_digest=digest("man"),
            objects=[(digest("pack"), 1)],
            raw_bytes=1,
            stored_bytes=1,
            kind="keyframe",
            idempotency_key="k",
        )

    results = _race([commit] * THREADS)
    assert all(isinstance(r, Version) for r in results), results
    assert all(r == results[0] for r in results) and results[0].number == 1
    assert catalog.get_model("m").head == 1


def test_contending_publishers_build_a_linear_history(catalog: Catalog) -> None:
    """Publishers that rebase on Conflict never fork or skip: every parent is the previous number."""
    catalog.create_model("m")
    per_thread = 4

    def publisher(i: int) -> Callable[[], int]:
        def run() -> int:
            done = 0
            while done < per_thread:
                head = catalog.get_model("m").head
                kind = "keyframe" if head is None else "delta"
                p = catalog.begin_version("m", parent=head, kind=kind)
                try:
                    catalog.commit_version(
                        "m",
                        p.publish_id,
                        parent=head,
                        manifest_digest=digest(f"{i}-{done}"),
                        objects=[],
                        raw_bytes=1,
                        stored_bytes=1,
                        kind=kind,
                    )
                    done += 1
                except errors.StaleParent:
                    catalog.abort_pending("m", p.publish_id)
            return done

        return run

    assert _race([publisher(i) for i in range(4)]) == [per_thread] * 4
    versions = catalog.list_versions("m")
    assert [v.number for v in versions] == list(range(1, 4 * per_thread + 1))
    assert [v.parent for v in versions] == [None, *range(1, 4 * per_thread)]
    assert catalog.get_model("m").head == 4 * per_thread


def test_racing_model_creation(catalog: Catalog) -> None:
    results = _race([lambda: catalog.create_model("same")] * THREADS)
    assert all(not isinstance(r, BaseException) for r in results), results
    assert len(set(results)) == 1
