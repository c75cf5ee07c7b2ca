"""A relay over its own PostgreSQL catalog and S3 store (a real SeaweedFS), as a region would run it."""

from __future__ import annotations

from pathlib import Path

import pytest
from _client_util import start_server, stop_server
from _pg import fresh_database
from _relay_util import Versions, start_relay, tree, versions, wait_head

from weightsync.client import Subscriber

pytestmark = [pytest.mark.s3, pytest.mark.slow]


def test_a_relay_on_postgresql_and_s3(seaweed, tmp_path: Path) -> None:
    origin = start_server(tmp_path / "origin")
    relay = None
    try:
        pub = Versions(origin.url, "regional", tmp_path)
        pub.publish()
        pub.publish()
        pub.publish(keyframe=True)  # v1, v2: history the relay fetches only when asked
        with fresh_database() as url:
            relay = start_relay(
                tmp_path / "relay",
                origin.url,
                args=[
                    "--catalog",
                    url.replace("+psycopg", ""),
                    "--store",
                    "s3://weightsync-relay-tests/objects",
                    "--s3-endpoint",
                    seaweed.endpoint_url,
                ],
                env={
                    "WEIGHTSYNC_S3_ACCESS_KEY_ID": seaweed.access_key,
                    "WEIGHTSYNC_S3_SECRET_ACCESS_KEY": seaweed.secret_key,
                    "WEIGHTSYNC_S3_REGION": seaweed.region,
                },
            )
            wait_head(relay.url, "regional", 3)
            pub.publish()
            wait_head(relay.url, "regional", 4)
            assert versions(relay.url, "regional") == versions(origin.url, "regional")
            for n in (4, 1):
                Subscriber(relay.url, "regional").pull(tmp_path / f"relay-{n}", n)
            for n in (4, 1):
                Subscriber(origin.url, "regional").pull(tmp_path / f"origin-{n}", n)
                assert tree(tmp_path / f"relay-{n}") == tree(tmp_path / f"origin-{n}")
            stop_server(relay)
            relay = None
    finally:
        if relay is not None:
            stop_server(relay)
        stop_server(origin)
