"""Service processes on one PostgreSQL catalog tell each other of commits (WEIGHTSYNC_ANNOUNCE, docs/DEPLOY.md).

Three real ``python -m weightsync.service serve`` processes on a fresh database and one filesystem
store: A takes the commits; B and C poll the catalog only every 10 s, C with announcements off. A
follower's long poll of 3 s at B hears of a commit through A (it can only have come through A's
announcement: B's first poll is 10 s away), while the same long poll at C times out (204).
"""

from __future__ import annotations

import threading
import time
import uuid

import httpx
import pytest
from _pg import fresh_database
from _service_http import ok, publish, publish_chain
from _service_util import spawn_service

pytestmark = pytest.mark.postgres


def test_a_follower_at_another_process_hears_of_a_commit_through_its_announcement(tmp_path, versions):
    env_far = {"WEIGHTSYNC_WATCH_POLL_S": "10"}
    with fresh_database("ws_announce") as url:
        common = ["--catalog", url, "--store", str(tmp_path / "store")]
        a = spawn_service([*common, "--data", str(tmp_path / "a")], tmp_path / "a.log", wait=False)
        b = spawn_service([*common, "--data", str(tmp_path / "b")], tmp_path / "b.log", env=env_far, wait=False)
        c = spawn_service(
            [*common, "--data", str(tmp_path / "c")],
            tmp_path / "c.log",
            env={**env_far, "WEIGHTSYNC_ANNOUNCE": "false"},
            wait=False,
        )
        try:
            for s in (a, b, c):
                s.wait_ready()
            model = f"policy-{uuid.uuid4().hex[:8]}"
            answers: dict[str, httpx.Response] = {}

            def watch(name: str, base_url: str) -> None:
                with httpx.Client(base_url=base_url, timeout=30) as cl:
                    answers[name] = cl.get(f"/v1/models/{model}/watch", params={"after": 1, "timeout": 3})

            with httpx.Client(base_url=a.url, timeout=30) as pa:
                publish_chain(pa, model, versions[:1])
                threads = [threading.Thread(target=watch, args=(n, s.url)) for n, s in (("b", b), ("c", c))]
                for t in threads:
                    t.start()
                for s in (b, c):  # both long polls have arrived
                    for _ in range(400):
                        if _waiting(s.url):
                            break
                        time.sleep(0.025)
                time.sleep(0.5)  # and each has read v1 for itself (one catalog read)
                publish(pa, model, versions[1], versions[0], 1)
                for t in threads:
                    t.join(30)
            assert ok(answers["b"], 200)["number"] == 2
            assert answers["c"].status_code == 204  # polling only: its next read comes after the long poll ends
        finally:
            for s in (a, b, c):
                s.stop()


def _waiting(url: str) -> bool:
    """Whether a long poll waits at the server at `url` (its `weightsync_watch_waiting` gauge)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return any(
        line.startswith("weightsync_watch_waiting ") and float(line.split()[1]) >= 1 for line in text.splitlines()
    )
