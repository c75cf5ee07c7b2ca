"""open_store: URL → backend, providers imported lazily."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from weightsync import errors
from weightsync.store import open_store
from weightsync.store.fs import FsStore
from weightsync.store.s3 import S3Store


def test_plain_path_and_file_url_open_fs(tmp_path: Path) -> None:
    a = open_store(str(tmp_path / "a"))
    b = open_store(f"file://{tmp_path / 'b'}")
    c = open_store(tmp_path / "c", fsync=False)
    assert isinstance(a, FsStore) and a.root == tmp_path / "a"
    assert isinstance(b, FsStore) and b.root == tmp_path / "b"
    assert isinstance(c, FsStore) and (tmp_path / "c" / "objects").is_dir()


def test_s3_url_names_bucket_and_prefix() -> None:
    st = open_store("s3://my-bucket/team/models/", endpoint_url="http://127.0.0.1:1", verify_conditional_writes=False)
    assert isinstance(st, S3Store)
    assert (st.bucket, st.prefix) == ("my-bucket", "team/models/")
    assert open_store("s3://b").prefix == ""  # type: ignore[attr-defined]


@pytest.mark.parametrize("url", ["gs://bucket/x", "http://host/x", "s3:///no-bucket", "file://remote-host/x"])
def test_unsupported_urls_are_refused(url: str) -> None:
    with pytest.raises(errors.StoreError):
        open_store(url)


def test_importing_the_store_does_not_import_providers() -> None:
    code = (
        "import sys, weightsync.store; "
        "bad = [m for m in ('weightsync.store.s3', 'weightsync.store.fs', 'aioboto3', 'botocore') "
        "if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
