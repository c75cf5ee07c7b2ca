"""Object-store faults: a fault-injecting proxy between ``weightsync serve`` and a real SeaweedFS.

About 10 % of the S3 requests (seeded: ``WEIGHTSYNC_FAULT_SEED``) get a 500, a 503 SlowDown, a
stall, a reset before or after the server acted, or a truncated reply (``_fault_proxy.py``).
The service's RetryingStore and the client's retries must absorb them:

* every pull (client Subscriber) succeeds and is byte-identical to what was published;
* a publish either commits or fails with a named client error, leaving nothing visible, and
  succeeds when retried;
* ``serve`` starts despite transient faults at start, and a store that ignores ``If-None-Match`` is
  detected at start (``check_conditional_writes``): the service warns and keeps serving.

Run with ``-s`` to see the figures (docs/reliability/faults-outage-load.md records them).
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from _fault_data import ClientStats, checkpoint_of, digests_of, make_versions
from _fault_proxy import S3FaultProxy
from _fault_service import Serve, file_digests, log_records, serve

from weightsync import errors
from weightsync.client import Publisher, Subscriber
from weightsync.client.wire import Retry
from weightsync.store import RetryingStore
from weightsync.store.s3 import S3Store

pytestmark = [pytest.mark.s3]

SEED = int(os.environ.get("WEIGHTSYNC_FAULT_SEED", "20261122"))
RATE = 0.10
BUCKET = "weightsync-faults"
# The client's default policy (6 attempts) with Retry-After honoured up to 1.5 s, so a
# test does not sleep the full 2 s the service asks for on every 503.
CLIENT_RETRY = Retry(attempts=6, base=0.1, cap=0.5)


@pytest.fixture(scope="module")
def proxy(seaweed):
    p = S3FaultProxy(
        seaweed.endpoint_url,
        seed=SEED,
        stall_s=0.3,
        credentials=(seaweed.access_key, seaweed.secret_key, seaweed.region),
    )
    p.start()
    yield p
    p.stop()


def _serve_s3(seaweed, proxy: S3FaultProxy, tmp: Path, *, presign: bool = True, name: str = "serve") -> Serve:
    data = tmp / name
    data.mkdir()
    env = {
        "WEIGHTSYNC_S3_ACCESS_KEY_ID": seaweed.access_key,
        "WEIGHTSYNC_S3_SECRET_ACCESS_KEY": seaweed.secret_key,
        "WEIGHTSYNC_S3_REGION": seaweed.region,
        "WEIGHTSYNC_PRESIGN": str(presign).lower(),
        "WEIGHTSYNC_LOG_LEVEL": "warning",
    }
    return serve(
        ["--data", str(data), "--store", f"s3://{BUCKET}/{uuid.uuid4().hex}", "--s3-endpoint", proxy.url],
        tmp / f"{name}.log",
        env=env,
    )


def _delta(before: dict, after: dict) -> dict:
    """``after - before`` for proxy snapshots (numbers and per-key counts)."""
    out: dict = {}
    for key, value in after.items():
        if isinstance(value, dict):
            out[key] = {
                k: v - before.get(key, {}).get(k, 0) for k, v in value.items() if v - before.get(key, {}).get(k, 0)
            }
        else:
            out[key] = value - before.get(key, 0)
    return out


def _head(url: str, model: str) -> int | None:
    r = httpx.get(f"{url}/v1/models/{model}/versions/latest", timeout=30)
    return r.json()["number"] if r.status_code == 200 else None


def _versions(url: str, model: str) -> list[int]:
    r = httpx.get(f"{url}/v1/models/{model}/versions", timeout=30)
    return [v["number"] for v in r.json()["versions"]] if r.status_code == 200 else []


def _fsck(url: str) -> dict:
    r = httpx.post(f"{url}/v1/admin/fsck", json={"read_data": True, "repair": False}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _publish_fail_cleanly(
    pub: Publisher, url: str, model: str, files: dict[str, bytes], step: int, outcomes: Counter[str]
) -> int:
    """Publish once without client retries; on failure check nothing is visible, then retry until it commits."""
    before_head, before = _head(url, model), _versions(url, model)
    pub.api.retry = Retry(attempts=1)
    try:
        number = pub.publish(checkpoint_of(files), step=step).version
        outcomes["committed"] += 1
        return number
    except errors.WeightsyncError as exc:
        # A named error, and no partial visibility: the head and the version list are unchanged.
        assert isinstance(exc, (errors.ServerUnavailable, errors.ClientError)), repr(exc)
        outcomes[f"failed: {type(exc).__name__}"] += 1
        assert _head(url, model) == before_head
        assert _versions(url, model) == before
    finally:
        pub.api.retry = CLIENT_RETRY
    number = pub.publish(checkpoint_of(files), step=step).version
    outcomes["committed on retry"] += 1
    return number


def test_pulls_and_publishes_survive_s3_faults(seaweed, proxy, tmp_path, long_run):
    versions = make_versions(12 if long_run else 7, seed=SEED, big=1 << 20)
    expected = [digests_of(v) for v in versions]
    model = "faults-" + uuid.uuid4().hex[:8]
    proxy.rate = RATE
    start = proxy.snapshot()
    # Start-up meets faults too: the bucket check and the If-None-Match probe are retried (one
    # transient fault used to make serve exit 1: the store was opened past its retries).
    proxy.force("slowdown-503", "reset-before", "error-500", "stall")
    svc = _serve_s3(seaweed, proxy, tmp_path)
    seen = ClientStats()
    try:
        assert httpx.get(svc.url + "/readyz", timeout=10).json() == {"catalog": True, "store": True}
        assert not any("ignores If-None-Match" in r["msg"] for r in log_records(svc.log()))
        # Publishes with the client's retries: every one commits (presigned uploads go through the proxy too).
        numbers = []
        outcomes: Counter[str] = Counter()
        with Publisher(
            svc.url,
            model,
            concurrency=4,
            object_bytes=512 << 10,
            chunk_bytes=128 << 10,
            retry=CLIENT_RETRY,
            transport=seen.transport(),
        ) as pub:
            # The first upload's reply is lost after SeaweedFS stored it: the retry meets 412 (it exists).
            proxy.force_op("PUT presigned", "reset-after")
            for step in range(4):
                numbers.append(pub.publish(checkpoint_of(versions[step]), step=step).version)
            # Then without client retries: each publish commits or fails cleanly, and commits when retried.
            for step in range(4, len(versions)):
                numbers.append(_publish_fail_cleanly(pub, svc.url, model, versions[step], step, outcomes))
        assert numbers == list(range(1, len(versions) + 1))
        assert _versions(svc.url, model) == numbers
        t_pulls = time.monotonic()

        # Pulls: fresh directories at every version, and incremental pulls from each version to the head.
        jobs = [(n, None) for n in numbers] + [(n, numbers[-1]) for n in numbers[:-1]]
        rounds = 8 if long_run else 1
        jobs = jobs * rounds
        failures: list[str] = []

        def pull(job_index: int) -> str:
            first, then = jobs[job_index]
            root = tmp_path / f"pull-{job_index}"
            with Subscriber(
                svc.url,
                model,
                name=f"sub-{job_index % 4}",
                concurrency=4,
                range_bytes=128 << 10,
                retry=CLIENT_RETRY,
                transport=seen.transport(),
            ) as sub:
                try:
                    got = sub.pull(root, first)
                    assert file_digests(root) == expected[first - 1]
                    if then is not None:
                        got = sub.pull(root, then)
                        assert got.mode == "delta"
                        assert file_digests(root) == expected[then - 1]
                except Exception as exc:  # noqa: BLE001 - counted, then asserted to be none
                    failures.append(f"{first}->{then}: {type(exc).__name__}: {exc}")
                    return "failed"
            return "ok"

        with ThreadPoolExecutor(4) as ex:
            results = list(ex.map(pull, range(len(jobs))))
        pull_s = time.monotonic() - t_pulls
        pulls = len(jobs) + sum(1 for _, then in jobs if then is not None)
        during = _delta(start, proxy.snapshot())
        proxy.rate = 0.0
        report = _fsck(svc.url)
    finally:
        proxy.rate = 0.0
        svc.stop()
    print(
        f"\n[store-faults seed={SEED} rate={RATE}] S3 requests={during['requests']} "
        f"faults={during['faults']} by kind={during['faults_by_kind']} by op={during['faults_by_op']}; "
        f"publishes={len(numbers)} ({dict(outcomes)}); pulls={pulls} in {pull_s:.1f}s failed={len(failures)}; "
        f"client saw 5xx={sum(seen.count(s) for s in (500, 502, 503, 504))} "
        f"transport errors={dict(seen.errors)}; fsck ok={report['ok']} problems={report['problems']}"
    )
    assert failures == [] and results.count("ok") == len(jobs)
    assert during["faults"] > 0
    assert seen.count_kind("presigned", 412) >= 1  # the lost-reply upload was retried and found in place
    assert report["ok"], report["problems"]


def test_uploads_through_the_service_survive_s3_faults(seaweed, proxy, tmp_path):
    """Without presigned URLs every byte goes through the service's put_stream: multipart included."""
    # Two 9 MiB tensors in one object above the 16 MiB part size, so a multipart upload.
    versions = make_versions(3, seed=SEED + 1, big=9 << 20, fraction=0.01)
    model = "faults-mp-" + uuid.uuid4().hex[:8]
    proxy.rate = RATE
    before = proxy.snapshot()
    svc = _serve_s3(seaweed, proxy, tmp_path, presign=False, name="serve-nopresign")
    seen = ClientStats()
    try:
        # Replies lost after SeaweedFS acted, on a single PUT and on the completion of a multipart upload.
        proxy.force_op("PutObject", "reset-after")
        proxy.force_op("CompleteMultipartUpload", "reset-after")
        with Publisher(
            svc.url,
            model,
            concurrency=2,
            object_bytes=24 << 20,
            retry=Retry(attempts=10, cap=0.5),
            transport=seen.transport(),
        ) as pub:
            numbers = [pub.publish(checkpoint_of(v), step=i).version for i, v in enumerate(versions)]
        with Subscriber(svc.url, model, retry=CLIENT_RETRY) as sub:  # the head decodes the whole chain
            sub.pull(tmp_path / "head")
        assert file_digests(tmp_path / "head") == digests_of(versions[-1])
        during = _delta(before, proxy.snapshot())
        proxy.rate = 0.0
        report = _fsck(svc.url)
    finally:
        proxy.rate = 0.0
        svc.stop()
    mp = {
        k: during["by_op"].get(k, 0)
        for k in ("CreateMultipartUpload", "UploadPart", "CompleteMultipartUpload", "AbortMultipartUpload")
    }
    print(
        f"\n[store-faults via service seed={SEED}] S3 requests={during['requests']} "
        f"faults={during['faults']} by kind={during['faults_by_kind']} multipart={mp}; "
        f"client saw 503={seen.count(503)}; fsck ok={report['ok']}"
    )
    assert numbers == [1, 2, 3]
    assert mp["CompleteMultipartUpload"] >= 1
    assert report["ok"], report["problems"]


