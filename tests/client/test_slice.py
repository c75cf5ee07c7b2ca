"""Slice subscribers: an inference rank that holds some experts fetches, checks and applies only their frames."""

from __future__ import annotations

import fnmatch
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from _client_util import publish_steps, tensor_bits  # noqa: E402

from weightsync import errors  # noqa: E402
from weightsync.client import Publisher, Subscriber  # noqa: E402
from weightsync.client.selection import selector  # noqa: E402

SMALL = {"chunk_bytes": 16 << 10, "object_bytes": 64 << 10}
EXPERTS = 8


class TinyMoE:
    """Eight bf16 experts and shared tensors, trained with AdamW (an RL-like small lr: a few % change per step)."""

    def __init__(self, seed: int = 0, width: int = 64) -> None:
        from torch import nn

        torch.manual_seed(seed)
        self.embed = nn.Linear(width, width)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 2 * width), nn.Linear(2 * width, width)) for _ in range(EXPERTS)
        )
        self.params = [*self.embed.parameters(), *self.experts.parameters()]
        self.opt = torch.optim.AdamW(self.params, lr=3e-6)
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(64, width, generator=g)
        self.y = torch.randn(64, width, generator=g)

    def step(self) -> None:
        h = self.embed(self.x)
        loss = sum(((e(h) - self.y) ** 2).mean() for e in self.experts)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()

    def export(self) -> dict:
        out = {
            "embed.weight": self.embed.weight.detach().to(torch.bfloat16),
            "embed.bias": self.embed.bias.detach().clone(),
        }
        for i, e in enumerate(self.experts):
            out[f"layers.0.experts.{i}.up.weight"] = e[0].weight.detach().to(torch.bfloat16)
            out[f"layers.0.experts.{i}.down.weight"] = e[1].weight.detach().to(torch.bfloat16)
        return out


def _publish(url: str, model: str, n: int) -> list[dict]:
    return publish_steps(url, model, TinyMoE(), n, **SMALL)


def _frames_for(prepared, patterns: list[str]) -> int:
    """Bytes of the frames that hold a piece of a selected tensor, read from the manifests by hand."""
    total = 0
    for m in prepared.manifests:
        for ref in m.frames:
            names = {m.files[p.file].segments[p.seg].segment.name for p in ref.pieces}
            if any(fnmatch.fnmatchcase(n, pat) for n in names for pat in patterns):
                total += ref.length
    return total


def test_a_slice_subscriber_fetches_and_applies_only_its_experts(server, model) -> None:
    published = _publish(server.url, model, 4)
    mine = ["embed.*", "layers.0.experts.2.*", "layers.0.experts.3.*"]  # 2 of 8 experts + the shared tensors
    chosen = selector(mine)
    assert chosen is not None
    held = {k: v.clone() for k, v in published[0].items() if chosen(k)}
    assert 0 < len(held) < len(published[0])
    pointers = {k: v.data_ptr() for k, v in held.items()}
    with (
        Subscriber(server.url, model, name="rank-1", version=1, tensors=mine) as sub,
        Subscriber(server.url, model, name="whole", version=1) as whole,
    ):
        for v in (2, 3, 4):
            everything = whole.prepare(v)
            prepared = sub.prepare(v)
            assert set(prepared.specs) == set(held) and set(prepared.updates) <= set(held)
            # Only the frames of the selection (+ the manifest): well under what the whole update moves.
            manifest_bytes = sum(len(m.encode()) for m in prepared.manifests)
            assert prepared.bytes_received <= 1.1 * (_frames_for(prepared, mine) + manifest_bytes)
            assert prepared.bytes_received < 0.6 * everything.bytes_received
            sub.apply(held, prepared)  # strict: every tensor of the slice, and no other, is needed
            whole.version = v
            assert sub.version == v
            for name, t in held.items():
                assert torch.equal(tensor_bits(t), tensor_bits(published[v - 1][name])), f"v{v}: {name} differs"
    assert {k: v.data_ptr() for k, v in held.items()} == pointers, "updated in place"


