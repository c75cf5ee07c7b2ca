"""Bounded load on loopback against ``weightsync serve`` (embedded SQLite catalog + filesystem store).

Two phases, each held for the test's duration (10 s; 60 s with ``--long``), driven by an
asyncio httpx client in this process:

* metadata: ``GET …/versions/{n}/manifest`` and ``GET …/plan`` (full and incremental), every
  answer checked (manifest bytes against their digest, plan targets);
* data: ``GET /v1/objects/{digest}`` with a ``Range`` of up to 1 MiB, every body compared with
  the object's bytes.

The only assertion is zero errors; throughput and p50/p99 latencies are printed (run with
``-s``) and recorded in docs/reliability/faults-outage-load.md. Server and client share the
machine's cores, so the figures are a floor, not a capacity.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
import uuid
from dataclasses import dataclass, field

import httpx
from _fault_data import checkpoint_of, make_versions
from _fault_service import serve

from weightsync.client import Publisher

SEED = 11
METADATA_WORKERS = 16
DATA_WORKERS = 8
RANGE_MAX = 1 << 20


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000 if xs else float("nan")


@dataclass
class Phase:
    """What one phase did: requests, bytes, errors, and latencies per kind of request."""

    name: str
    ops: int = 0
    errors: list[str] = field(default_factory=list)
    bytes: int = 0
    latencies: dict[str, list[float]] = field(default_factory=dict)
    seconds: float = 0.0

    def lines(self) -> list[str]:
        rate = self.ops / self.seconds if self.seconds else 0.0
        mb = f", {self.bytes / self.seconds / 1e6:.1f} MB/s" if self.bytes else ""
        every = [x for xs in self.latencies.values() for x in xs]
        out = [
            f"{self.name}: {self.ops} requests in {self.seconds:.1f} s = {rate:.0f}/s{mb}; "
            f"p50 {_pct(every, 0.50):.1f} ms, p99 {_pct(every, 0.99):.1f} ms; errors {len(self.errors)}"
        ]
        for kind, xs in sorted(self.latencies.items()):
            out.append(
                f"    {kind}: {len(xs)} ({len(xs) / self.seconds:.0f}/s), "
                f"p50 {_pct(xs, 0.50):.1f} ms, p99 {_pct(xs, 0.99):.1f} ms"
            )
        return out


async def _run(phase: Phase, workers: int, duration: float, one) -> None:
    """Run ``one(client, rng) -> (kind, bytes)`` in ``workers`` loops until ``duration`` is over."""
    limits = httpx.Limits(max_connections=workers, max_keepalive_connections=workers)
    async with httpx.AsyncClient(limits=limits, timeout=30.0) as client:
        deadline = time.monotonic() + duration

        async def loop(i: int) -> None:
            rng = random.Random(SEED * 1000 + i)
            while time.monotonic() < deadline:
                t = time.monotonic()
                try:
                    kind, n = await one(client, rng)
                except Exception as exc:  # noqa: BLE001 - every failure is counted, then asserted absent
                    phase.errors.append(f"{type(exc).__name__}: {exc}"[:300])
                    continue
                phase.latencies.setdefault(kind, []).append(time.monotonic() - t)
                phase.bytes += n
                phase.ops += 1

        t0 = time.monotonic()
        await asyncio.gather(*(loop(i) for i in range(workers)))
        phase.seconds = time.monotonic() - t0


def test_load_manifests_and_ranged_downloads(tmp_path, long_run):
    duration = 60.0 if long_run else 10.0
    svc = serve(["--data", str(tmp_path / "data")], tmp_path / "serve.log", env={"WEIGHTSYNC_LOG_LEVEL": "warning"})
    model = "load-" + uuid.uuid4().hex[:8]
    try:
        versions = make_versions(3, seed=SEED, big=4 << 20)
        with Publisher(svc.url, model, object_bytes=4 << 20) as pub:
            for i, v in enumerate(versions):
                pub.publish(checkpoint_of(v), step=i)
        with httpx.Client(base_url=svc.url, timeout=60) as c:
            vers = c.get(f"/v1/models/{model}/versions").json()["versions"]
            manifests = {v["number"]: v["manifest"] for v in vers}
            plan = c.get(f"/v1/models/{model}/plan").json()
            objects: dict[str, bytes] = {}
            for step in c.get(f"/v1/models/{model}/plan", params={"have": 1}).json()["steps"] + plan["steps"]:
                for o in step["objects"]:
                    data = c.get(f"/v1/objects/{o['digest']}").content
                    assert hashlib.sha256(data).hexdigest() == o["digest"]
                    objects[o["digest"]] = data
        head = max(manifests)
        digests = sorted(objects)

        async def metadata(client: httpx.AsyncClient, rng: random.Random) -> tuple[str, int]:
            pick = rng.random()
            if pick < 0.5:
                n = rng.choice(list(manifests))
                r = await client.get(f"{svc.url}/v1/models/{model}/versions/{n}/manifest")
                r.raise_for_status()
                if hashlib.sha256(r.content).hexdigest() != manifests[n]:
                    raise AssertionError(f"manifest of v{n} came back with other bytes")
                return "GET manifest", 0
            params = {"have": rng.randint(1, head - 1)} if pick < 0.75 else {}
            r = await client.get(f"{svc.url}/v1/models/{model}/plan", params=params)
            r.raise_for_status()
            if r.json()["target"] != head:
                raise AssertionError(f"plan targets {r.json()['target']}, not the head {head}")
            return ("GET plan (incremental)" if params else "GET plan (full)"), 0

        sizes = [len(objects[d]) for d in digests]

        async def data(client: httpx.AsyncClient, rng: random.Random) -> tuple[str, int]:
            digest = rng.choices(digests, weights=sizes)[0]  # bytes spread as a full pull spreads them
            body = objects[digest]
            start = rng.randrange(len(body))
            end = min(len(body), start + rng.randint(1, RANGE_MAX))
            r = await client.get(f"{svc.url}/v1/objects/{digest}", headers={"Range": f"bytes={start}-{end - 1}"})
            if r.status_code != 206:
                raise AssertionError(f"range answered {r.status_code}")
            if r.content != body[start:end]:
                raise AssertionError(f"range {start}-{end} of {digest[:12]} came back with other bytes")
            return "GET object (Range)", len(r.content)

        meta, dl = Phase("metadata (manifest + plan)"), Phase("ranged object downloads")
        asyncio.run(_run(meta, METADATA_WORKERS, duration, metadata))
        asyncio.run(_run(dl, DATA_WORKERS, duration, data))
    finally:
        svc.stop()
    stored = sum(len(b) for b in objects.values())
    print(
        f"\n[load {duration:.0f}s per phase, embedded sqlite+fs, 1 worker; {len(digests)} objects "
        f"{stored / 1e6:.1f} MB; {METADATA_WORKERS}/{DATA_WORKERS} concurrent]"
    )
    print("\n".join("  " + line for line in meta.lines() + dl.lines()))
    assert meta.errors == [] and dl.errors == []
    assert meta.ops > 0 and dl.ops > 0
