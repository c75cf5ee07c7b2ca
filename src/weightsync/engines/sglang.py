"""SGLang, disk mode: update a running SGLang server from a checkout, verify every parameter, or put it back.

Talks to SGLang's native HTTP routes (source read: sglang 0.5.23 from PyPI,
``sglang/srt/entrypoints/http_server.py``, ``sglang/srt/managers/io_struct.py``,
``sglang/srt/utils/weight_checker.py``; facts and their JSON in docs/ENGINES.md
"SGLang facts"):

- ``POST /pause_generation {"mode": "abort"|"retract"|"in_place"}``,
  ``POST /continue_generation {}``;
- ``POST /update_weights_from_disk {"model_path", "load_format", "weight_version",
  "flush_cache", ...}`` → ``{"success", "message", "num_paused_requests"}`` (400
  when ``success`` is false);
- ``POST /weights_checker {"action": "checksum", "selector": "target"}`` →
  ``{"success", "message", "ranks": [{"checksums": {name: hex}, ...}], ...}``: a
  64-bit hash of every parameter's bytes (:func:`tensor_hash`);
- ``GET /model_info`` (``model_path``, ``weight_version``), ``GET /server_info``
  (``device``), ``POST /update_weight_version``.

A switch, in order (docs/ENGINES.md "SGLang disk mode"):

1. prepare (while serving): as vLLM's disk mode (engines/vllm.py): pull, link
   the files into ``DIR/.weightsync-engine/v<N>``, compute each parameter's
   expected hash, prove the checkout still holds the version;
2. pause (``retract``, ``in_place`` or ``abort``), update from the stage
   directory with ``weight_version`` ``"<N>"``, compare the engine's hashes;
3. all equal: continue. A refused update (``success: false``) or a differing
   parameter: update from the last verified stage, check it, continue on it and
   raise SwitchFailed; when even that fails the engine stays paused and is
   tagged ``weight_version`` ``"unverified"`` (EngineUnhealthy).

The ``in_place`` mode keeps running requests in SGLang's batch, and SGLang then
refuses to flush its cache (``flush_cache`` would fail the update): the update
is sent with ``flush_cache: false``, so the prefix cache keeps entries computed
with the previous weights until SGLang next flushes it. ``retract`` (the default)
and ``abort`` flush it.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import numpy as np

from weightsync import errors
from weightsync.client.checkout import Checkout
from weightsync.client.subscriber import Subscriber
from weightsync.engines import digests
from weightsync.engines.base import SwitchReport, Update
from weightsync.engines.errors import (
    EngineError,
    EngineUnavailable,
    EngineUnhealthy,
    SwitchFailed,
    UnverifiableEngine,
)
from weightsync.engines.http import EngineHttp, message
from weightsync.engines.vllm import DiskUpdate, VllmDisk

PauseMode = Literal["retract", "in_place", "abort"]
PAUSE_MODES: tuple[str, ...] = ("retract", "in_place", "abort")
UNVERIFIED = "unverified"
"""The weight version an engine left paused on weights that are no version is tagged with."""


class SglangClient(EngineHttp):
    """The native routes of one SGLang HTTP server (``python -m sglang.launch_server``), 0.5.23 or later.

    Transport failures raise EngineUnavailable; an error answer raises
    EngineError with the server's message (except the update, whose refusal is
    its result). ``slow_timeout`` bounds the calls that touch every weight
    (update, checksum). ``token`` is SGLang's ``--api-key``/``--admin-api-key``.
    Thread-safe (httpx.Client).
    """

    engine = "SGLang"
    missing_route = "weightsync needs SGLang 0.5.23 or later"

    def _check_routes(self) -> None:
        self.model_info()

    def pause(self, mode: PauseMode) -> None:
        """Stop generating: ``abort`` ends running requests, ``retract`` puts them back in the queue (their
        KV cache is recomputed after the switch, with the new weights), ``in_place`` freezes them with their
        KV cache. Requests that arrive meanwhile wait. Returns once paused."""
        self._call("POST", "/pause_generation", json={"mode": mode})

    def resume(self) -> None:
        self._call("POST", "/continue_generation", json={})

    def update_from_disk(
        self, directory: str | os.PathLike[str], *, weight_version: str, flush_cache: bool
    ) -> tuple[bool, str]:
        """Load every weight from the safetensors files of ``directory``; ``(success, message)``.

        On success SGLang's ``model_path`` becomes ``directory`` and its weight
        version ``weight_version``. A refusal (400, ``success: false``) may leave
        the weights partly loaded: SGLang's own rollback rereads the path it was
        given (``model_runner_components/weight_updater.py``).
        """
        body = {"model_path": os.fspath(directory), "weight_version": weight_version, "flush_cache": flush_cache}
        r = self._request("POST", "/update_weights_from_disk", json=body, slow=True)
        try:
            answer = r.json()
        except ValueError:
            answer = None
        if not isinstance(answer, dict) or "success" not in answer:
            raise EngineError(f"SGLang POST /update_weights_from_disk answered {r.status_code}: {message(r)}")
        return bool(answer["success"]), " ".join(str(answer.get("message", "")).split())[:300]

    def checksums(self) -> list[dict[str, Any]]:
        """Every rank's ``{"checksums": {parameter: 16 hex}, "parallelism_info": [...]}`` (target model only)."""
        answer = self._call("POST", "/weights_checker", json={"action": "checksum", "selector": "target"}, slow=True)
        ranks = answer.get("ranks") if isinstance(answer, dict) else None
        if not isinstance(ranks, list) or not ranks:
            raise EngineError(f"SGLang /weights_checker answered without checksums: {str(answer)[:200]}")
        return ranks

    def model_info(self) -> dict[str, Any]:
        answer = self._call("GET", "/model_info")
        if not isinstance(answer, dict) or "model_path" not in answer:
            raise EngineError(f"SGLang at {self.url} answered /model_info without a model_path: {str(answer)[:200]}")
        return answer

    def weight_version(self) -> str:
        return str(self.model_info().get("weight_version"))

    def device(self) -> str:
        """The device SGLang runs the model on (``cuda``, ``cpu``...), from ``/server_info``."""
        return str(self._call("GET", "/server_info").get("device") or "cuda")

    def set_weight_version(self, tag: str) -> None:
        """Tag the weights (a label only); running requests are left alone."""
        self._call("POST", "/update_weight_version", json={"new_version": tag, "abort_all_requests": False})


