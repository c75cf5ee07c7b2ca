"""prepare + apply: updates land in place in torch tensors, bit-identical to a fresh load of the version."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")

from _client_util import TinyTrainer  # noqa: E402

from weightsync import errors  # noqa: E402
from weightsync.client import Publisher, Subscriber  # noqa: E402

SMALL = {"chunk_bytes": 16 << 10, "object_bytes": 48 << 10}


def _bits(t):
    return t.detach().contiguous().view(-1).view(torch.uint8)


def _assert_identical(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        assert torch.equal(_bits(got[name]), _bits(want[name])), f"tensor {name} differs"


def _snapshot(tensors: dict) -> dict:
    return {k: v.clone() for k, v in tensors.items()}


def _fresh_load(url: str, model: str, version: int, tmp: Path) -> dict:
    """What a server restarting on `version` would load: pull into a new dir, read with safetensors."""
    d = tmp / f"fresh-v{version}"
    with Subscriber(url, model, name="fresh-loader") as sub:
        sub.pull(d, version)
    return st.load_file(str(d / "model.safetensors"))


def _publish(url: str, model: str, n: int, *, seed: int = 0, keyframe_at: int | None = None) -> list[dict]:
    trainer = TinyTrainer(seed=seed)
    out = []
    with Publisher(url, model, **SMALL) as pub:
        for i in range(1, n + 1):
            trainer.step()
            sd = trainer.export()
            pub.publish(sd, step=i, keyframe=(i == keyframe_at))
            out.append(sd)
    return out


def test_apply_in_place_is_bit_identical(server, model, tmp_path: Path) -> None:
    published = _publish(server.url, model, 4)
    sub = Subscriber(server.url, model, name="inference")
    try:
        sub.pull(tmp_path / "boot", version=1)
        tensors = st.load_file(str(tmp_path / "boot" / "model.safetensors"))
        assert {t.dtype for t in tensors.values()} >= {
            torch.bfloat16,
            torch.float32,
            torch.float8_e4m3fn,
            torch.uint8,
            torch.int64,
            torch.bool,
        }
        pointers = {k: v.data_ptr() for k, v in tensors.items()}
        for v in (2, 3, 4):
            prepared = sub.prepare(v)
            assert prepared.base == v - 1 and prepared.target == v and prepared.steps == 1
            assert prepared.changed_elements > 0
            assert all(u.replace is None for u in prepared.updates.values()), "a delta applies element-wise"
            pause = sub.apply(tensors, prepared)
            assert pause >= 0 and sub.version == v
            _assert_identical(tensors, _fresh_load(server.url, model, v, tmp_path))
            _assert_identical(tensors, published[v - 1])
        assert {k: v.data_ptr() for k, v in tensors.items()} == pointers, "updated in place"
        assert sub.prepare().updates == {}, "nothing to do at the head"
    finally:
        sub.close()
    # Several versions in one update (v1 → v4), staged on the device ahead of the apply.
    with Subscriber(server.url, model, version=1, name="late") as late:
        tensors = st.load_file(str(tmp_path / "boot" / "model.safetensors"))
        prepared = late.prepare(device="cpu")
        assert prepared.steps == 3 and prepared.target == 4
        late.apply(tensors, prepared)
        _assert_identical(tensors, published[3])


def test_wrong_base_is_refused_before_any_change(server, model, tmp_path: Path) -> None:
    _publish(server.url, model, 3, seed=1)
    v1 = _fresh_load(server.url, model, 1, tmp_path)
    with Subscriber(server.url, model, version=1) as sub:
        tensors = _snapshot(v1)
        prepared = sub.prepare(2)
        sub.apply(tensors, prepared)
        before = _snapshot(tensors)
        with pytest.raises(errors.BaseMismatch):
            sub.apply(tensors, prepared)  # the tensors hold v2 now: this update is for v1
        _assert_identical(tensors, before)
    # The subscriber is told v2, but the tensors hold v1's bytes: the hash check refuses, nothing changes.
    with Subscriber(server.url, model, version=2) as liar:
        tensors = _snapshot(v1)
        prepared = liar.prepare(3)
        with pytest.raises(errors.BaseMismatch):
            liar.apply(tensors, prepared)
        _assert_identical(tensors, v1)
        assert liar.version == 2


def test_keyframe_replaces_and_new_tensors_need_reload(server, model, tmp_path: Path) -> None:
    published = _publish(server.url, model, 2, seed=2, keyframe_at=2)
    with Subscriber(server.url, model, version=1) as sub:
        tensors = _fresh_load(server.url, model, 1, tmp_path)
        prepared = sub.prepare()
        assert prepared.target == 2 and all(u.replace is not None for u in prepared.updates.values())
        sub.apply(tensors, prepared)  # same shapes and dtypes: copied in place
        _assert_identical(tensors, published[1])
        # v3 adds a tensor; v4 also reshapes one.
        sd3 = dict(published[1], extra=torch.arange(10, dtype=torch.float32))
        with Publisher(server.url, model, **SMALL) as pub:
            pub.publish(sd3)
        prepared = sub.prepare()
        before = _snapshot(tensors)
        with pytest.raises(errors.ReloadRequired):
            sub.apply(tensors, prepared)
        _assert_identical(tensors, before)
        sub.apply(tensors, prepared, strict=False)  # skips what the caller does not hold
        assert sub.version == 3
        sd4 = dict(sd3)
        sd4["0.weight"] = sd3["0.weight"].reshape(128, 256).clone()
        sd4["0.weight"].view(-1)[:5] += 1
        with Publisher(server.url, model, **SMALL) as pub:
            pub.publish(sd4)
        prepared = sub.prepare()
        before = _snapshot(tensors)
        with pytest.raises(errors.ReloadRequired):
            sub.apply(tensors, prepared, strict=False)
        _assert_identical(tensors, before)


# --- in process, no server: inplace.prepare from a manifest and its frames ----------------------------


def _local_update(published: list[dict], base: int, target: int, **kw):
    """inplace.prepare of the delta published[base-1] → published[target-1], encoded in process (no server)."""
    from weightsync.client import inplace
    from weightsync.client.tensors import serialize_state_dict
    from weightsync.codec.checkpoint import Checkpoint
    from weightsync.codec.encoder import Encoder

    def ck(sd: dict) -> Checkpoint:
        return Checkpoint.from_bytes({"model.safetensors": serialize_state_dict(sd).tobytes()})

    encoded = Encoder(chunk_bytes=16 << 10).encode(ck(published[target - 1]), ck(published[base - 1]))
    area = b"".join(fr.data for fr in encoded.frames)
    starts = [0]
    for fr in encoded.frames:
        starts.append(starts[-1] + len(fr.data))
    manifest = encoded.with_locations(lambda i, fr: (None, starts[i]))
    return inplace.prepare(
        [manifest],
        lambda ref: memoryview(area)[ref.offset : ref.offset + ref.length],
        model="local",
        base=base,
        target=target,
        threads=2,
        **kw,
    )


def _trained(n: int, seed: int = 3) -> list[dict]:
    trainer = TinyTrainer(seed=seed)
    out = []
    for _ in range(n):
        trainer.step()
        out.append({k: v.clone() for k, v in trainer.export().items()})
    return out


@pytest.mark.parametrize("staged", [False, True], ids=["in-place-hash", "staged-hash"])
def test_local_prepare_and_verified_apply(staged: bool) -> None:
    from weightsync.client import inplace
    from weightsync.client.verify import IN_PLACE, STAGED_HOST, HostHasher

    published = _trained(2)
    prepared = _local_update(published, 1, 2, device="cpu")
    assert prepared.steps == 1 and prepared.changed_elements > 0
    tensors = _snapshot(published[0])
    # Tiny staging buffers: the larger tensors stream through them in many pieces.
    hasher = HostHasher(threads=2, buffers=2, buffer_bytes=8 << 10, piece_bytes=3000, stage_cpu=staged)
    applied = inplace.apply(tensors, prepared, model="local", version=1, verify=True, strict=True, hasher=hasher)
    applied.check()
    _assert_identical(tensors, published[1])
    assert applied.verified_by == ((STAGED_HOST,) if staged else (IN_PLACE,))
    assert applied.base_check_s > 0 and applied.result_check_s > 0
    assert applied.tensors == len(prepared.updates)
    unverified = inplace.apply(_snapshot(published[0]), prepared, model="local", version=1, verify=False, strict=True)
    assert unverified.verified_by == () and unverified.base_check_s == 0


def test_local_base_mismatch_names_the_tensor_and_writes_nothing() -> None:
    from weightsync.client import inplace
    from weightsync.client.verify import HostHasher

    published = _trained(2, seed=4)
    prepared = _local_update(published, 1, 2)
    for staged in (False, True):
        tensors = _snapshot(published[0])
        victim = sorted(prepared.updates)[-1]  # the last one checked: every other tensor passed its check
        _bits(tensors[victim])[0] ^= 1
        before = _snapshot(tensors)
        hasher = HostHasher(buffer_bytes=4096, piece_bytes=1000, stage_cpu=staged)
        with pytest.raises(errors.BaseMismatch, match=repr(victim)):
            inplace.apply(tensors, prepared, model="local", version=1, verify=True, strict=True, hasher=hasher)
        _assert_identical(tensors, before)


def test_local_result_mismatch_raises_after_the_write() -> None:
    """As before this change: a failed result check raises ChecksumMismatch naming the tensor; the
    tensors hold what the update wrote (no restore), and the caller must reload the version."""
    from weightsync.client import inplace

    published = _trained(2, seed=5)
    prepared = _local_update(published, 1, 2)
    name = sorted(prepared.updates)[0]
    prepared.updates[name].result_xxh3 = "0" * 32
    tensors = _snapshot(published[0])
    applied = inplace.apply(tensors, prepared, model="local", version=1, verify=True, strict=True)
    with pytest.raises(errors.ChecksumMismatch, match=repr(name)):
        applied.check()
    _assert_identical(tensors, published[1])


def test_result_mismatch_through_the_subscriber(server, model, tmp_path: Path) -> None:
    _publish(server.url, model, 2, seed=6)
    with Subscriber(server.url, model, version=1) as sub:
        tensors = _fresh_load(server.url, model, 1, tmp_path)
        prepared = sub.prepare()
        name = next(iter(prepared.updates))
        prepared.updates[name].result_xxh3 = "f" * 32
        with pytest.raises(errors.ChecksumMismatch, match=repr(name)):
            sub.apply(tensors, prepared)
        assert sub.version == 2  # the tensors changed: they hold v2 or must be reloaded (unchanged semantics)
