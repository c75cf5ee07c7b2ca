"""State_dict snapshots for publish_async: the safetensors bytes exactly, taken before the call returns."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from weightsync import errors  # noqa: E402
from weightsync.client import Publisher, Subscriber, tensors  # noqa: E402
from weightsync.client.tensors import SnapshotBuffers, serialize_state_dict, snapshot_state_dict  # noqa: E402
from weightsync.codec import safetensors  # noqa: E402

SMALL = {"chunk_bytes": 16 << 10, "object_bytes": 48 << 10}


def _reference(state_dict: dict, metadata: dict | None = None) -> bytes:
    """The file the old serializer wrote: the reference header, then each tensor's bytes in order."""
    parts = []
    for name, t in state_dict.items():
        c = t.detach().cpu().contiguous().reshape(-1)
        data = c.view(torch.uint8).numpy().tobytes() if c.numel() else b""
        parts.append((name, tensors.dtype_name(t.dtype), tuple(t.shape), data))
    return safetensors.serialize(parts, metadata if metadata is not None else {"format": "pt"})


def _varied(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(6, 10, generator=g)
    return {
        "f32": torch.randn(17, 3, generator=g),
        "bf16": torch.randn(5, 7, generator=g).to(torch.bfloat16),
        "f16": torch.randn(9, generator=g).to(torch.float16),
        "fp8": torch.randn(33, generator=g).to(torch.float8_e4m3fn),
        "i64": torch.randint(-(1 << 40), 1 << 40, (4, 2), generator=g),
        "u8": torch.randint(0, 256, (13,), generator=g, dtype=torch.uint8),  # odd size: later data unaligned
        "i8": torch.randint(-128, 128, (3, 3), generator=g, dtype=torch.int8),
        "bool": torch.rand(11, generator=g) > 0.5,
        "scalar": torch.tensor(3.25, dtype=torch.float64),
        "empty": torch.zeros(0, 4, dtype=torch.bfloat16),
        "transposed": wide.t(),
        "strided": wide[::2, 1::3],
        "expanded": torch.arange(4, dtype=torch.int32).expand(3, 4),
        "offset": wide.reshape(-1)[7:19],
    }


def test_snapshot_bytes_equal_the_reference_serialization() -> None:
    sd = _varied()
    assert not sd["transposed"].is_contiguous() and not sd["strided"].is_contiguous()
    expected = _reference(sd)
    assert serialize_state_dict(sd).tobytes() == expected
    assert snapshot_state_dict(sd, buffers=SnapshotBuffers()).tobytes() == expected
    assert snapshot_state_dict(sd, threads=1).tobytes() == expected
    meta = {"step": "7", "format": "pt"}
    assert snapshot_state_dict(sd, meta, buffers=SnapshotBuffers()).tobytes() == _reference(sd, meta)


def test_snapshot_splits_large_tensors_over_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tensors, "_PIECE", 1000)  # pieces of 1000 bytes: one tensor spans many copy tasks
    sd = _varied(seed=1)
    sd["big"] = torch.randn(123, 77)
    assert snapshot_state_dict(sd, threads=4).tobytes() == _reference(sd)


def test_snapshot_is_the_state_at_the_call() -> None:
    sd = _varied(seed=2)
    expected = _reference(sd)
    snap = snapshot_state_dict(sd, buffers=SnapshotBuffers())
    for t in sd.values():
        if t.numel() and t.dtype.is_floating_point and t.dtype != torch.float8_e4m3fn:
            t.add_(1)  # views share storage with `wide`: every float tensor changes after the call
    assert _reference(sd) != expected
    assert snap.tobytes() == expected


def test_buffers_are_reused_once_every_view_is_gone() -> None:
    sd = _varied(seed=3)
    pool = SnapshotBuffers(keep=1)
    first = snapshot_state_dict(sd, buffers=pool)
    view = first[100:]  # a publish holds slices of the snapshot: the buffer stays leased while they live
    del first
    gc.collect()
    assert pool.idle == 0
    second = snapshot_state_dict(sd, buffers=pool)
    assert pool.allocated == 2
    del view
    assert pool.idle == 1
    sd["f32"].mul_(2)
    third = snapshot_state_dict(sd, buffers=pool)  # the same size: the freed buffer, overwritten
    assert pool.allocated == 2 and pool.idle == 0
    assert third.tobytes() == _reference(sd) != second.tobytes()
    sd["extra"] = torch.ones(5)
    other = snapshot_state_dict(sd, buffers=pool)  # another size: a new buffer
    assert pool.allocated == 3
    del second, third, other
    assert pool.idle == 1, "at most `keep` idle buffers are kept"