# --- what the engine's hashes must be ---------------------------------------------------------


def by_parameter(ranks: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """The engine's hashes by parameter name; UnverifiableEngine when parameters are sliced across ranks.

    Data-parallel ranks each hold every parameter: they must agree (a
    disagreement is reported as the parameter's hash ``"dp-disagree"``).
    """
    out: dict[str, str] = {}
    for rank in ranks:
        infos = rank.get("parallelism_info") or []
        for info in infos if isinstance(infos, list) else [infos]:
            if info.get("tp_size", 1) != 1 or info.get("pp_size", 1) != 1:
                raise UnverifiableEngine(
                    f"SGLang's parameters are sliced across ranks (tp_size {info.get('tp_size')}, pp_size "
                    f"{info.get('pp_size')}): disk mode checks unsliced engines only"
                )
        sums = rank.get("checksums")
        if not isinstance(sums, dict):
            raise EngineError(f"SGLang /weights_checker rank without checksums: {str(rank)[:200]}")
        for name, digest in sums.items():
            if name in out and out[name] != digest:
                out[name] = "dp-disagree"
            else:
                out.setdefault(str(name), str(digest))
    return out


_TILE_WORDS = 8192
_SEED = 0x243F6A88
_MASK64 = (1 << 64) - 1


def _fmix32(x: np.ndarray) -> np.ndarray:
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x85EBCA6B)
    x ^= x >> np.uint32(13)
    x *= np.uint32(0xC2B2AE35)
    x ^= x >> np.uint32(16)
    return x


def _rotl32(x: np.ndarray, r: int) -> np.ndarray:
    return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