def test_s3_timeouts_and_lost_replies_are_retried(seaweed, proxy):
    """Store level: a stalled request times out (StoreUnavailable, retried); a lost PUT reply
    retries to created=False."""
    proxy.rate = 0.0
    proxy.stall_s = 20.0  # far beyond the client's read timeout: only the timeout can end the wait

    def s3(**kw) -> S3Store:
        return S3Store(
            BUCKET,
            f"timeouts-{uuid.uuid4().hex}",
            endpoint_url=proxy.url,
            region=seaweed.region,
            access_key_id=seaweed.access_key,
            secret_access_key=seaweed.secret_key,
            create_bucket=True,
            read_timeout_s=0.5,
            # The stalls below are of replies, which only the read timeout ends; a connect on loopback
            # is the kernel's, and 0.5 s of it was once exceeded on a loaded 2-core CI box.
            connect_timeout_s=5.0,
            **kw,
        )

    async def run() -> None:
        async with s3() as bare:
            digest = (await bare.put(b"payload" * 1000)).digest
            proxy.force("stall")
            with pytest.raises(errors.StoreUnavailable, match="Timeout"):
                await bare.get(digest)
        async with RetryingStore(s3(), base_delay=0.01) as store:
            await store.open()
            proxy.force("stall")
            digest = (await store.put(b"other" * 1000)).digest
            proxy.force("stall", "truncate")
            assert await store.get(digest) == b"other" * 1000
            proxy.force("reset-after")  # the server stored it, the reply was lost: the retry finds it there
            result = await store.put(b"lost reply" * 1000)
            assert result.created is False
            assert await store.get(result.digest) == b"lost reply" * 1000

    try:
        asyncio.run(run())
    finally:
        proxy.stall_s = 0.3