def test_snapshot_errors() -> None:
    with pytest.raises(TypeError):
        snapshot_state_dict({1: torch.ones(2)})  # type: ignore[dict-item]
    with pytest.raises(errors.UnsupportedDtype):
        snapshot_state_dict({"c": torch.ones(2, dtype=torch.complex64)}, buffers=SnapshotBuffers())
    with pytest.raises(ValueError):
        SnapshotBuffers(keep=-1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_snapshot_of_cuda_tensors_is_pinned_and_exact() -> None:
    host = _varied(seed=4)
    sd = {k: v.cuda() for k, v in host.items()}
    sd["transposed_cuda"] = sd["f32"].t()
    expected = _reference(sd)
    pool = SnapshotBuffers()
    snap = snapshot_state_dict(sd, buffers=pool)
    for t in sd.values():
        if t.numel() and t.dtype == torch.float32:
            t.add_(1)  # queued on the current stream after the call: not in the snapshot
    torch.cuda.synchronize()
    assert snap.tobytes() == expected
    lease = snap.base
    assert lease.tensor.is_pinned()


def test_publish_async_publishes_the_weights_as_of_the_call(server, model, tmp_path: Path) -> None:
    sd = _varied(seed=5)  # holds a 0-element tensor between others: deltas still apply (same offset as the next)
    sd["w"] = torch.randn(64, 300)
    expected = []
    futures = []
    with Publisher(server.url, model, **SMALL) as pub:
        for step in range(1, 5):
            expected.append(_reference(sd))
            futures.append(pub.publish_async(sd, step=step))
            with torch.no_grad():  # the next "optimizer step" runs while the publish proceeds
                sd["w"][step, :50].add_(0.5)
                sd["transposed"][1, :2].mul_(-1)  # through a view: `strided` and `offset` change too
                sd["i64"][0].add_(1)
            if step == 2:
                futures[-1].result(timeout=60)
        results = [f.result(timeout=60) for f in futures]
        for f in futures:
            assert f.done()
        pub.publish_async(sd).result(timeout=60)  # one at a time: the publish before's buffer comes back
        expected.append(_reference(sd))
        after_serial = pub._snapshots.allocated
        for _ in range(2):
            pub.publish_async(sd).result(timeout=60)
            expected.append(_reference(sd))
        assert pub._snapshots.allocated == after_serial, "serial publishes of one size reuse two buffers"
    assert [r.version for r in results] == [1, 2, 3, 4]
    assert [r.kind for r in results] == ["keyframe"] + ["delta"] * 3
    with Subscriber(server.url, model) as sub:
        for v in (1, 3, 4, 7):
            sub.pull(tmp_path / f"v{v}", version=v)
            assert (tmp_path / f"v{v}" / "model.safetensors").read_bytes() == expected[v - 1]


def test_publish_holds_the_collector_off_and_publish_async_does_not(server, model) -> None:
    seen: list[bool] = []
    sd = {"w": torch.randn(64, 300)}
    with Publisher(server.url, model, progress=lambda *_: seen.append(gc.isenabled()), **SMALL) as pub:
        pub.publish(sd, step=1)
        assert seen and not any(seen), "a publish the caller waits for runs with the collector off"
        assert gc.isenabled()
        seen.clear()
        with torch.no_grad():
            sd["w"][0].add_(1)
        pub.publish_async(sd, step=2).result(timeout=60)
        assert seen and all(seen), "one behind publish_async leaves it to the trainer that keeps running"
    assert gc.isenabled()


@pytest.mark.parametrize(
    "t",
    [
        torch.arange(12, dtype=torch.float32).reshape(3, 4),
        torch.randn(5, 7).to(torch.bfloat16),
        torch.tensor(3.5, dtype=torch.float16),  # 0-dim
        torch.zeros(0, 4, dtype=torch.int64),  # no elements
        torch.arange(40, dtype=torch.int8)[8:24],  # a view into a larger storage, at an offset
    ],
)
def test_host_bytes_is_a_live_view_of_the_tensors_bytes(t) -> None:
    def through_torch() -> bytes:  # the bytes by torch's own views, not through host_bytes (raw_bytes uses it)
        return bytes(t.flatten().view(torch.uint8).tolist())

    view = tensors.host_bytes(t)
    assert view.dtype == np.uint8 and view.ndim == 1
    assert view.tobytes() == through_torch() == tensors.raw_bytes(t).tobytes()
    if t.numel():
        view[0] ^= 0xFF  # writes land in the tensor
        assert through_torch()[0] == view[0]


def test_host_bytes_keeps_its_tensor_alive_and_refuses_what_it_cannot_view() -> None:
    t = torch.arange(1000, dtype=torch.int32)
    want = t.numpy().tobytes()
    view = tensors.host_bytes(t)
    del t
    gc.collect()
    junk = [torch.full((1000,), 7, dtype=torch.int32) for _ in range(50)]  # would reuse freed memory
    assert view.tobytes() == want
    del junk
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        tensors.host_bytes(torch.arange(12).reshape(3, 4).t())