def test_a_predicate_and_a_per_call_selection(server, model) -> None:
    published = _publish(server.url, model, 2)
    odd = {
        k: v.clone() for k, v in published[0].items() if k.startswith("layers.0.experts.") and int(k.split(".")[3]) % 2
    }
    with Subscriber(server.url, model, name="odd", version=1) as sub:
        prepared = sub.prepare(2, tensors=lambda n: n in odd)
        assert set(prepared.specs) == set(odd)
        sub.apply(odd, prepared)
    for name, t in odd.items():
        assert torch.equal(tensor_bits(t), tensor_bits(published[1][name]))
    # Holding less than the selection is refused before any change, as for a whole version.
    with Subscriber(server.url, model, name="short", version=1, tensors=["layers.0.experts.1.*"]) as sub:
        short = {"layers.0.experts.1.up.weight": published[0]["layers.0.experts.1.up.weight"].clone()}
        with pytest.raises(errors.ReloadRequired, match="down.weight"):
            sub.apply(short, sub.prepare(2))


def test_an_update_read_from_ranges_is_verified_even_when_told_not_to(server, model) -> None:
    """Ranges cannot be hashed against their objects' names: the result checks are all that catch a damaged one,
    so `verify=False` does not skip them there (it does for an update of whole objects, hashed on arrival)."""
    from weightsync.client import inplace

    published = _publish(server.url, model, 2)
    mine = ["layers.0.experts.4.*"]
    with Subscriber(server.url, model, name="rank-4", version=1, tensors=mine) as sub:
        held = {k: v.clone() for k, v in published[0].items() if fnmatch.fnmatchcase(k, mine[0])}
        prepared = sub.prepare(2)
        assert prepared.partial_objects
        applied = inplace.apply(held, prepared, model=model, version=1, verify=False, strict=True)
        assert applied.verified_by, "checked, though told not to"
    with Subscriber(server.url, model, name="whole", version=1) as whole:
        everything = {k: v.clone() for k, v in published[0].items()}
        prepared = whole.prepare(2)
        assert not prepared.partial_objects
        applied = inplace.apply(everything, prepared, model=model, version=1, verify=False, strict=True)
        assert applied.verified_by == ()
    for name, t in held.items():
        assert torch.equal(tensor_bits(t), tensor_bits(published[1][name]))


