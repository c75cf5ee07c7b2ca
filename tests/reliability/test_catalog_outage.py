"""Catalog outage: PostgreSQL connections cut under a running ``weightsync serve``, mid-publish and mid-pull.

The service reaches PostgreSQL through a TCP proxy the test severs (``_fault_pg.py``):

* a publish caught by an outage fails closed: 503 ``unavailable`` with Retry-After, a named
  client error (ServerUnavailable), nothing visible; it commits once the catalog is back;
* an outage shorter than the client's retries is ridden out;
* the connection cut at the COMMIT of the head-moving transaction, before and after the server
  committed: the retried commit lands exactly once (idempotent commit);
* a pull in progress completes (object reads do not need the catalog), or fails with the
  retryable ServerUnavailable and succeeds on retry;
* afterwards fsck (read_data) is clean and every version pulls byte-identical.

Run with ``-s`` to see the figures.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator

import httpx
import pytest
from _fault_data import ClientStats, checkpoint_of, digests_of, kind_of, make_versions
from _fault_pg import PgProxy
from _fault_service import Serve, file_digests, serve
from _pg import ADMIN_URL, fresh_database

from weightsync import errors
from weightsync.client import Publisher, Subscriber
from weightsync.client.wire import Retry

pytestmark = [pytest.mark.postgres]

#: The client's default attempts, with the service's Retry-After (2 s) honoured up to 1.5 s.
CLIENT_RETRY = Retry(attempts=6, base=0.1, cap=0.5)
#: Few, short retries: for clients meant to give up during an outage, or not to wait for its end.
FAST_RETRY = Retry(attempts=3, base=0.05, cap=0.1)
#: Many quick retries: for a client that retries past a single cut connection.
QUICK_RETRY = Retry(attempts=6, base=0.05, cap=0.1)
#: A statement only the head-moving commit transaction runs (catalog ``commit_version``).
HEAD_UPDATE = b"UPDATE models SET head"
VERSIONS = make_versions(6, seed=7, big=256 << 10)


class Env:
    def __init__(self, svc: Serve, proxy: PgProxy, db: str) -> None:
        self.svc, self.proxy, self.db = svc, proxy, db
        self.url = svc.url
        self.stats = ClientStats()

    def publisher(
        self,
        model: str,
        *,
        retry: Retry = CLIENT_RETRY,
        hook: Callable[[httpx.Request], None] | None = None,
        inline_bytes: int | None = None,
    ) -> Publisher:
        """A publisher; ``inline_bytes=0``: begin, uploads and commitPublish (else a small delta is one request)."""
        options = {} if inline_bytes is None else {"inline_bytes": inline_bytes}
        return Publisher(self.url, model, retry=retry, transport=self.stats.transport(hook), **options)

    def subscriber(
        self, model: str, *, retry: Retry = CLIENT_RETRY, hook: Callable[[httpx.Request], None] | None = None
    ) -> Subscriber:
        return Subscriber(self.url, model, name="puller", retry=retry, transport=self.stats.transport(hook))

    def versions(self, model: str) -> list[int]:
        r = httpx.get(f"{self.url}/v1/models/{model}/versions", timeout=30)
        r.raise_for_status()
        return [v["number"] for v in r.json()["versions"]]

    def check_intact(self, model: str, tmp) -> dict:
        """fsck --repair, then fsck must be clean; every version of ``model`` pulls byte-identical."""
        first = _fsck(self.url, repair=True)
        second = _fsck(self.url, repair=False)
        assert second["ok"], second["problems"]
        for n in self.versions(model):
            with self.subscriber(model) as sub:
                sub.pull(tmp / f"check-{model}-{n}", n)
            assert file_digests(tmp / f"check-{model}-{n}") == digests_of(VERSIONS[n - 1])
        return first


def _fsck(url: str, *, repair: bool) -> dict:
    r = httpx.post(f"{url}/v1/admin/fsck", json={"read_data": True, "repair": repair}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


class Trigger:
    """A transport hook: once armed, runs ``action`` before the first request ``pred`` accepts."""

    def __init__(
        self, pred: Callable[[httpx.Request], bool] | None = None, action: Callable[[], None] | None = None
    ) -> None:
        self.fired = threading.Event()
        self._lock = threading.Lock()
        self._pred, self._action = pred, action

    def arm(self, pred: Callable[[httpx.Request], bool], action: Callable[[], None]) -> threading.Event:
        with self._lock:
            self._pred, self._action = pred, action
            self.fired = threading.Event()
        return self.fired

    def __call__(self, request: httpx.Request) -> None:
        with self._lock:
            if self._pred is None or self._action is None or self.fired.is_set() or not self._pred(request):
                return
            self.fired.set()
            action = self._action
        action()


def _outage(proxy: PgProxy, seconds: float | None) -> Callable[[], None]:
    """Take the catalog down now, and back up after ``seconds`` (None: until the test says so)."""

    def go() -> None:
        proxy.down()
        if seconds is not None:
            t = threading.Timer(seconds, proxy.up)
            t.daemon = True
            t.start()

    return go


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("catalog-outage")
    with fresh_database("ws_outage") as url:
        db = url.rsplit("/", 1)[1]
        host = ADMIN_URL.split("@", 1)[1].split("/", 1)[0]
        pg_host, _, pg_port = host.partition(":")
        proxy = PgProxy((pg_host, int(pg_port or 5432)))
        port = proxy.start()
        user = ADMIN_URL.split("//", 1)[1].split("@", 1)[0]
        catalog = f"postgresql://{user}@127.0.0.1:{port}/{db}?sslmode=disable&connect_timeout=5"
        svc = None
        try:
            svc = serve(
                ["--data", str(tmp / "data"), "--catalog", catalog],
                tmp / "serve.log",
                env={"WEIGHTSYNC_GC_GRACE_S": "0", "WEIGHTSYNC_LOG_LEVEL": "warning"},
            )
            yield Env(svc, proxy, db)
        finally:
            if svc is not None:
                svc.stop()
            proxy.stop()


def test_publish_fails_closed_during_an_outage_and_commits_after(env, tmp_path):
    model = "outage-" + uuid.uuid4().hex[:8]
    with env.publisher(model) as pub:
        pub.publish(checkpoint_of(VERSIONS[0]), step=0)
    # The catalog goes away as the first object is uploaded, and stays away past the client's retries.
    hook = Trigger(lambda r: r.method == "PUT" and r.url.path.startswith("/v1/objects/"), _outage(env.proxy, None))
    before_503 = env.stats.count(503)
    try:
        with env.publisher(model, retry=FAST_RETRY, hook=hook) as pub, pytest.raises(errors.ServerUnavailable):
            pub.publish(checkpoint_of(VERSIONS[1]), step=1)
        assert hook.fired.is_set()
        # While it is down: every catalog call is a retryable 503 problem with Retry-After.
        r = httpx.post(f"{env.url}/v1/models/{model}/publishes", json={"parent": 1}, timeout=30)
        assert r.status_code == 503 and r.headers["content-type"].startswith("application/problem+json")
        assert r.json()["type"].endswith("/unavailable") and int(r.headers["retry-after"]) > 0
        ready = httpx.get(f"{env.url}/readyz", timeout=30)
        assert ready.status_code == 503 and ready.json() == {"catalog": False, "store": True}
    finally:
        env.proxy.up()
    assert env.versions(model) == [1]  # nothing of the failed publish is visible
    with env.publisher(model) as pub:
        assert pub.publish(checkpoint_of(VERSIONS[1]), step=1).version == 2
    repaired = env.check_intact(model, tmp_path)
    print(
        f"\n[catalog-outage publish] failed closed with {env.stats.count(503) - before_503} x 503 "
        f"(Retry-After {set(env.stats.retry_after)}); committed after recovery; "
        f"fsck before repair: {[p['code'] for p in repaired['problems']]}; proxy severed={env.proxy.severed} "
        f"refused={env.proxy.refused}"
    )


# How the delta is published: begin, uploads and commitPublish; or publishVersion (one request).
MODES = {"three-requests": 0, "one-request": None}


@pytest.mark.parametrize("mode", MODES)
def test_short_outage_mid_publish_is_ridden_out(env, tmp_path, mode):
    model = "outage-short-" + uuid.uuid4().hex[:8]
    hook = Trigger()
    with env.publisher(model, hook=hook, inline_bytes=MODES[mode]) as pub:
        pub.publish(checkpoint_of(VERSIONS[0]), step=0)
        # Down as the commit is sent, back 2 s later: within the client's retries.
        fired = hook.arm(lambda r: kind_of(r) == "commit", _outage(env.proxy, 2.0))
        before = env.stats.count_kind("commit", 503)
        assert pub.publish(checkpoint_of(VERSIONS[1]), step=1).version == 2
    assert fired.is_set() and env.stats.count_kind("commit", 503) > before
    assert env.versions(model) == [1, 2]
    env.check_intact(model, tmp_path)
    print(
        f"\n[catalog-outage short] commit answered 503 {env.stats.count_kind('commit', 503) - before}x "
        f"during a 2 s outage, then committed v2"
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("deliver", [False, True], ids=["before-server-commit", "after-server-commit"])
def test_connection_cut_at_the_commit_lands_exactly_once(env, tmp_path, deliver, mode):
    """Cut while committing; after the server's COMMIT the answer is lost: the retried commit (or the whole
    publishVersion again, replayed by its idempotency key) lands the version exactly once."""
    model = f"outage-cut-{int(deliver)}-" + uuid.uuid4().hex[:8]
    with env.publisher(model, retry=QUICK_RETRY, inline_bytes=MODES[mode]) as pub:
        pub.publish(checkpoint_of(VERSIONS[0]), step=0)
        cut = env.proxy.cut_commit(HEAD_UPDATE, deliver=deliver)
        before = env.stats.count_kind("commit", 503)
        result = pub.publish(checkpoint_of(VERSIONS[1]), step=1)
    assert cut.fired.is_set(), "the commit transaction was not seen by the proxy"
    # after-server-commit: the server answered COMMIT and the service never heard it (an ambiguous commit).
    assert cut.server_committed.is_set() == deliver
    assert env.stats.count_kind("commit", 503) > before  # the cut surfaced as a retryable 503
    assert result.version == 2 and env.versions(model) == [1, 2]  # exactly once, no gap, no duplicate
    env.check_intact(model, tmp_path)
    print(
        f"\n[catalog-outage cut {'after' if deliver else 'before'} the server's COMMIT] commit answered 503 "
        f"{env.stats.count_kind('commit', 503) - before}x, then v2 exactly once"
    )


def test_pull_in_progress_survives_an_outage(env, tmp_path):
    model = "outage-pull-" + uuid.uuid4().hex[:8]
    with env.publisher(model) as pub:
        for i in range(3):
            pub.publish(checkpoint_of(VERSIONS[i]), step=i)
    outcomes = []

    # 1. Down once the plan is in hand (first object read): object reads need no catalog.
    hook = Trigger(lambda r: r.url.path.startswith("/v1/objects/"), _outage(env.proxy, None))
    try:
        # Its replica report then fails (logged, never failing the pull) after the client's retries;
        # few and short ones here: with the default policy the pull returns ~10 s later (see the doc).
        with env.subscriber(model, retry=FAST_RETRY, hook=hook) as sub:
            sub.pull(tmp_path / "a", 3)
        assert hook.fired.is_set()
    finally:
        env.proxy.up()
    assert file_digests(tmp_path / "a") == digests_of(VERSIONS[2])
    outcomes.append("completed during the outage")

    # 2. Down as the plan is asked for, back after 2 s: the plan's retries ride it out.
    hook = Trigger(lambda r: r.url.path.endswith("/plan"), _outage(env.proxy, 2.0))
    with env.subscriber(model, hook=hook) as sub:
        sub.pull(tmp_path / "b", 3)
    assert hook.fired.is_set() and file_digests(tmp_path / "b") == digests_of(VERSIONS[2])
    outcomes.append("completed after the plan's retries")

    # 3. An incremental pull whose plan meets an outage longer than its retries: a retryable
    # error, the directory keeps its version intact, and the retry succeeds.
    with env.subscriber(model) as sub:
        sub.pull(tmp_path / "c", 1)
    hook = Trigger(lambda r: r.url.path.endswith("/plan"), _outage(env.proxy, None))
    try:
        with env.subscriber(model, retry=FAST_RETRY, hook=hook) as sub, pytest.raises(errors.ServerUnavailable):
            sub.pull(tmp_path / "c", 3)
        assert file_digests(tmp_path / "c") == digests_of(VERSIONS[0])
    finally:
        env.proxy.up()
    with env.subscriber(model) as sub:
        assert sub.pull(tmp_path / "c", 3).mode == "delta"
    assert file_digests(tmp_path / "c") == digests_of(VERSIONS[2])
    outcomes.append("failed retryably (ServerUnavailable), then succeeded on retry")

    # 4. The service's connections killed behind its back (pg_terminate_backend): the pool replaces them.
    import psycopg

    with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
        killed = admin.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = %s AND pid <> pg_backend_pid()",
            (env.db,),
        ).fetchone()[0]
    with env.subscriber(model) as sub:
        sub.pull(tmp_path / "d", 2)
    assert file_digests(tmp_path / "d") == digests_of(VERSIONS[1])
    outcomes.append(f"completed after {killed} backends were terminated")
    env.check_intact(model, tmp_path)
    print(f"\n[catalog-outage pull] {outcomes}; client transport errors={dict(env.stats.errors)}")
