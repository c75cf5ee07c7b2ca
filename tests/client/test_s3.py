"""Against a server whose store is S3 (a real SeaweedFS): uploads go through the presigned requests."""

from __future__ import annotations

from pathlib import Path

import pytest
from _client_util import FaultyTransport, TinyTrainer, start_server, stop_server, tree_bytes, write_version

from weightsync.client import Publisher, Subscriber

pytestmark = pytest.mark.s3


@pytest.fixture(scope="module")
def s3_server(seaweed, tmp_path_factory: pytest.TempPathFactory):
    env = {
        "WEIGHTSYNC_S3_ACCESS_KEY_ID": seaweed.access_key,
        "WEIGHTSYNC_S3_SECRET_ACCESS_KEY": seaweed.secret_key,
        "WEIGHTSYNC_S3_REGION": seaweed.region,
    }
    srv = start_server(
        tmp_path_factory.mktemp("s3-server"),
        args=["--store", "s3://weightsync-client-tests/objects", "--s3-endpoint", seaweed.endpoint_url],
        env=env,
    )
    try:
        yield srv
    finally:
        stop_server(srv)


def test_presigned_uploads(s3_server, model, tmp_path: Path) -> None:
    trainer = TinyTrainer(seed=47)
    # Count the requests that reach the weightsync server's object route: none when uploads are presigned.
    direct = FaultyTransport("PUT", "/v1/objects/")
    with (
        Publisher(s3_server.url, model, transport=direct, chunk_bytes=16 << 10, object_bytes=48 << 10) as pub,
        Subscriber(s3_server.url, model) as sub,
    ):
        for i in range(1, 3):
            trainer.step()
            src = write_version(tmp_path / f"src{i}", trainer.export())
            r = pub.publish(src)
            assert r.version == i and r.objects_uploaded > 0
            sub.pull(tmp_path / "out")
            assert tree_bytes(tmp_path / "out") == tree_bytes(src)
    assert direct.count == 0, "objects went to the presigned URLs, not through the server"