def cuda_tensor_hash(data: np.ndarray, *, chunk_tiles: int = 128) -> int:
    """SGLang's hash of a CUDA tensor's bytes (``sglang/kernels/ops/memory/gpu_tensor_hash.py``, 0.5.23).

    The bytes, zero-padded to 4-byte words (little-endian), are hashed per word
    against its index with two 32-bit lanes, summed per tile of 8192 words,
    each tile's sums mixed with the byte count, the tiles' 64-bit values summed
    and finalised with splitmix64. Written here from that kernel's source, in
    numpy (``data``: the bytes as a uint8 array); exact for tensors under 8 GiB.
    """
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    if raw.size % 4:
        raw = np.concatenate([raw, np.zeros(4 - raw.size % 4, np.uint8)])
    words = raw.view("<u4")
    n = words.size
    if n == 0:
        return 0
    seed1 = np.uint32(_SEED & 0xFFFFFFFF)
    seed2 = np.uint32(((_SEED * 0x9E3779B1) ^ 0xDEADBEEF) & 0xFFFFFFFF)
    nbytes = np.uint32((n * 4) & 0xFFFFFFFF)
    total = 0
    step = _TILE_WORDS * chunk_tiles
    for start in range(0, n, step):
        v = words[start : start + step].astype(np.uint32)
        i = np.arange(start, start + v.size, dtype=np.uint32)
        k1 = _fmix32(v ^ ((i * np.uint32(0x27D4EB2D) + seed1) ^ _rotl32(i, 15)))
        k2 = _fmix32(v ^ ((i * np.uint32(0x165667B1) + seed2) ^ _rotl32(i, 13)))
        pad = (-v.size) % _TILE_WORDS  # masked lanes of the last tile add 0
        if pad:
            k1, k2 = np.concatenate([k1, np.zeros(pad, np.uint32)]), np.concatenate([k2, np.zeros(pad, np.uint32)])
        h1 = (k1.reshape(-1, _TILE_WORDS).sum(axis=1, dtype=np.uint64) & 0xFFFFFFFF).astype(np.uint32)
        h2 = (k2.reshape(-1, _TILE_WORDS).sum(axis=1, dtype=np.uint64) & 0xFFFFFFFF).astype(np.uint32)
        h1, h2 = _fmix32(h1 ^ nbytes), _fmix32(h2 ^ nbytes)
        tiles = (h1.astype(np.uint64) << np.uint64(32)) | h2.astype(np.uint64)
        total = (total + int(tiles.sum(dtype=np.uint64))) & _MASK64
    x = total
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _MASK64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    return x


def expected(
    directory: str | os.PathLike[str], names: Iterable[str], *, device: str, threads: int | None = None
) -> dict[str, str]:
    """The hash (16 hex digits) each engine parameter in ``names`` must have when SGLang holds ``directory``.

    SGLang's ``tensor_hash`` (``sglang/srt/managers/mm_utils.py``, 0.5.23) is
    :func:`cuda_tensor_hash` for a CUDA tensor and the first 8 bytes of the
    SHA-256 of its bytes elsewhere. Fused parameters are their parts' bytes in
    order (engines/digests.py). UnverifiableEngine as :func:`digests.expected`.
    """
    names = list(names)
    if not device.startswith("cuda"):
        return {name: digest[:16] for name, digest in digests.expected(directory, names, threads=threads).items()}
    tensors = digests.index(directory)
    plan: dict[str, list[digests.TensorBytes]] = {}
    for name in names:
        parts = digests.sources(name)
        missing = [p for p in parts if p not in tensors]
        if missing:
            raise UnverifiableEngine(
                f"engine parameter {name!r} has no source in the checkpoint (looked for {', '.join(missing)})"
            )
        if len({tensors[p].dtype for p in parts}) != 1:
            raise UnverifiableEngine(f"engine parameter {name!r} fuses tensors of different dtypes")
        plan[name] = [tensors[p] for p in parts]
    maps: dict[Path, np.ndarray] = {}
    for spans in plan.values():
        for s in spans:
            if s.path not in maps:
                maps[s.path] = np.memmap(s.path, dtype=np.uint8, mode="r", shape=(s.path.stat().st_size,))

    def digest(spans: list[digests.TensorBytes]) -> str:
        pieces = [maps[s.path][s.start : s.end] for s in spans]
        data = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)  # a fused parameter: one copy
        return f"{cuda_tensor_hash(data):016x}"

    with ThreadPoolExecutor(threads or min(8, os.cpu_count() or 1), thread_name_prefix="weightsync-hash") as pool:
        futures = {name: pool.submit(digest, spans) for name, spans in plan.items()}  # numpy releases the GIL
        return {name: fut.result() for name, fut in futures.items()}


