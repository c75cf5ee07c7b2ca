"""Replica health in the ledger (issue 13): status, mode and engine as fields, lag, unhealthy replicas holding no
version, through the SDK, the CLI and follow(), on a real server over SQLite and over PostgreSQL."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _client_util import Server, server_on
from typer.testing import CliRunner

from weightsync import Publisher, Subscriber, errors
from weightsync.cli import app
from weightsync.client._http import Api
from weightsync.client.cli_admin import holders
from weightsync.common import Backoff
from weightsync.engines import Engine, EngineUnhealthy, follow
from weightsync.engines.base import SwitchReport, Update
from weightsync.engines.torch import TorchModule

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server with an SQLite catalog (the default), or one on a fresh PostgreSQL database."""
    with server_on(request.param, tmp_path_factory.mktemp(f"ledger-{request.param}")) as srv:
        yield srv


def _states(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` bf16 state dicts, each a few elements away from the one before."""
    gen = torch.Generator().manual_seed(seed)
    state = {"w": torch.randn(64, 32, generator=gen).to(torch.bfloat16), "b": torch.zeros(32, dtype=torch.bfloat16)}
    out = []
    for i in range(n):
        state = {k: v.clone() for k, v in state.items()}
        state["w"][i % 64, : i + 1] += 1
        state["b"][i % 32] = i
        out.append(state)
    return out


def _publish(server: Server, model: str, states: list[dict[str, Any]], tmp_path: Path) -> list[int]:
    with Publisher(server.url, model, cache_dir=tmp_path / "publisher") as pub:
        return [pub.publish(s, step=i).version for i, s in enumerate(states)]


def test_health_fields_round_trip_and_lag_is_counted_from_the_head_now(server: Server, tmp_path: Path) -> None:
    model = "health-round-trip"
    _publish(server, model, _states(3), tmp_path)
    with Api(server.url) as api:
        served = api.report_replica(
            model,
            subscriber="gpu-a",
            version=1,
            status="serving",
            mode="disk",
            engine="vllm",
            pause_ms=12.5,
            bytes=1000,
            site="eu",
            extra={"checked": 15},
        )
        assert (served.version, served.status, served.mode, served.engine) == (1, "serving", "disk", "vllm")
        assert served.lag == 2  # the head (v3) minus the version held
        assert (served.pause_ms, served.bytes, served.site, served.extra) == (12.5, 1000, "eu", {"checked": 15})
        plain = api.report_replica(model, subscriber="puller", version=3)  # an older client's report
        assert (plain.status, plain.mode, plain.engine, plain.lag) == ("applied", None, None, 0)

        _publish(server, model, _states(4)[3:], tmp_path)  # v4: the lag is the head at read time minus the version
        latest = {r.subscriber: r for r in api.list_replicas(model)}
        assert {s: (r.version, r.status, r.lag) for s, r in latest.items()} == {
            "gpu-a": (1, "serving", 3),
            "puller": (3, "applied", 1),
        }
        raw = api.request("GET", f"/v1/models/{model}/replicas").json()["replicas"]
        assert [r.to_dict() for r in latest.values()] == raw  # typed answers are the server's JSON
        assert raw[0]["status"] == "serving" and raw[0]["mode"] == "disk" and raw[0]["engine"] == "vllm"


def test_an_unhealthy_replica_holds_no_version(server: Server, tmp_path: Path) -> None:
    model = "health-unhealthy"
    _publish(server, model, _states(2), tmp_path)
    with Api(server.url) as api:
        api.report_replica(model, subscriber="gpu-b", version=2, status="serving", mode="disk", engine="sglang")
        sick = api.report_replica(
            model, subscriber="gpu-b", version=None, status="unhealthy", engine="sglang", extra={"target": 3}
        )
        assert (sick.version, sick.status, sick.lag) == (None, "unhealthy", None)
        assert (sick.mode, sick.engine, sick.extra) == (None, "sglang", {"target": 3})
        (now,) = api.list_replicas(model)
        assert (now.subscriber, now.version, now.status, now.lag) == ("gpu-b", None, "unhealthy", None)
        assert holders(api.list_replicas(model)) == {}  # it holds nothing now
        history = api.list_replicas(model, all=True)
        assert [(r.version, r.status) for r in history] == [(2, "serving"), (None, "unhealthy")]
        back = api.report_replica(model, subscriber="gpu-b", version=2, status="serving", engine="sglang")
        assert (back.version, back.lag) == (2, 0) and holders(api.list_replicas(model)) == {2: 1}


def test_wait_reported_returns_once_the_apply_report_is_in_the_ledger(server: Server, tmp_path: Path) -> None:
    """`apply` queues its report and returns; `wait_reported` waits for it (and times out while it is held)."""
    model = "health-wait-reported"
    states = _states(2)
    _publish(server, model, states, tmp_path)
    tensors = {k: v.clone() for k, v in states[0].items()}
    gate = threading.Event()
    with Subscriber(server.url, model, name="waiter") as sub, Api(server.url) as api:
        sub.version = 1
        send = sub.api.report_replica

        def held(*args: Any, **kwargs: Any) -> Any:
            gate.wait(30)
            return send(*args, **kwargs)

        sub.api.report_replica = held  # type: ignore[method-assign]
        sub.apply(tensors, sub.prepare(2))
        with pytest.raises(TimeoutError):
            sub.wait_reported(timeout=0.2)  # the report is queued, not sent
        assert api.list_replicas(model, subscriber="waiter") == []
        gate.set()
        sub.wait_reported(timeout=30)
        (entry,) = api.list_replicas(model, subscriber="waiter")
        assert (entry.version, entry.status, entry.mode) == (2, "applied", "in-place")


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"version": 1, "status": "sleeping"}, "status"),
        ({"version": 1, "mode": "telepathy"}, "mode"),
        ({"version": 1, "engine": "tgi"}, "engine"),
        ({"version": 1, "status": "unhealthy"}, "unhealthy"),  # a version the engine does not hold
        ({"version": None, "status": "serving"}, "version"),
        ({"version": None}, "version"),  # applied, the default status, names its version
    ],
)
def test_invalid_health_is_a_422_problem_and_invalid_argument(
    server: Server, tmp_path: Path, fields: dict[str, Any], named: str
) -> None:
    model = "health-invalid"
    with Api(server.url) as api:
        if api.head(model) is None:
            _publish(server, model, _states(1), tmp_path)
        before = api.list_replicas(model, all=True)
        with pytest.raises(errors.InvalidArgument, match=named) as caught:
            api.report_replica(model, subscriber="bad", **fields)
        assert caught.value.status == 422 and "\n" not in str(caught.value)
        assert caught.value.problem is not None and caught.value.problem["type"].endswith("/invalid-argument")
        assert api.list_replicas(model, all=True) == before  # nothing recorded
    body = {"subscriber": "bad", **fields}
    resp = httpx.post(f"{server.url}/v1/models/{model}/replicas", json=body)
    assert resp.status_code == 422 and resp.headers["content-type"].startswith("application/problem+json")


def _cli(server: Server, *args: object) -> Any:
    runner = CliRunner()
    return runner.invoke(app, [str(a) for a in args], env={"WEIGHTSYNC_SERVER": server.url}, catch_exceptions=False)


def test_replicas_command_shows_health_and_lag(server: Server, tmp_path: Path) -> None:
    model = "health-cli"
    _publish(server, model, _states(3), tmp_path)
    with Api(server.url) as api:
        api.report_replica(
            model,
            subscriber="gpu-a",
            version=3,
            status="serving",
            mode="disk",
            engine="vllm",
            pause_ms=41.27,
            site="eu",
        )
        api.report_replica(model, subscriber="gpu-b", version=None, status="unhealthy", engine="vllm", site="us")
        api.report_replica(model, subscriber="laptop", version=1, mode="pull")
        raw = api.request("GET", f"/v1/models/{model}/replicas").json()
    r = _cli(server, "replicas", model)
    assert r.exit_code == 0, r.stderr
    header, *lines = r.stdout.strip().splitlines()
    assert header.split() == ["REPLICA", "SITE", "VERSION", "STATUS", "MODE", "ENGINE", "PAUSE", "LAG", "APPLIED"]
    rows = [line.split() for line in lines]
    assert [row[:8] for row in rows] == [
        ["gpu-a", "eu", "v3", "serving", "disk", "vllm", "41.3ms", "0"],
        ["gpu-b", "us", "-", "unhealthy", "-", "vllm", "-", "-"],
        ["laptop", "-", "v1", "applied", "pull", "-", "-", "2"],
    ]
    assert [row[8] for row in rows] == [e["applied_at"] for e in raw["replicas"]] and "None" not in r.stdout
    r = _cli(server, "replicas", model, "--json")
    assert r.stdout == json.dumps({"model": model, **raw}, sort_keys=True) + "\n"  # the server's JSON, byte for byte


def test_log_shows_how_many_replicas_hold_each_version_now(server: Server, tmp_path: Path) -> None:
    model = "health-log"
    _publish(server, model, _states(3), tmp_path)
    with Api(server.url) as api:
        for name, version in (("a", 1), ("b", 3), ("c", 3), ("d", 2)):
            api.report_replica(model, subscriber=name, version=version, status="serving", engine="vllm")
        api.report_replica(model, subscriber="d", version=None, status="unhealthy", engine="vllm")  # d holds none now
        api.report_replica(model, subscriber="a", version=3, mode="pull")  # a moved on from v1
    r = _cli(server, "log", model)
    assert r.exit_code == 0, r.stderr
    lines = [line.split() for line in r.stdout.strip().splitlines()]
    assert [(line[0], line[-2]) for line in lines] == [("v1", "replicas=0"), ("v2", "replicas=0"), ("v3", "replicas=3")]


# --- follow(): what the sidecar reports ---------------------------------------------------------------


class Breakable(Engine):
    """The PyTorch adapter with a fault to inject: while ``broken``, a switch fails past undoing
    (EngineUnhealthy) and the engine shows no version, as a vLLM whose reload and rollback both failed;
    :meth:`restart` is the operator restarting it on a version (loaded whole)."""

    kind = "torch"
    reports_itself = False  # the sidecar's follow() reports, not the adapter's subscriber

    def __init__(self, inner: TorchModule) -> None:
        self.inner, self.broken = inner, False
        self.lock = threading.Lock()  # a restart never lands inside one of the loop's calls

    def held(self) -> int | None:
        with self.lock:
            self.version = None if self.broken else self.inner.held()
            return self.version

    def prepare(self, version: int) -> Update:
        with self.lock:
            return self.inner.prepare(version)

    def switch(self, update: Update) -> SwitchReport:
        with self.lock:
            if self.broken:
                self.version = None
                why = f"switch to version {update.version} failed and could not be undone"
                raise EngineUnhealthy(why, target=update.version)
            done = self.inner.switch(update)
            self.version = done.version
            return done

    def restart(self, version: int) -> None:
        with self.lock:
            self.inner.load(version)
            self.broken = False


def _wait(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_follow_reports_serving_unhealthy_and_recovered(server: Server, tmp_path: Path) -> None:
    model = "health-follow"
    states = _states(3, seed=5)
    _publish(server, model, states[:1], tmp_path)
    tensors = {k: torch.zeros_like(v) for k, v in states[0].items()}
    failures: list[Exception] = []
    stop = threading.Event()
    with (
        Subscriber(server.url, model, name="engine-side", report=False) as inner_sub,
        Subscriber(server.url, model, name="sidecar") as sidecar,
        Api(server.url) as api,
    ):
        engine = Breakable(TorchModule(tensors, inner_sub))

        def latest() -> tuple[int | None, str, str | None, str | None]:
            found = api.list_replicas(model, subscriber="sidecar")
            return (
                (found[0].version, found[0].status, found[0].mode, found[0].engine) if found else (None, "", None, None)
            )

        loop = threading.Thread(
            target=follow,
            args=(engine, sidecar),
            kwargs=dict(
                stop=stop,
                on_error=failures.append,
                watch_timeout=1,
                retry=Backoff(attempts=1, base=0.05, cap=0.2),
            ),
        )
        loop.start()
        try:
            _wait(lambda: latest() == (1, "serving", "in-place", "torch"))  # loaded from nothing, verified
            engine.broken = True
            _publish(server, model, states[1:2], tmp_path)
            _wait(lambda: latest() == (None, "unhealthy", None, "torch"))
            _wait(lambda: len(failures) >= 3)  # it keeps trying; the ledger keeps one entry for it
            assert all(isinstance(e, EngineUnhealthy) for e in failures)
            history = api.list_replicas(model, subscriber="sidecar", all=True)
            assert [(r.version, r.status) for r in history] == [(1, "serving"), (None, "unhealthy")]
            assert history[1].extra["target"] == 2 and "could not be undone" in history[1].extra["error"]

            engine.restart(2)  # back on the head without a switch: the sidecar reports what it now shows
            # (mode None; or, when the restart lands while the loop is preparing the head, as the switch that
            # then finds the engine on it: either way serving the head, never unhealthy)
            _wait(lambda: (latest()[0], latest()[1], latest()[3]) == (2, "serving", "torch"))
            assert all(torch.equal(tensors[k], states[1][k]) for k in tensors)

            _publish(server, model, states[2:], tmp_path)
            _wait(lambda: latest() == (3, "serving", "in-place", "torch"))
        finally:
            stop.set()
            loop.join(60)
        assert not loop.is_alive()
        (entry,) = api.list_replicas(model, subscriber="sidecar")
        assert entry.lag == 0 and entry.pause_ms is not None and entry.extra["checked"] == 2
        history = api.list_replicas(model, subscriber="sidecar", all=True)
        assert [(r.version, r.status) for r in history] == [
            (1, "serving"),
            (None, "unhealthy"),
            (2, "serving"),
            (3, "serving"),
        ]
