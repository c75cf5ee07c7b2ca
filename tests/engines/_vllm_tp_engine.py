"""A tensor-parallel "engine" for the in-process adapter: simulated ranks behind vLLM's dev HTTP routes.

Run with the vLLM venv's interpreter (``tests/engines/test_vllm_tp.py`` does)::

    .venv-vllm/bin/python tests/engines/_vllm_tp_engine.py SPEC.json

Tensor parallelism above 1 cannot run on vLLM's CPU executor here. This process
holds ``size`` ranks as ``_vllm_tp.py`` makes them (vLLM 0.32's own parallel
layers of the tiny Llama, rank and size faked, loaded by vLLM's own loaders from
the checkpoint ``SPEC["start"]``; weightsync's ``Worker`` extension on each) and
answers the routes of vLLM 0.32's OpenAI server that ``VllmInProcess`` uses,
with vLLM's request and answer shapes (``vllm/entrypoints/serve/dev/``):
``GET /health``, ``POST /pause?mode=``, ``POST /resume``, ``GET /is_paused``,
``POST /collective_rpc {method, args, kwargs}`` → ``{"results": [one per
worker, in rank order]}`` (each call run in every worker in turn, one RPC at a
time, with that worker's rank set in vLLM's parallel state as vLLM's workers
have it), ``POST /weight_checker {"action": "checksum"}`` → ``{"checksums":
{"dp0:pp0:pcp0:tp<r>:<name>": sha256}}``, ``POST /update_weight_version
{"new_version"}``, ``GET /weight_info``. One route is the test's own:
``POST /_test/differing {"tag"}`` → ``{"differing": [[names] per rank]}``, each
rank's parameters against what vLLM's loaders make of checkpoint ``tag`` on that
rank. Listens on ``SPEC["port"]`` until killed.
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _make_llama import config as tiny_config  # noqa: E402
from _vllm_layouts import build, fake_tp, load  # noqa: E402
from _vllm_tp import FakeWorker, bits, checkpoint, differing, live, oracle  # noqa: E402
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402


class Engine:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.cfg = tiny_config()
        self.size = spec["size"]
        self.paused = False
        self.tag = spec.get("weight_version", "default")
        self.lock = threading.Lock()
        self.roots, self.workers = [], []
        start = checkpoint(spec["trainer"][spec["start"]])
        for rank in range(self.size):
            fake_tp(rank, self.size)
            with set_current_vllm_config(VllmConfig()):
                root = build(self.cfg)
            del root.column  # _vllm_layouts' extra layer: not the Llama's
            load(root, start)
            self.roots.append(root)
            self.workers.append(FakeWorker(root, rank, self.size, self.cfg))

    def rpc(self, method: str, args: list[Any], kwargs: dict[str, Any]) -> list[Any]:
        with self.lock:
            out = []
            for rank, w in enumerate(self.workers):
                fake_tp(rank, self.size)  # what vLLM's worker process holds in its parallel state
                out.append(getattr(w, method)(*args, **kwargs))
            return out

    def checksums(self) -> dict[str, str]:
        with self.lock:
            return {
                f"dp0:pp0:pcp0:tp{rank}:{name}": hashlib.sha256(bits(p)).hexdigest()
                for rank, root in enumerate(self.roots)
                for name, p in live(root).items()
            }

    def differing(self, tag: str) -> list[list[str]]:
        tensors = checkpoint(self.spec["trainer"][tag])
        with self.lock:
            return [
                differing(live(root), oracle(self.cfg, tensors, rank, self.size))
                for rank, root in enumerate(self.roots)
            ]


def serve(engine: Engine, port: int) -> None:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _answer(self, status: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> Any:
            n = int(self.headers.get("Content-Length") or 0)
            return json.loads(self.rfile.read(n)) if n else {}

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            path = urlsplit(self.path).path
            if path == "/health":
                self._answer(200, {})
            elif path == "/is_paused":
                self._answer(200, {"is_paused": engine.paused})
            elif path == "/weight_info":
                self._answer(200, {"weight_version": engine.tag})
            else:
                self._answer(404, {"detail": "Not Found"})

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            url = urlsplit(self.path)
            body = self._body()
            if url.path == "/pause":
                assert parse_qs(url.query).get("mode", ["abort"])[0] in ("abort", "wait", "keep")
                engine.paused = True
                self._answer(200, {"status": "paused"})
            elif url.path == "/resume":
                engine.paused = False
                self._answer(200, {"status": "resumed"})
            elif url.path == "/collective_rpc":
                results = engine.rpc(body["method"], body.get("args") or [], body.get("kwargs") or {})
                self._answer(200, {"results": results})
            elif url.path == "/weight_checker":
                assert body.get("action") == "checksum", body
                self._answer(200, {"checksums": engine.checksums()})
            elif url.path == "/update_weight_version":
                engine.tag = str(body["new_version"])
                self._answer(200, {"status": "ok"})
            elif url.path == "/_test/differing":
                self._answer(200, {"differing": engine.differing(body["tag"])})
            else:
                self._answer(404, {"detail": "Not Found"})

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    server.serve_forever()


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    torch.set_default_dtype(torch.bfloat16)  # vLLM's model dtype (--dtype bfloat16)
    torch.set_num_threads(1)
    serve(Engine(spec), spec["port"])


if __name__ == "__main__":
    main()