_STAGE_NAME = re.compile(r"v([0-9]+)")


class SglangDisk(VllmDisk):
    """Keeps an SGLang server on a model's versions by updating it from a checkout directory (module docstring).

    ``subscriber`` pulls into ``directory`` (give it ``report=False``: the
    follow loop reports what the engine holds, not what the checkout holds).
    ``pause`` is SGLang's pause mode for requests in flight during a switch.
    The checkout staging and its proof are vLLM disk mode's (engines/vllm.py).
    """

    kind = "sglang"

    def __init__(
        self,
        client: SglangClient | str,
        subscriber: Subscriber,
        directory: str | os.PathLike[str],
        *,
        pause: PauseMode = "retract",
    ) -> None:
        if pause not in PAUSE_MODES:
            raise errors.InvalidArgument(f"pause mode {pause!r} is not one of {', '.join(PAUSE_MODES)}")
        sglang = SglangClient(client) if isinstance(client, str) else client
        super().__init__(sglang, subscriber, directory)  # type: ignore[arg-type]
        self.pause_mode = pause  # type: ignore[assignment]
        self.sglang_pause: PauseMode = pause
        self._device: str | None = None

    @property
    def sglang(self) -> SglangClient:
        return self.client  # type: ignore[return-value]

    # --- what the engine holds ------------------------------------------------------------

    def engine_digests(self) -> dict[str, str]:
        """The engine's parameter hashes by name (learning the names and the device on the first call)."""
        got = by_parameter(self.sglang.checksums())
        if self._names is None:
            self._names = sorted(got)
        if self._device is None:
            self._device = self.sglang.device()
        return got

    def _expected(self, stage: Path) -> dict[str, str]:
        return expected(stage, self._names or [], device=self._device or "cuda")

    def held(self) -> int | None:
        """The version the engine's weights are, every parameter hash equal: the weight version it is tagged
        with, the stage directory it was updated from, the version this adapter last verified, or the
        checkout's; None when none of them matches.

        An engine left paused by a switch that could not be undone (tagged ``unverified``) that proves
        to hold a version is tagged with it and continued, as :meth:`VllmDisk.held` resumes vLLM."""
        got = self.engine_digests()
        info = self.sglang.model_info()
        tag = str(info.get("weight_version", ""))
        candidates: list[int] = []
        if tag.isdigit():
            candidates.append(int(tag))
        path = Path(str(info.get("model_path", "")))
        if path.parent == self.stages and (m := _STAGE_NAME.fullmatch(path.name)):
            candidates.append(int(m.group(1)))
        if self._good is not None:
            candidates.append(self._good.version)
        state = Checkout(self.directory).state()
        if state is not None:
            candidates.append(state.number)
        for version in dict.fromkeys(candidates):
            try:
                update = self._staged(version)
            except errors.DigestMismatch:
                continue  # the checkout's files are not that version: nothing to prove it with
            if update is not None and not digests.differing(got, update.want):
                self.version, self._good = version, update
                if tag == UNVERIFIED:
                    # Left paused by a switch that could not be undone (the tag says so, whichever adapter
                    # did it); its weights are a verified version now: tag them and continue. An engine an
                    # operator paused carries another tag and stays paused.
                    self.sglang.set_weight_version(str(version))
                    self.sglang.resume()
                return version
        self.version = None
        return None

    def _staged(self, version: int) -> DiskUpdate | None:
        """``version`` staged with its expected hashes: the one this adapter verified, or the checkout's
        version after proving the checkout's files are it (a stage directory left on disk is never trusted)."""
        if self._good is not None and self._good.version == version:
            return self._good
        state = Checkout(self.directory).state()
        if state is None or state.number != version:
            return None
        stage = self._stage(version)
        want = self._expected(stage)
        self._check_checkout(version)
        return DiskUpdate(version, 0, 0.0, stage, want)

    # --- prepare --------------------------------------------------------------------------

    def prepare(self, version: int) -> DiskUpdate:
        """Pull ``version`` into the checkout, stage it, compute the hashes the engine must show."""
        t0 = time.perf_counter()
        pulled = self.subscriber.pull(self.directory, version)
        if self._names is None:
            self.engine_digests()
        stage = self._stage(pulled.version)
        want = self._expected(stage)
        self._check_checkout(pulled.version)  # after hashing: a change while hashing is caught here
        return DiskUpdate(pulled.version, pulled.bytes_received, time.perf_counter() - t0, stage, want)

    # --- switch ---------------------------------------------------------------------------

    def _update(self, update: DiskUpdate) -> tuple[str, list[str]]:
        """Update the engine from ``update``'s stage and compare; ``(failure, mismatched)``, both empty when it
        holds the version."""
        ok, message = self.sglang.update_from_disk(
            update.stage, weight_version=str(update.version), flush_cache=self.sglang_pause != "in_place"
        )
        if not ok:
            return f"SGLang refused the update ({message})", []
        return "", digests.differing(self.engine_digests(), update.want)

    def switch(self, update: Update) -> SwitchReport:
        """Pause, update from the stage, check every parameter, then continue on it or on the last good version."""
        if not isinstance(update, DiskUpdate):
            raise errors.InvalidArgument("SglangDisk.switch takes the DiskUpdate its prepare returned")
        previous, good = self.version, self._good
        t0 = time.perf_counter()
        self.sglang.pause(self.sglang_pause)
        self.version = None  # from here until verified, the engine's weights are not known
        t_reload = time.perf_counter()
        try:
            failure, mismatched = self._update(update)
        except EngineUnavailable:
            raise
        except EngineError as exc:
            failure, mismatched = str(exc), []
        t_done = time.perf_counter()
        if not failure and not mismatched:
            self.sglang.resume()
            pause_s = time.perf_counter() - t0
            self.version, self._good = update.version, update
            self._drop_stages(keep=update.stage)
            return SwitchReport(
                update.version,
                previous,
                pause_s,
                "disk",
                len(update.want),
                update.bytes_received,
                update.prepare_s,
                {"update_verify_s": t_done - t_reload},
            )
        why = failure or f"{len(mismatched)} parameters differ from the version ({', '.join(mismatched[:5])})"
        self._roll_back(good, update, why)
        raise SwitchFailed(
            f"SGLang did not switch to version {update.version}: {why}; it serves version {previous} again",
            target=update.version,
            held=previous,
            mismatched=mismatched,
        )

    def _roll_back(self, good: DiskUpdate | None, failed: DiskUpdate, why: str) -> None:
        """Update from the last verified version and continue on it; EngineUnhealthy (still paused) if impossible."""
        if good is None:
            self._unhealthy(
                f"SGLang failed to switch to version {failed.version} ({why}) and no verified version is staged "
                "to go back to: left paused",
                failed,
            )
        assert good is not None
        try:
            failure, bad = self._update(good)
        except EngineUnavailable:
            raise
        except EngineError as exc:
            failure, bad = str(exc), []
        if failure or bad:
            again = failure or f"{len(bad)} parameters wrong"
            self._unhealthy(
                f"SGLang failed to switch to version {failed.version} ({why}) and to go back to version "
                f"{good.version} ({again}): left paused",
                failed,
            )
        self.sglang.resume()
        self.version = good.version
        if failed.stage != good.stage:
            shutil.rmtree(failed.stage, ignore_errors=True)

    def _unhealthy(self, message: str, failed: DiskUpdate) -> None:
        """Tag the paused engine's weights as no version (best effort) and raise EngineUnhealthy."""
        try:
            self.sglang.set_weight_version(UNVERIFIED)
        except EngineError:
            pass  # the label is only a hint; the engine stays paused either way
        raise EngineUnhealthy(message, target=failed.version)


__all__ = [
    "PAUSE_MODES",
    "SglangClient",
    "SglangDisk",
    "by_parameter",
    "cuda_tensor_hash",
    "expected",
]