def test_store_ignoring_if_none_match_is_detected_at_start(seaweed, proxy, tmp_path):
    """A store that drops If-None-Match: ``serve`` runs the probe at start, warns, and keeps serving correctly."""
    proxy.rate = 0.0
    proxy.strip_if_none_match = True
    stripped = proxy.stripped
    model = "inm-" + uuid.uuid4().hex[:8]
    try:
        svc = _serve_s3(seaweed, proxy, tmp_path, presign=False, name="serve-inm")
        try:
            warnings = [
                r
                for r in log_records(svc.log())
                if r.get("level") == "warning" and "ignores If-None-Match" in r.get("msg", "")
            ]
            # Once by the start-up check, once by the worker's own open: a warning, not a refusal.
            assert len(warnings) >= 1 and warnings[0]["logger"] == "weightsync.store.s3"
            versions = make_versions(2, seed=SEED + 2, big=256 << 10)
            with Publisher(svc.url, model, retry=CLIENT_RETRY) as pub:
                for i, v in enumerate(versions):
                    pub.publish(checkpoint_of(v), step=i)
                pub.publish(checkpoint_of(versions[1]), step=2)  # same bytes again: writes of existing objects
            with Subscriber(svc.url, model, retry=CLIENT_RETRY) as sub:
                sub.pull(tmp_path / "inm", 3)
            assert file_digests(tmp_path / "inm") == digests_of(versions[1])
            assert _fsck(svc.url)["ok"]
        finally:
            svc.stop()

        async def probe() -> tuple[bool, bool | None]:
            async with S3Store(
                BUCKET,
                "probe",
                endpoint_url=proxy.url,
                region=seaweed.region,
                access_key_id=seaweed.access_key,
                secret_access_key=seaweed.secret_key,
            ) as s:
                return await s.check_conditional_writes(), s.capabilities.atomic_create

        assert asyncio.run(probe()) == (False, False)
        proxy.strip_if_none_match = False
        assert asyncio.run(probe()) == (True, True)
    finally:
        proxy.strip_if_none_match = False
    assert proxy.stripped > stripped
    print(
        f"\n[if-none-match] stripped {proxy.stripped - stripped} conditional writes; serve warned "
        f"{len(warnings)}x and kept serving"
    )
