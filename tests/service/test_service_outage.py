"""A catalog outage answers 503 unavailable with Retry-After, and /readyz says which part is down."""

from __future__ import annotations

import httpx
import pytest
from _pg import ADMIN_URL, fresh_database
from _service_http import ok, problem
from _service_util import running

from weightsync.service import Settings


@pytest.mark.postgres
def test_catalog_outage_is_503_with_retry_after(tmp_path):
    import psycopg
    from psycopg import sql

    with fresh_database("ws_outage") as url:
        name = url.rsplit("/", 1)[1]
        with running(Settings(data=tmp_path, catalog=url)) as base, httpx.Client(base_url=base) as c:
            assert ok(c.get("/readyz"), 200) == {"catalog": True, "store": True}
            ok(c.post("/v1/models", json={"name": "m"}), 201)
            with psycopg.connect(ADMIN_URL, autocommit=True) as admin:  # the database goes away
                admin.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))
            r = c.get("/v1/models/m")
            problem(r, 503, "unavailable")
            assert int(r.headers["retry-after"]) > 0
            r = c.get("/readyz")
            assert r.status_code == 503 and r.json() == {"catalog": False, "store": True}
            assert c.get("/healthz").status_code == 200  # alive, just not ready
