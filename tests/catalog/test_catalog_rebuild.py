"""Disaster recovery: a catalog rebuilt from manifest records equals the original."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from _catalog_util import T0, digest, publish

from weightsync import errors
from weightsync.catalog import Catalog, ImportedVersion


def _build(cat: Catalog) -> None:
    cat.create_model("policy-7b")
    cat.create_model("other")
    parent = None
    for i in range(1, 9):
        kind = "keyframe" if i in (1, 5) else "delta"
        objects = [(digest(f"p{i}-{j}"), 100 * i + j) for j in range(3)] + [(digest("shared"), 42)]
        publish(
            cat,
            "policy-7b",
            parent=parent,
            kind=kind,
            tag=f"v{i}",
            objects=objects,
            step=i * 10,
            metadata={"i": i, "tags": ["a", "b"]},
            now=T0,
        )
        parent = i
    publish(cat, "other", parent=None, tag="o1")
    cat.begin_version("policy-7b", parent=8, kind="delta")  # pending: not part of the dump
    cat.mark_deleted("policy-7b", [1, 2, 3, 4])  # chain 1..4 is gone: not part of the dump either


def _manifests(dump: dict) -> list[tuple[str, ImportedVersion]]:
    """What the ops layer would read back from the manifest objects in the store."""
    return [
        (
            v["model"],
            ImportedVersion(
                number=v["number"],
                parent=v["parent"],
                kind=v["kind"],
                chain_base=v["chain_base"],
                manifest_digest=v["manifest_digest"],
                raw_bytes=v["raw_bytes"],
                stored_bytes=v["stored_bytes"],
                objects=[(d, n) for d, n in v["objects"]],
                step=v["step"],
                metadata=v["metadata"],
            ),
        )
        for v in dump["versions"]
    ]


def test_rebuilt_catalog_equals_original(catalog: Catalog, tmp_path: Path) -> None:
    _build(catalog)
    original = catalog.dump_committed()
    assert [v["number"] for v in original["versions"] if v["model"] == "policy-7b"] == [5, 6, 7, 8]
    assert original["models"] == {"other": {"head": 1}, "policy-7b": {"head": 8}}

    records = _manifests(original)
    random.Random(7).shuffle(records)  # manifests come back from a store listing in any order
    rebuilt = Catalog.open(f"sqlite:///{tmp_path / 'rebuilt.db'}")
    try:
        for model, rec in records:
            rebuilt.create_model(model)
            rebuilt.import_version(model, rec, now=T0)
        assert rebuilt.dump_committed() == original
        assert rebuilt.dump_committed("other") == catalog.dump_committed("other")
        assert [v.number for v in rebuilt.lineage("policy-7b", 8)] == [5, 6, 7, 8]
        committed_refs = {d for v in original["versions"] for d, _ in v["objects"]}
        committed_refs |= {v["manifest_digest"] for v in original["versions"]}
        assert rebuilt.referenced_digests() == committed_refs
        # Importing again is harmless; a different manifest under a taken number is not.
        model, rec = records[0]
        assert rebuilt.import_version(model, rec).manifest_digest == rec.manifest_digest
        clash = ImportedVersion(
            **{**{f: getattr(rec, f) for f in rec.__dataclass_fields__}, "manifest_digest": digest("clash")}
        )
        with pytest.raises(errors.Conflict):
            rebuilt.import_version(model, clash)
        # Publishing continues on the rebuilt catalog from the restored head.
        assert publish(rebuilt, "policy-7b", parent=8, tag="after").number == 9
    finally:
        rebuilt.close()


def test_import_into_the_original_backend(catalog: Catalog, tmp_path: Path) -> None:
    source = Catalog.open(f"sqlite:///{tmp_path / 'source.db'}")
    try:
        _build(source)
        dump = source.dump_committed()
    finally:
        source.close()
    for model, rec in _manifests(dump):
        catalog.create_model(model)
        catalog.import_version(model, rec)
    assert catalog.dump_committed() == dump


def test_import_validation(catalog: Catalog) -> None:
    catalog.create_model("m")
    base = dict(manifest_digest=digest("m"), raw_bytes=1, stored_bytes=1)
    with pytest.raises(errors.InvalidArgument):
        catalog.import_version("m", ImportedVersion(number=2, parent=1, kind="keyframe", chain_base=1, **base))
    with pytest.raises(errors.InvalidArgument):
        catalog.import_version("m", ImportedVersion(number=2, parent=None, kind="delta", chain_base=1, **base))
    with pytest.raises(errors.InvalidArgument):
        catalog.import_version("m", ImportedVersion(number=0, parent=None, kind="keyframe", chain_base=0, **base))
    with pytest.raises(errors.ModelNotFound):
        catalog.import_version("x", ImportedVersion(number=1, parent=None, kind="keyframe", chain_base=1, **base))