@pytest.mark.parametrize("verify", [True, False])
def test_a_damaged_range_is_caught_undone_and_fetched_again(server, model, tmp_path: Path, verify: bool) -> None:
    published = _publish(server.url, model, 2)
    mine = ["layers.0.experts.5.*"]
    held = {k: v.clone() for k, v in published[0].items() if fnmatch.fnmatchcase(k, mine[0])}
    before = {k: v.clone() for k, v in held.items()}
    cache = tmp_path / "cache"
    with Subscriber(server.url, model, name="rank-5", version=1, tensors=mine, cache_dir=cache) as sub:
        prepared = sub.prepare(2)
        assert prepared.partial_objects, "read from byte ranges, not whole objects"
        parts = sorted(p for p in (cache / "objects").glob("*.parts/*") if p.stat().st_size > 0)
        assert parts
        for p in parts:  # flip bits in every range held (the prepared frames read them through a map)
            data = bytearray(p.read_bytes())
            data[len(data) // 2] ^= 0xFF
            p.write_bytes(bytes(data))
        with pytest.raises(errors.CorruptData):  # a frame header's or a result's check
            sub.apply(held, prepared, verify=verify)
        assert sub.version == 1
        for name, t in held.items():
            assert torch.equal(tensor_bits(t), tensor_bits(before[name])), (
                "a failed check leaves the tensors as they were"
            )
        sub.apply(held, sub.prepare(2))  # the damaged ranges were dropped: fetched again, and right
        assert sub.version == 2
    for name, t in held.items():
        assert torch.equal(tensor_bits(t), tensor_bits(published[1][name]))


@pytest.mark.parametrize("bad", [[], [""], [3]])
def test_a_malformed_selection_is_a_named_error(bad) -> None:
    with pytest.raises(errors.InvalidArgument):
        selector(bad)


def _shards(sd: dict, where: Path) -> Path:
    """`sd` as a sharded checkpoint: shared tensors, two files of four experts each, and a config."""
    st = pytest.importorskip("safetensors.torch")
    where.mkdir(parents=True)
    groups = {
        "model-shared.safetensors": lambda k: k.startswith("embed."),
        "model-experts-a.safetensors": lambda k: ".experts." in k and int(k.split(".")[3]) < 4,
        "model-experts-b.safetensors": lambda k: ".experts." in k and int(k.split(".")[3]) >= 4,
    }
    for name, take in groups.items():
        st.save_file({k: v.contiguous() for k, v in sd.items() if take(k)}, str(where / name))
    (where / "config.json").write_text('{"experts": 8}')
    return where


def test_pull_include_keeps_a_file_slice_byte_identical_and_follows_it(server, model, tmp_path: Path) -> None:
    trainer, sources = TinyMoE(), []
    with Publisher(server.url, model, **SMALL) as pub:
        for i in range(1, 4):
            trainer.step()
            sources.append(_shards(trainer.export(), tmp_path / f"src-v{i}"))
            pub.publish(sources[-1], step=i)
    mine = ["model-experts-b.*", "*.json"]
    out = tmp_path / "rank"
    with Subscriber(server.url, model, name="rank-b") as sub:
        first = sub.pull(out, 1, include=mine)
        assert sorted(p.name for p in out.iterdir() if p.name != ".weightsync") == [
            "config.json",
            "model-experts-b.safetensors",
        ]
        whole = sub.pull(tmp_path / "whole", 1)
        assert first.files == 2 and first.bytes_received < 0.7 * whole.bytes_received
        for v in (2, 3):  # later pulls keep the slice (the checkout remembers it) and go by deltas
            got = sub.pull(out, v)
            assert got.mode == "delta" and got.files == 2
            for name in ("config.json", "model-experts-b.safetensors"):
                assert (out / name).read_bytes() == (sources[v - 1] / name).read_bytes(), f"v{v}: {name}"
            assert not (out / "model-experts-a.safetensors").exists()
        state = (out / ".weightsync" / "state.json").read_text()
        assert '"include":["model-experts-b.*","*.json"]' in state and '"version":3' in state
        # A wider selection at the same version keeps what is held (same inode) and fetches only the new file.
        inode = (out / "model-experts-b.safetensors").stat().st_ino
        wider = sub.pull(out, 3, include=[*mine, "model-shared.*"])
        assert (out / "model-experts-b.safetensors").stat().st_ino == inode
        assert (out / "model-shared.safetensors").read_bytes() == (sources[2] / "model-shared.safetensors").read_bytes()
        assert wider.files == 3 and wider.bytes_received < 0.7 * whole.bytes_received
        # A narrower one drops the file it no longer takes.
        sub.pull(out, 3, include=["*.json"])
        assert sorted(p.name for p in out.iterdir() if p.name != ".weightsync") == ["config.json"]
        # No include on an ordinary checkout: every file, as always.
        full = sub.pull(tmp_path / "whole", 3)
        assert full.files == 4
        with pytest.raises(errors.InvalidArgument):
            sub.pull(tmp_path / "bad", 3, include=[])


def test_the_pull_command_takes_include_globs_and_remembers_them(server, model, tmp_path: Path) -> None:
    import json

    import typer
    from typer.testing import CliRunner

    from weightsync.client.cli import register

    trainer, sources = TinyMoE(), []
    with Publisher(server.url, model, **SMALL) as pub:
        for i in range(1, 3):
            trainer.step()
            sources.append(_shards(trainer.export(), tmp_path / f"src-v{i}"))
            pub.publish(sources[-1], step=i)
    app = typer.Typer()
    register(app)
    runner, env, out = CliRunner(), {"WEIGHTSYNC_SERVER": server.url}, tmp_path / "rank"
    first = runner.invoke(
        app,
        ["pull", model, str(out), "--version", "1", "--include", "model-experts-a.*", "--include", "*.json"],
        env=env,
    )
    assert first.exit_code == 0, first.stderr
    assert "(2 files of the version)" in first.stdout
    later = runner.invoke(app, ["pull", model, str(out), "--json"], env=env)  # no --include: the checkout's own
    assert later.exit_code == 0, later.stderr
    got = json.loads(later.stdout)
    assert got["version"] == 2 and got["mode"] == "delta" and got["files"] == 2
    assert sorted(p.name for p in out.iterdir() if p.name != ".weightsync") == [
        "config.json",
        "model-experts-a.safetensors",
    ]
    for name in ("config.json", "model-experts-a.safetensors"):
        assert (out / name).read_bytes() == (sources[1] / name).read_bytes()
