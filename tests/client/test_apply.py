"""prepare + apply: updates land in place in torch tensors, bit-identical to a fresh load of the version."""

from __future__ import annotations

from pathlib import Path

import numpy as np
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


def _local_update(
    published: list[dict],
    base: int,
    target: int,
    *,
    version: int = 2,
    keyframe: bool = False,
    chunk_bytes: int = 16 << 10,
    damage: int | None = None,
    **kw,
):
    """inplace.prepare of the delta (or with `keyframe` the keyframe) published[base-1] → published[target-1],
    encoded in process (no server), in FORMAT `version`, frames of `chunk_bytes`; with `damage`, that
    frame's last byte flipped as it is read."""
    from weightsync.client import inplace
    from weightsync.client.tensors import serialize_state_dict
    from weightsync.codec.checkpoint import Checkpoint
    from weightsync.codec.encoder import Encoder

    def ck(sd: dict) -> Checkpoint:
        return Checkpoint.from_bytes({"model.safetensors": serialize_state_dict(sd).tobytes()})

    encoded = Encoder(chunk_bytes=chunk_bytes, format_version=version).encode(
        ck(published[target - 1]), ck(published[base - 1]), keyframe=keyframe
    )
    area = b"".join(fr.data for fr in encoded.frames)
    starts = [0]
    for fr in encoded.frames:
        starts.append(starts[-1] + len(fr.data))
    manifest = encoded.with_locations(lambda i, fr: (None, starts[i]))
    if damage is not None:
        at = starts[damage + 1] - 1
        area = area[:at] + bytes([area[at] ^ 0xFF]) + area[at + 1 :]
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


@pytest.mark.parametrize(
    "version, staged", [(1, False), (1, True), (2, False)], ids=["v1-in-place-hash", "v1-staged-hash", "v2-checksum"]
)
def test_local_prepare_and_verified_apply(version: int, staged: bool) -> None:
    from weightsync.client import inplace
    from weightsync.client.verify import IN_PLACE, STAGED_HOST, SUM_CPU, HostHasher

    published = _trained(2)
    prepared = _local_update(published, 1, 2, version=version, device="cpu")
    assert prepared.steps == 1 and prepared.changed_elements > 0
    assert prepared.digest_kind == ("xxh3-128" if version == 1 else "sum64x16")
    tensors = _snapshot(published[0])
    # Tiny staging buffers: the larger tensors stream through them in many pieces.
    hasher = HostHasher(threads=2, buffers=2, buffer_bytes=8 << 10, piece_bytes=3000, stage_cpu=staged)
    applied = inplace.apply(tensors, prepared, model="local", version=1, verify=True, strict=True, hasher=hasher)
    _assert_identical(tensors, published[1])
    # v1 hashes every changed tensor again; v2 moves each base checksum by the changed elements.
    want = {(1, True): (STAGED_HOST,), (1, False): (IN_PLACE,), (2, False): (inplace.CHANGE_SUMS, SUM_CPU)}
    assert applied.verified_by == want[version, staged]
    assert applied.base_check_s > 0 and applied.result_check_s > 0
    assert applied.pause >= applied.result_check_s, "the pause covers the result check"
    assert applied.tensors == len(prepared.updates)
    applied.check()  # a second, full check agrees
    unverified = inplace.apply(_snapshot(published[0]), prepared, model="local", version=1, verify=False, strict=True)
    assert unverified.verified_by == () and unverified.base_check_s == 0


@pytest.mark.parametrize("version", [1, 2])
def test_local_base_mismatch_names_the_tensor_and_writes_nothing(version: int) -> None:
    from weightsync.client import inplace
    from weightsync.client.verify import HostHasher

    published = _trained(2, seed=4)
    prepared = _local_update(published, 1, 2, version=version)
    for staged in (False, True):
        tensors = _snapshot(published[0])
        victim = sorted(prepared.updates)[-1]  # the last one checked: every other tensor passed its check
        _bits(tensors[victim])[0] ^= 1
        before = _snapshot(tensors)
        hasher = HostHasher(buffer_bytes=4096, piece_bytes=1000, stage_cpu=staged)
        with pytest.raises(errors.BaseMismatch, match=repr(victim)):
            inplace.apply(tensors, prepared, model="local", version=1, verify=True, strict=True, hasher=hasher)
        _assert_identical(tensors, before)


