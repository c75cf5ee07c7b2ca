"""Atomic checkouts (client/checkout.py, docs/DESIGN.md "Checkouts"): layout, sharing, old readers, file-set
changes, adoption of plain-file checkouts, crash leftovers, refusals."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from _client_util import tree_bytes

from weightsync import errors
from weightsync.client import Publisher, Subscriber
from weightsync.client.checkout import Checkout
from weightsync.codec import Checkpoint


def _shard(seed: int, n: int = 3000) -> bytes:
    from _ckpt import safetensors_file
    from _versions import model_files, next_step

    files = model_files(0, n=2)
    for i in range(seed):
        files = next_step(files, 10 + i)
    return safetensors_file(files, {"step": str(seed)})


VERSIONS = [  # what a training run might do: same shards, then a file added, a rename, files dropped
    {"model.safetensors": _shard(0), "config.json": b'{"h": 1}', "tok/vocab.json": b'{"a": 1}'},
    {
        "model.safetensors": _shard(1),
        "config.json": b'{"h": 1}',
        "tok/vocab.json": b'{"a": 1}',
        "tok/extra/merges.txt": b"a b\n" * 50,
    },
    {"shards/model.safetensors": _shard(2), "generation.json": b"{}", "tok/extra/merges.txt": b"a b\n" * 50},
]


def _publish(url: str, model: str, versions: list[dict[str, bytes]]) -> None:
    with Publisher(url, model) as pub:
        for files in versions:
            pub.publish(Checkpoint.from_bytes(files), allow_removals=True)  # the file set changes on purpose


def _links_ok(dest: Path, files: dict[str, bytes]) -> None:
    """Every model path is a relative link through .weightsync/current; nothing dangles."""
    for path in files:
        p = dest / path
        assert p.is_symlink() and os.readlink(p).endswith(f".weightsync/current/data/{path}"), path
        assert not os.path.isabs(os.readlink(p))
    assert [p for p in dest.rglob("*") if p.is_symlink() and not p.exists()] == []


def test_layout_sharing_and_removal_of_the_previous_version(server, model, tmp_path: Path) -> None:
    _publish(server.url, model, VERSIONS)
    dest = tmp_path / "dest"
    meta = dest / ".weightsync"
    with Subscriber(server.url, model, report=False) as sub:
        sub.pull(dest, 1)
        assert tree_bytes(dest) == VERSIONS[0]
        _links_ok(dest, VERSIONS[0])
        v1 = meta / os.readlink(meta / "current")
        assert os.readlink(meta / "state.json") == "current/state.json"
        r = sub.pull(dest, 2)
        assert r.mode == "delta" and tree_bytes(dest) == VERSIONS[1]
        _links_ok(dest, VERSIONS[1])
        v2 = meta / os.readlink(meta / "current")
        assert sorted(p.name for p in (meta / "versions").iterdir()) == sorted([v1.name, v2.name])
        # Unchanged files are one inode shared by both versions; changed ones are not.
        assert os.path.samefile(v1 / "data/config.json", v2 / "data/config.json")
        assert not os.path.samefile(v1 / "data/model.safetensors", v2 / "data/model.safetensors")
        sub.pull(dest, 3)
        assert tree_bytes(dest) == VERSIONS[2]
        _links_ok(dest, VERSIONS[2])
        assert not v1.exists(), "the version before the previous one is removed by the next pull"
        assert v2.exists(), "the previous version stays until the next pull"
        # Paths v3 dropped are gone, and so is the directory that only they used... but not tok/.
        assert not (dest / "model.safetensors").exists() and not (dest / "tok/vocab.json").exists()
        assert (dest / "tok/extra").is_dir()
        assert sub.pull(dest, 3).mode == "current"
        assert not v2.exists()


def test_a_reader_of_the_old_files_keeps_reading_old_bytes(server, model, tmp_path: Path) -> None:
    _publish(server.url, model, VERSIONS[:2] + [{**VERSIONS[1], "model.safetensors": _shard(5)}])
    dest = tmp_path / "dest"
    with Subscriber(server.url, model, report=False) as sub:
        sub.pull(dest, 1)
        with open(dest / "model.safetensors", "rb") as old, open(dest / "config.json", "rb") as cfg:
            sub.pull(dest, 2)
            sub.pull(dest, 3)  # the version the handles point into is deleted now
            assert old.read() == VERSIONS[0]["model.safetensors"]
            assert cfg.read() == VERSIONS[0]["config.json"]
        assert (dest / "model.safetensors").read_bytes() == _shard(5)


def test_files_around_the_model_are_left_alone(server, model, tmp_path: Path) -> None:
    _publish(server.url, model, VERSIONS)
    dest = tmp_path / "dest"
    (dest / "tok").mkdir(parents=True)
    (dest / "notes.txt").write_bytes(b"mine")
    (dest / "tok" / "local.json").write_bytes(b"mine too")
    with Subscriber(server.url, model, report=False) as sub:
        for v in (1, 2, 3):
            sub.pull(dest, v)
            got = tree_bytes(dest)
            assert got.pop("notes.txt") == b"mine" and got.pop("tok/local.json") == b"mine too"
            assert got == VERSIONS[v - 1]


def _to_plain_files(dest: Path) -> None:
    """Rewrite a checkout as weightsync before atomic checkouts left it: plain files, a plain state file."""
    meta = dest / ".weightsync"
    for p in list(dest.rglob("*")):
        if p.is_symlink() and ".weightsync" not in p.relative_to(dest).parts:
            data = p.read_bytes()
            p.unlink()
            p.write_bytes(data)
    state = (meta / "state.json").read_bytes()
    (meta / "state.json").unlink()
    (meta / "state.json").write_bytes(state)
    (meta / "current").unlink()
    shutil.rmtree(meta / "versions")


def test_a_checkout_of_plain_files_is_adopted_and_pulled_incrementally(server, model, tmp_path: Path) -> None:
    _publish(server.url, model, VERSIONS[:2])
    dest = tmp_path / "dest"
    with Subscriber(server.url, model, report=False) as sub:
        sub.pull(dest, 1)
        _to_plain_files(dest)
        assert not any(p.is_symlink() for p in dest.rglob("*")) and tree_bytes(dest) == VERSIONS[0]
        r = sub.pull(dest, 2)
        assert r.mode == "delta" and not r.repaired
        assert tree_bytes(dest) == VERSIONS[1]
        _links_ok(dest, VERSIONS[1])


def test_a_half_made_next_version_is_cleared(server, model, tmp_path: Path) -> None:
    """What a pull killed before its switch leaves: a version directory, links that dangle, temporaries."""
    _publish(server.url, model, VERSIONS[:2])
    dest = tmp_path / "dest"
    meta = dest / ".weightsync"
    with Subscriber(server.url, model, report=False) as sub:
        sub.pull(dest, 1)
        (meta / "versions" / "v2-deadbeef" / "data").mkdir(parents=True)
        (meta / "versions" / "v2-deadbeef" / "data" / "model.safetensors").write_bytes(b"half")
        (dest / "new").mkdir()
        os.symlink("../.weightsync/current/data/new/file.bin", dest / "new" / "file.bin")
        os.symlink("versions/v2-deadbeef", meta / ".link.0badf00d.tmp")
        (meta / "tmp").mkdir()
        (meta / "tmp" / ("0" * 32)).write_bytes(b"partial")
        assert tree_bytes(dest) == VERSIONS[0], "a reader sees v1 whole"
        r = sub.pull(dest, 1)
        assert r.mode == "current" and not r.repaired
        assert [p.name for p in (meta / "versions").iterdir()] == [os.readlink(meta / "current").split("/")[1]]
        assert not (dest / "new").exists() and not (meta / ".link.0badf00d.tmp").exists()
        assert not (meta / "tmp").exists()
        assert tree_bytes(dest) == VERSIONS[0]


def test_a_changed_checkout_is_repaired(server, model, tmp_path: Path) -> None:
    _publish(server.url, model, VERSIONS[:2])
    dest = tmp_path / "dest"
    with Subscriber(server.url, model, report=False) as sub:
        sub.pull(dest, 1)
        with open(dest / "model.safetensors", "r+b") as f:  # through the link: into the version's file
            f.seek(-1, os.SEEK_END)
            f.write(b"\xff" if VERSIONS[0]["model.safetensors"][-1:] != b"\xff" else b"\x00")
        r = sub.pull(dest, 2)
        assert r.repaired and r.mode == "full"
        assert tree_bytes(dest) == VERSIONS[1]
        _links_ok(dest, VERSIONS[1])
        (dest / "config.json").unlink()
        (dest / "config.json").write_bytes(b'{"h": 2}')  # a plain file with other bytes
        r = sub.pull(dest, 2)
        assert r.repaired and tree_bytes(dest) == VERSIONS[1]
        _links_ok(dest, VERSIONS[1])


def test_a_directory_where_a_file_goes_is_refused_and_nothing_changes(server, model, tmp_path: Path) -> None:
    _publish(server.url, model, VERSIONS[:3])
    dest = tmp_path / "dest"
    with Subscriber(server.url, model, report=False) as sub:
        sub.pull(dest, 2)
        (dest / "generation.json").mkdir()
        (dest / "generation.json" / "mine").write_bytes(b"x")
        with pytest.raises(errors.Conflict):
            sub.pull(dest, 3)
        got = tree_bytes(dest)
        assert got.pop("generation.json/mine") == b"x" and got == VERSIONS[1]
        assert Checkout(dest).state().number == 2


def test_another_writer_is_a_conflict(tmp_path: Path) -> None:
    co = Checkout(tmp_path / "dest")
    with co.locked(), pytest.raises(errors.Conflict), Checkout(tmp_path / "dest").locked():
        pass


def test_state_files_of_both_formats_read_and_verify(tmp_path: Path) -> None:
    """A checkout state records digests of its manifest's kind; a state written before FORMAT v2 still reads."""
    import json
    from concurrent.futures import ThreadPoolExecutor

    from weightsync.client.state import CheckoutState
    from weightsync.codec import Encoder

    ck = Checkpoint.from_bytes(VERSIONS[0])
    with ThreadPoolExecutor(2) as pool:
        for version, kind in [(1, "xxh3-128"), (2, "sum64x16")]:
            manifest = Encoder(format_version=version).encode(ck).manifest
            state = CheckoutState.of("m", 1, "d" * 64, manifest)
            assert state.digest_kind == kind
            again = CheckoutState.read(_write(tmp_path / f"s{version}.json", state.to_json()))
            assert again == state
            root = tmp_path / f"plain{version}"
            for path, data in VERSIONS[0].items():
                _write(root / path, data)
            checkout = Checkout(root)
            assert checkout.verify(state, pool)
            (root / "model.safetensors").write_bytes(b"\0" + VERSIONS[0]["model.safetensors"][1:])
            assert not checkout.verify(state, pool), "a changed byte fails the deep check"
            assert checkout.verify(state, pool, deep=False)
        old = json.loads(state.to_json())  # version 1 state files: xxh3, no widths
        v1 = CheckoutState.of("m", 1, "d" * 64, Encoder(format_version=1).encode(ck).manifest)
        rows = [{"path": f.path, "size": f.size, "segments": [s[:3] for s in f.segments]} for f in v1.files]
        old.update(version=1, files=rows)
        del old["digest_kind"]
        read = CheckoutState.read(_write(tmp_path / "old.json", json.dumps(old).encode()))
        assert read is not None and read.digest_kind == "xxh3-128"
        assert [[s[:3] for s in f.segments] for f in read.files] == [[s[:3] for s in f.segments] for f in v1.files]
        old["version"] = 2
        assert CheckoutState.read(_write(tmp_path / "bad.json", json.dumps(old).encode())) is None  # v2 needs a kind


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_matching_names_the_files_that_are_the_version(tmp_path: Path) -> None:
    """`Checkout.matching` is `verify` file by file (both formats): a changed byte, another size, a missing file,
    a symlink and a directory where a file goes are not the version; files of ours and plain ones are."""
    from concurrent.futures import ThreadPoolExecutor

    from weightsync.client.state import CheckoutState
    from weightsync.codec import Encoder

    files = {**VERSIONS[1], "extra.bin": b"x" * 100, "gone.bin": b"y" * 10, "dir.bin": b"z"}
    ck = Checkpoint.from_bytes(files)
    with ThreadPoolExecutor(2) as pool:
        for version in (1, 2):
            state = CheckoutState.of("m", 1, "d" * 64, Encoder(format_version=version).encode(ck).manifest)
            root = tmp_path / f"v{version}"
            for path, data in files.items():
                _write(root / path, data)
            checkout = Checkout(root)
            assert set(checkout.matching(state, pool)) == set(files) and checkout.verify(state, pool)
            shard = VERSIONS[1]["model.safetensors"]
            (root / "model.safetensors").write_bytes(shard[:-1] + bytes([shard[-1] ^ 1]))
            (root / "extra.bin").write_bytes(b"x" * 99)
            (root / "gone.bin").unlink()
            (root / "config.json").rename(root / "elsewhere.json")
            os.symlink("elsewhere.json", root / "config.json")
            (root / "dir.bin").unlink()
            (root / "dir.bin").mkdir()
            found = checkout.matching(state, pool)
            assert found == {p: root / p for p in ("tok/vocab.json", "tok/extra/merges.txt")}
            assert not checkout.verify(state, pool)