@pytest.mark.parametrize("version", [1, 2])
def test_local_result_mismatch_undoes_every_change(version: int) -> None:
    """A failed result check raises ChecksumMismatch naming the tensor, after undoing every element change:
    the tensors hold the base version again, byte for byte."""
    from weightsync.client import inplace

    published = _trained(2, seed=5)
    prepared = _local_update(published, 1, 2, version=version)
    name = sorted(prepared.updates)[-1]  # the last one: every other tensor was written and passed
    prepared.updates[name].result_digest = "0" * len(prepared.updates[name].result_digest)
    tensors = _snapshot(published[0])
    with pytest.raises(errors.ChecksumMismatch, match=rf"{name!r}.*hold v1 again"):
        inplace.apply(tensors, prepared, model="local", version=1, verify=True, strict=True)
    _assert_identical(tensors, published[0])


def test_a_corrupted_change_is_caught_by_the_change_sums_and_undone() -> None:
    """One operand of a decoded change is wrong (as a decoding bug or bad memory would make it): the result,
    checked from the base checksum and the elements read back, fails; everything is undone."""
    from weightsync.client import inplace

    published = _trained(2, seed=8)
    prepared = _local_update(published, 1, 2, version=2, device="cpu")  # decoded changes, not kept frames
    name, u = next((n, u) for n, u in sorted(prepared.updates.items()) if u.ops and len(u.ops[0]) > 1)
    u.ops[0].operands[len(u.ops[0]) // 2] ^= 4  # flips one bit of one element's change
    tensors = _snapshot(published[0])
    with pytest.raises(errors.ChecksumMismatch, match=repr(name)):
        inplace.apply(tensors, prepared, model="local", version=1, verify=True, strict=True)
    _assert_identical(tensors, published[0])


def test_host_tensors_are_patched_from_the_frames_in_one_checked_pass() -> None:
    """Without a staging device a one-step v2 delta keeps its frames; host tensors are patched from them with
    base and result summed in the patching pass. Decoded on demand, the same update takes the general path."""
    from weightsync.client import frames_apply, inplace

    published = _trained(2, seed=11)
    prepared = _local_update(published, 1, 2)
    assert prepared.frames and all(not u.ops for u in prepared.updates.values())
    # Counted from the frames: exact for sparse ones, every element a dense frame covers.
    assert prepared.changed_elements >= _local_update(published, 1, 2, device="cpu").changed_elements > 0
    tensors = _snapshot(published[0])
    applied = inplace.apply(tensors, prepared, model="local", version=1, verify=True, strict=True)
    assert applied.verified_by == (frames_apply.FUSED,) and applied.tensors == len(prepared.updates)
    _assert_identical(tensors, published[1])
    applied.check()
    again = _local_update(published, 1, 2)
    again.decode_frames()
    assert again.frames is None and any(u.ops for u in again.updates.values())
    tensors = _snapshot(published[0])
    assert (
        inplace.CHANGE_SUMS
        in inplace.apply(tensors, again, model="local", version=1, verify=True, strict=True).verified_by
    )
    _assert_identical(tensors, published[1])


@pytest.mark.parametrize("where", ["base", "result"])
def test_the_frames_pass_undoes_everything_when_a_check_fails(where: str) -> None:
    """A base that differs (one bit of the last tensor) or a result digest that does not match: the pass has
    written, so every frame is undone; the tensors are byte for byte what they were, the error names the tensor."""
    from weightsync.client import inplace

    published = _trained(2, seed=12)
    prepared = _local_update(published, 1, 2)
    assert prepared.frames
    victim = sorted(prepared.updates)[-1]
    tensors = _snapshot(published[0])
    if where == "base":
        _bits(tensors[victim])[0] ^= 1
        error: type[Exception] = errors.BaseMismatch
    else:
        prepared.updates[victim].result_digest = "0" * len(prepared.updates[victim].result_digest)
        error = errors.ChecksumMismatch
    before = _snapshot(tensors)
    with pytest.raises(error, match=repr(victim)):
        inplace.apply(tensors, prepared, model="local", version=1, verify=True, strict=True)
    _assert_identical(tensors, before)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_frames_pass_on_any_number_of_threads(threads: int) -> None:
    """The calling thread alone (one thread) or with a pool (the largest frames handed out first): the same bytes,
    and a result that does not check undoes every frame, whichever thread applied it."""
    from weightsync.client import frames_apply

    published = _trained(2, seed=14)
    prepared = _local_update(published, 1, 2)
    assert prepared.frames and len(prepared.frames) > 1
    digests = {n: (u.base_digest, u.result_digest) for n, u in prepared.updates.items()}
    tensors = _snapshot(published[0])
    frames_apply.apply(prepared.frames, tensors, digests, base=1, target=2, verify=True, threads=threads)
    _assert_identical(tensors, published[1])
    victim = sorted(prepared.updates)[0]
    wrong = {**digests, victim: (digests[victim][0], "0" * len(digests[victim][1]))}
    tensors = _snapshot(published[0])
    before = _snapshot(tensors)
    with pytest.raises(errors.ChecksumMismatch, match=repr(victim)):
        frames_apply.apply(prepared.frames, tensors, wrong, base=1, target=2, verify=True, threads=threads)
    _assert_identical(tensors, before)


def test_the_frames_pass_never_writes_past_a_tensors_end() -> None:
    """The pass writes through views made from the tensors' addresses: a tensor shorter than the update's pieces
    (a caller going around `apply`'s shape checks) is refused before any write."""
    from weightsync.client import frames_apply

    published = _trained(2, seed=13)
    prepared = _local_update(published, 1, 2)
    assert prepared.frames
    tensors = _snapshot(published[0])
    name = max(prepared.updates, key=lambda n: tensors[n].nbytes)
    tensors[name] = tensors[name].reshape(-1)[: tensors[name].numel() // 2].clone()
    before = _snapshot(tensors)
    digests = {n: (u.base_digest, u.result_digest) for n, u in prepared.updates.items()}
    with pytest.raises(errors.ReloadRequired, match=repr(name)):
        frames_apply.apply(prepared.frames, tensors, digests, base=1, target=2, verify=True)
    _assert_identical(tensors, before)


def test_result_mismatch_through_the_subscriber(server, model, tmp_path: Path) -> None:
    _publish(server.url, model, 2, seed=6)
    with Subscriber(server.url, model, version=1) as sub:
        tensors = _fresh_load(server.url, model, 1, tmp_path)
        prepared = sub.prepare()
        name = next(iter(prepared.updates))
        good = prepared.updates[name].result_digest
        prepared.updates[name].result_digest = "f" * len(good)
        with pytest.raises(errors.ChecksumMismatch, match=repr(name)):
            sub.apply(tensors, prepared)
        assert sub.version == 1, "a version whose result check fails never becomes the subscriber's"
        _assert_identical(tensors, _fresh_load(server.url, model, 1, tmp_path / "again"))
        prepared.updates[name].result_digest = good
        sub.apply(tensors, prepared)
        assert sub.version == 2
        _assert_identical(tensors, _fresh_load(server.url, model, 2, tmp_path / "v2"))


def test_a_failed_whole_replacement_asks_for_a_reload() -> None:
    """An update that replaces tensors whole (a keyframe step) has nothing to undo them with: the error says
    to load the version afresh."""
    from weightsync.client import inplace

    published = _trained(3, seed=10)
    prepared = _local_update(published, 1, 3, keyframe=True)
    assert all(u.replace is not None for u in prepared.updates.values())
    name = sorted(prepared.updates)[0]
    prepared.updates[name].result_digest = "0" * len(prepared.updates[name].result_digest)
    with pytest.raises(errors.ChecksumMismatch, match="load the version afresh"):
        inplace.apply(_snapshot(published[0]), prepared, model="local", version=1, verify=True, strict=True)


def test_whole_replacements_of_host_tensors_are_copied_in_pieces_without_torch(monkeypatch) -> None:
    """A keyframe step into host tensors lands bit for bit, in place, in pieces spread over the CPU pool, and never
    through torch's copy_ (whose OpenMP worker keeps spinning on a core after the apply returns)."""
    from weightsync.client import inplace

    published = _trained(3, seed=11)
    prepared = _local_update(published, 1, 3, keyframe=True)
    assert all(u.replace is not None for u in prepared.updates.values())
    tensors = _snapshot(published[0])
    addresses = {k: t.data_ptr() for k, t in tensors.items()}
    monkeypatch.setattr(inplace, "_REPLACE_PIECE", 1000)  # the larger tensors go in many pieces, some ragged
    assert max(t.nbytes for t in tensors.values()) > 3 * 1000
    calls = []
    real = torch.Tensor.copy_

    def watched(self, *args, **kw):
        calls.append(self.device.type)
        return real(self, *args, **kw)

    monkeypatch.setattr(torch.Tensor, "copy_", watched)
    applied = inplace.apply(tensors, prepared, model="local", version=1, verify=True, strict=True)
    assert calls == []
    _assert_identical(tensors, published[2])
    assert {k: t.data_ptr() for k, t in tensors.items()} == addresses
    applied.check()


def test_copy_pieces_copies_every_pair_exactly() -> None:
    from concurrent.futures import ThreadPoolExecutor

    from weightsync.client.tensors import copy_pieces

    rng = np.random.default_rng(5)
    sizes = [0, 1, 999, 1000, 1001, 5000, 12345]
    srcs = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    for pool in (None, ThreadPoolExecutor(2)):
        dsts = [np.zeros(n, dtype=np.uint8) for n in sizes]
        copy_pieces(list(zip(dsts, srcs, strict=True)), pool, piece=1000)
        for d, s in zip(dsts, srcs, strict=True):
            assert d.tobytes() == s.tobytes()
        copy_pieces([], pool)
        with pytest.raises(ValueError):
            copy_pieces([(np.zeros(10, dtype=np.uint8), srcs[4])], pool, piece=1000)  # lengths differ
        with pytest.raises(ValueError):
            copy_pieces([(np.zeros(5001, dtype=np.uint8), srcs[4])], pool, piece=1000)


def test_staged_changes_are_compact_and_apply_exactly() -> None:
    """Staging (client/tensors.py): block-coded positions where that is smaller; the same bytes as the host apply."""
    from weightsync.client.tensors import BLOCK_BITS, apply_staged, stage_change
    from weightsync.codec.values import Change

    rng = np.random.default_rng(0)
    n = 3 * (1 << BLOCK_BITS) + 777
    for density, add in [(0.0275, True), (0.001, False), (1e-5, True), (0.9, True), (0.0, True)]:
        positions = np.flatnonzero(rng.random(n) < density).astype(np.int64)
        operands = rng.integers(-(2**15), 2**15, len(positions)).astype(np.int16)
        operands[operands == 0] = 1
        change = Change(add, positions, operands)
        base = rng.integers(-(2**15), 2**15, n).astype(np.int16)
        want = base.copy()
        change.apply(want)
        staged = stage_change(change, "cpu", elements=n)
        t = torch.from_numpy(base.copy()).view(torch.bfloat16)
        apply_staged(t, staged)
        assert np.array_equal(t.view(torch.int16).numpy(), want), (density, add)
        if len(positions) > 4 * (n >> BLOCK_BITS):  # several changes per block: block-coded, ~4 bytes each
            assert staged.positions is None and staged.nbytes <= 5 * len(positions), density
        else:
            assert staged.nbytes <= 6 * len(positions)  # int32 positions


def test_changes_staged_together_share_one_buffer_and_each_applies_exactly() -> None:
    """stage_changes: block-coded, int32-coded and empty changes (bf16, int8 and fp32 tensors) moved in one
    copy; each is a view of that copy and applies exactly as its host change does."""
    from weightsync.client.tensors import BLOCK_BITS, apply_staged, stage_changes
    from weightsync.codec.values import Change

    rng = np.random.default_rng(1)
    cases = []
    for n, density, dtype in [
        (5 * (1 << BLOCK_BITS) + 3, 0.03, np.int16),  # block-coded
        (8 << BLOCK_BITS, 2e-5, np.int8),  # int32 positions: about one change per block
        (1000, 0.0, np.int16),  # empty
        (2 * (1 << BLOCK_BITS) + 9, 0.2, np.int32),  # block-coded, 4-byte operands
    ]:
        positions = np.flatnonzero(rng.random(n) < density).astype(np.int64)
        info = np.iinfo(dtype)
        operands = rng.integers(info.min, info.max, len(positions), dtype=dtype)
        operands[operands == 0] = 1
        cases.append((Change(bool(n % 2), positions, operands), n, rng.integers(info.min, info.max, n, dtype=dtype)))
    staged = stage_changes([(c, n) for c, n, _ in cases], "cpu")
    assert [s.positions is None for s in staged] == [True, False, False, True]
    storages = {
        p.untyped_storage().data_ptr()
        for s in staged
        for p in (s.operands, s.low, s.positions)
        if p is not None and p.numel()
    }
    assert len(storages) == 1  # one buffer
    for (change, n, base), s in zip(cases, staged, strict=True):
        want = base.copy()
        change.apply(want)
        t = torch.from_numpy(base.copy())
        apply_staged(t, s)
        assert np.array_equal(t.numpy(), want), n


def test_prepare_stages_few_bytes_per_changed_element() -> None:
    published = _trained(3, seed=7)
    prepared = _local_update(published, 1, 3, device="cpu")
    k = prepared.changed_elements
    assert k > 0 and prepared.staged_bytes > 0
    widths = {u.dtype.width for u in prepared.updates.values() if u.ops}
    assert prepared.staged_bytes <= (4 + max(widths)) * k  # never the 8-byte positions of before


def test_a_plan_across_formats_applies_and_verifies_each_step_with_its_own_kind() -> None:
    """v1 delta, then a v2 keyframe (a new format starts a chain with one), then a v2 delta. A plan from v1
    replaces every tensor from the keyframe on and checks the results with the checksum; the v1 step alone
    checks base and result with xxh3-128."""
    from weightsync.client import inplace
    from weightsync.client.tensors import serialize_state_dict
    from weightsync.codec.checkpoint import Checkpoint
    from weightsync.codec.encoder import Encoder

    published = _trained(4, seed=9)

    def ck(sd: dict) -> Checkpoint:
        return Checkpoint.from_bytes({"model.safetensors": serialize_state_dict(sd).tobytes()})

    steps = [(1, 0, False), (2, 1, True), (2, 2, False)]  # (format, base index, keyframe) of versions 2..4
    area = bytearray()
    manifests = []
    for target, (version, base, keyframe) in enumerate(steps, start=1):
        encoded = Encoder(chunk_bytes=16 << 10, format_version=version).encode(
            ck(published[target]), ck(published[base]), keyframe=keyframe
        )
        starts = []
        for fr in encoded.frames:
            starts.append(len(area))
            area.extend(fr.data)
        manifests.append(encoded.with_locations(lambda i, fr, s=starts: (None, s[i])))
    assert [m.digest_kind for m in manifests] == ["xxh3-128", "sum64x16", "sum64x16"]

    def read(ref):
        return memoryview(area)[ref.offset : ref.offset + ref.length]

    whole = inplace.prepare(manifests, read, model="m", base=1, target=4)
    assert whole.digest_kind == "sum64x16" and all(u.replace is not None for u in whole.updates.values())
    tensors = _snapshot(published[0])
    inplace.apply(tensors, whole, model="m", version=1, verify=True, strict=True).check()
    _assert_identical(tensors, published[3])
    first = inplace.prepare(manifests[:1], read, model="m", base=1, target=2)
    assert first.digest_kind == "xxh3-128" and {u.base_kind for u in first.updates.values()} == {"xxh3-128"}
    tensors = _snapshot(published[0])
    applied = inplace.apply(tensors, first, model="m", version=1, verify=True, strict=True)
    applied.check()
    assert applied.verified_by == ("cpu",)
    _assert_identical(tensors, published[1])


class _Watching(dict):
    """Tensors whose lookups record whether Python's cyclic collector was on (apply looks every tensor up)."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.gc_states: set[bool] = set()

    def get(self, key, default=None):
        import gc

        self.gc_states.add(gc.isenabled())
        return super().get(key, default)


def test_prepare_and_apply_hold_the_collector_off_and_give_it_back(server, model, tmp_path: Path) -> None:
    import gc

    published = _publish(server.url, model, 2)
    seen: list[bool] = []
    with Subscriber(server.url, model, name="gc", progress=lambda *_: seen.append(gc.isenabled())) as sub:
        sub.pull(tmp_path / "boot", version=1)
        live = _Watching({k: v.clone() for k, v in st.load_file(str(tmp_path / "boot" / "model.safetensors")).items()})
        seen.clear()  # the pull's (a pull does not hold it off)
        prepared = sub.prepare(2)
        assert gc.isenabled()
        sub.apply(live, prepared)
        assert gc.isenabled()
    assert live.gc_states == {False}  # every lookup of the apply ran with the collector off
    assert seen and not any(seen)  # so did prepare's download
    _assert_identical(dict(live), published[1])


_TRITON_APPLY = """
import itertools, sys, torch
from weightsync import devsum_triton
from weightsync.client import tensors
devsum_triton.available = lambda: True  # the interpreter runs the kernel on CPU tensors
kinds = [k for k in itertools.product((1, 2, 4, 8), (True, False), (True, False), (False, True), (True, False))
         if k[2] or not k[3]]  # (width, block-coded, add, inverse, track): inverse only undoes an add
bad = [k for k in kinds if not tensors._check_triton_apply(torch.device("cpu"), *k)]
print("agree" if not bad else f"disagree {bad}")
"""


def test_the_triton_apply_kernel_does_what_the_torch_path_does() -> None:
    """client/staged_triton.py against the torch path (the reference): same bytes and checksum moves for every
    element width, coding (block-coded, int32 positions), operation (add, its inverse, xor), with and without
    tracking; through Triton's interpreter on the CPU, as tensors.py checks it on a GPU before using it."""
    import importlib.util
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("triton") is None:  # not imported here: it would grow every later test's process
        pytest.skip("needs triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", _TRITON_APPLY], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip() == "agree", (out.stdout, out.stderr[-2000:])


def test_a_triton_apply_that_disagrees_or_cannot_run_leaves_the_torch_path(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from weightsync import devsum_triton
    from weightsync.client import staged_triton, tensors

    cpu = torch.device("cpu")
    monkeypatch.setattr(devsum_triton, "available", lambda: True)

    def same(view: torch.Tensor, staged: object, *, track: bool, inverse: bool, block_bits: int, lanes: int):
        return tensors._apply_staged_torch(view, staged, track=track, inverse=inverse)

    monkeypatch.setattr(staged_triton, "apply", same)
    assert tensors._check_triton_apply(cpu, 2, True, True, False, True) is True

    def off_by_one(view: torch.Tensor, staged: object, *, track: bool, inverse: bool, block_bits: int, lanes: int):
        moved = tensors._apply_staged_torch(view, staged, track=track, inverse=inverse)
        view.view(-1)[0] += 1
        return moved

    monkeypatch.setattr(staged_triton, "apply", off_by_one)
    with caplog.at_level("WARNING", logger="weightsync.client.tensors"):
        assert tensors._check_triton_apply(cpu, 2, False, False, False, False) is False
    assert "disagrees" in caplog.text

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no GPU here")

    monkeypatch.setattr(staged_triton, "apply", broken)
    assert tensors._check_triton_apply(cpu, 4, True, True, True, True) is False
    monkeypatch.setattr(devsum_triton, "available", lambda: False)
    assert tensors._check_triton_apply(cpu, 2, True, True, False, True) is False
    tensors.warm_device_kernels("cpu", {(2, True, True)}, widths={2})  # nothing to compile off a GPU
    assert devsum_triton.device_key("cpu") == "cpu"


def test_a_delta_of_many_frames_decodes_in_batches_to_the_same_tensors() -> None:
    """Hundreds of frames are decoded several to a pool job (inplace._frames_per_job); the tensors end
    bit-identical, and a damaged frame inside a batch still fails the prepare with a named error."""
    from weightsync.client import inplace

    published = _trained(2)
    prepared = _local_update(published, 1, 2, device="cpu", chunk_bytes=1024)
    frames = len(prepared.manifests[0].frames)
    assert inplace._frames_per_job(frames) > 1, f"{frames} frames: one per job, the batching is not exercised"
    tensors = _snapshot(published[0])
    inplace.apply(tensors, prepared, model="local", version=1, verify=True, strict=True)
    _assert_identical(tensors, published[1])
    with pytest.raises(errors.FormatError):
        _local_update(published, 1, 2, device="cpu", chunk_bytes=1024, damage=frames // 2)
