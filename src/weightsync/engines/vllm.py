"""vLLM, disk mode: reload a running vLLM server from a checkout, verify every parameter, or put it back.

Talks to the server's development routes (``VLLM_SERVER_DEV_MODE=1``; facts and
their JSON in docs/ENGINES.md): ``POST /pause?mode=keep|wait|abort``,
``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}``,
``POST /weight_checker {"action": "checksum"}``, ``POST /update_weight_version``,
``GET /weight_info``, ``POST /resume``. Works for any engine configuration vLLM
can reload from disk; the check needs the parameters to be plain or fused
copies of checkpoint tensors, or their tensor-parallel slices as vLLM lays
them out (engines/layouts.py; docs/ENGINES.md "What disk mode verifies").

A switch, in order (docs/ENGINES.md "Disk mode"):

1. prepare (while serving): pull the version into the checkout (atomic), link
   its files into a stage directory ``DIR/.weightsync-engine/v<N>`` (hard links:
   no copy, and the bytes stay when the checkout moves on), compute each
   engine parameter's expected SHA-256 from them, then prove the checkout
   still holds the version (its state's digests);
2. pause (``keep``, ``wait`` or ``abort`` in-flight requests), reload from the
   stage directory, compare the engine's digests with the expected ones;
3. all equal: tag the engine's weight version, resume. Otherwise reload the
   last verified stage directory, check it, resume on it and raise
   SwitchFailed; when even that fails the engine stays paused (EngineUnhealthy).
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from weightsync import errors
from weightsync.client.checkout import Checkout
from weightsync.client.subscriber import Subscriber
from weightsync.engines import digests
from weightsync.engines.base import Engine, SwitchReport, Update
from weightsync.engines.errors import (
    EngineError,
    EngineUnavailable,
    EngineUnhealthy,
    SwitchFailed,
    UnverifiableEngine,
)
from weightsync.engines.http import EngineHttp

PauseMode = Literal["keep", "wait", "abort"]
PAUSE_MODES: tuple[str, ...] = ("keep", "wait", "abort")
STAGE_DIR = ".weightsync-engine"
"""Inside the checkout: one directory of hard links per version the engine may hold or load."""


class VllmClient(EngineHttp):
    """The development routes of one vLLM OpenAI server (``VLLM_SERVER_DEV_MODE=1``).

    Transport failures raise EngineUnavailable; an error answer raises
    EngineError with the server's message. ``slow_timeout`` bounds the calls
    that touch every weight (reload, checksum). Thread-safe (httpx.Client).
    """

    engine = "vLLM"
    missing_route = "start it with VLLM_SERVER_DEV_MODE=1"
    # A failed RPC makes vLLM 0.32 drop the connection after its 500: never reuse the connection of one.
    fresh_slow_connections = True

    def _check_routes(self) -> None:
        self.is_paused()  # a dev route: 404 without VLLM_SERVER_DEV_MODE=1

    def pause(self, mode: PauseMode) -> None:
        """Stop scheduling: ``keep`` freezes in-flight requests until resume, ``wait`` lets them finish
        first, ``abort`` ends them (finish_reason ``abort``). Returns once paused."""
        self._call("POST", "/pause", params={"mode": mode})

    def resume(self) -> None:
        self._call("POST", "/resume")

    def is_paused(self) -> bool:
        return bool(self._call("GET", "/is_paused")["is_paused"])

    def reload(self, directory: str | os.PathLike[str]) -> None:
        """Reload every weight, layer by layer in place, from the safetensors files of ``directory``.

        A failure half way leaves the model without weights (its parameters on
        the meta device): only another successful reload repairs it.
        """
        body = {"method": "reload_weights", "kwargs": {"weights_path": os.fspath(directory)}}
        try:
            self._call("POST", "/collective_rpc", json=body, slow=True)
        except EngineUnavailable as exc:
            # vLLM 0.32 re-raises a failed RPC inside its ASGI app after logging the 500: the client may see
            # the connection reset instead of the answer. A server still healthy had the reload fail.
            if not self.health():
                raise
            raise EngineError(f"vLLM reload from {directory} failed (the server dropped the connection)") from exc

    def checksums(self) -> dict[str, str]:
        """SHA-256 of every parameter's bytes, keyed ``dp<i>:pp<i>:pcp<i>:tp<i>:<name>``."""
        answer = self._call("POST", "/weight_checker", json={"action": "checksum"}, slow=True)
        sums = answer.get("checksums") if isinstance(answer, dict) else None
        if not isinstance(sums, dict):
            raise EngineError(f"vLLM /weight_checker answered without checksums: {str(answer)[:200]}")
        return {str(k): str(v) for k, v in sums.items()}

    def set_weight_version(self, tag: str) -> None:
        self._call("POST", "/update_weight_version", json={"new_version": tag})

    def weight_version(self) -> str:
        return str(self._call("GET", "/weight_info")["weight_version"])


def by_parameter(checksums: Mapping[str, str]) -> dict[str, str]:
    """The engine's digests by parameter name, or by :func:`digests.rank_key` per rank of a tensor-parallel engine.

    Tensor-parallel ranks (``tp<i>``) each hold their slice of every parameter:
    one digest per rank, keyed ``tp<rank>/<size>:<name>`` (the bare name at
    size 1), each checked against that rank's slice of the checkpoint.
    Data-parallel replicas (``dp<i>``) each hold every slice: they must agree
    (a disagreement is reported as the digest ``"dp-disagree"``). Pipeline and
    context parallel ranks are refused (UnverifiableEngine); a tensor-parallel
    group that lacks a parameter on some rank is an EngineError.
    """
    ranks: dict[tuple[int, str], str] = {}
    for key, digest in checksums.items():
        parts = key.split(":", 4)
        if len(parts) != 5 or not parts[3].startswith("tp") or not parts[3][2:].isdigit():
            raise EngineError(f"vLLM weight checksum key {key!r} is not dp:pp:pcp:tp:name")
        _, pp, pcp, tp, name = parts
        if (pp, pcp) != ("pp0", "pcp0"):
            raise UnverifiableEngine(
                f"parameter {name!r} is split across pipeline or context parallel ranks ({key.rsplit(':', 1)[0]}): "
                "disk mode checks pipeline and context parallel size 1 only"
            )
        at = (int(tp[2:]), name)
        if at in ranks and ranks[at] != digest:
            ranks[at] = "dp-disagree"
        else:
            ranks.setdefault(at, digest)
    size = 1 + max((rank for rank, _ in ranks), default=0)
    held: dict[str, set[int]] = {}
    for rank, name in ranks:
        held.setdefault(name, set()).add(rank)
    for name, on in held.items():
        if len(on) != size:
            missing = sorted(set(range(size)) - on)
            raise EngineError(
                f"vLLM weight checksums lack parameter {name!r} on tensor-parallel ranks {missing} of {size}"
            )
    return {digests.rank_key(name, rank, size): digest for (rank, name), digest in ranks.items()}


@dataclass(frozen=True)
class DiskUpdate(Update):
    """A version staged for a disk switch: its directory and the digests the engine must show after it."""

    stage: Path
    want: dict[str, str]


class VllmDisk(Engine):
    """Keeps a vLLM server on a model's versions by reloading it from a checkout directory (module docstring).

    ``subscriber`` pulls into ``directory`` (give it ``report=False``: the
    follow loop reports what the engine holds, not what the checkout holds).
    ``pause`` says what happens to requests in flight during a switch.
    """

    kind = "vllm"

    def __init__(
        self,
        client: VllmClient | str,
        subscriber: Subscriber,
        directory: str | os.PathLike[str],
        *,
        pause: PauseMode = "keep",
    ) -> None:
        if pause not in PAUSE_MODES:
            raise errors.InvalidArgument(f"pause mode {pause!r} is not one of {', '.join(PAUSE_MODES)}")
        self.client = VllmClient(client) if isinstance(client, str) else client
        self.subscriber = subscriber
        self.directory = Path(directory)
        self.stages = self.directory / STAGE_DIR
        self.pause_mode: PauseMode = pause
        self.version: int | None = None
        self._good: DiskUpdate | None = None
        self._names: list[str] | None = None
        self._empty: dict[str, str] = {}  # parameters the engine showed with no bytes (digests.bytes_dropped)

    def close(self) -> None:
        self.client.close()

    # --- what the engine holds ------------------------------------------------------------

    def engine_digests(self) -> dict[str, str]:
        """The engine's parameter digests by name, or per rank (:func:`by_parameter`), learning the keys on the
        first call."""
        got = by_parameter(self.client.checksums())
        if self._names is None:
            self._names = sorted(got)
            self._empty = {k: d for k, d in got.items() if d == digests.EMPTY}
        return got

    def held(self) -> int | None:
        """The version the engine's weights are, byte for byte: the weight version it is tagged with,
        the version this adapter last verified, or the checkout's; None when none of them matches.

        An engine found paused that proves to hold a version is resumed: only a switch that could not
        be undone leaves it paused (EngineUnhealthy), and its weights are a verified version now (an
        operator restored them, or a later reload did)."""
        got = self.engine_digests()
        candidates: list[int] = []
        try:
            candidates.append(int(self.client.weight_version()))
        except ValueError:
            pass  # "default": never tagged by weightsync
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
                if self.client.is_paused():
                    self.client.set_weight_version(str(version))
                    self.client.resume()
                return version
        self.version = None
        return None

    def _staged(self, version: int) -> DiskUpdate | None:
        """``version`` staged with its expected digests: the one this adapter verified, or the checkout's
        version after proving the checkout's files are it (a stage directory left on disk is never trusted:
        a failed switch may have left one whose bytes are as wrong as the engine's)."""
        if self._good is not None and self._good.version == version:
            return self._good
        state = Checkout(self.directory).state()
        if state is None or state.number != version:
            return None
        stage = self._stage(version)
        want = digests.expected(stage, self._names or [])
        self._check_checkout(version)
        return DiskUpdate(version, 0, 0.0, stage, want)

    # --- prepare --------------------------------------------------------------------------

    def prepare(self, version: int) -> DiskUpdate:
        """Pull ``version`` into the checkout, stage it, compute the digests the engine must show."""
        t0 = time.perf_counter()
        pulled = self.subscriber.pull(self.directory, version)
        if self._names is None:
            self.engine_digests()
        stage = self._stage(pulled.version)
        want = digests.expected(stage, self._names or [])
        dropped = digests.bytes_dropped(self._empty, want)
        if dropped:  # before any pause: a switch could only fail its check and leave the engine paused
            raise UnverifiableEngine(
                f"vLLM shows no bytes for {len(dropped)} parameters ({', '.join(dropped[:3])}): its CPU backend "
                "keeps them packed for oneDNN and empties the parameters, so /weight_checker cannot verify them"
            )
        self._check_checkout(pulled.version)  # after hashing: a change while hashing is caught here
        return DiskUpdate(pulled.version, pulled.bytes_received, time.perf_counter() - t0, stage, want)

    def _stage(self, version: int) -> Path:
        """Hard-link the checkout's top-level files (what vLLM reads) into ``STAGE_DIR/v<version>``."""
        self.stages.mkdir(exist_ok=True)
        tmp = self.stages / f".tmp-{uuid.uuid4().hex}"
        tmp.mkdir()
        for entry in sorted(self.directory.iterdir()):
            if entry.name.startswith(".") or not entry.is_file():
                continue
            real = entry.resolve()  # a checkout's files are links into its current version
            try:
                os.link(real, tmp / entry.name)
            except OSError:
                shutil.copyfile(real, tmp / entry.name)
        final = self.stages / f"v{version}"
        if final.exists() and (self._good is None or self._good.stage != final):
            shutil.rmtree(final)
        if final.exists():
            shutil.rmtree(tmp)  # the verified stage of this version stays as it is
        else:
            os.rename(tmp, final)
        return final

    def _check_checkout(self, version: int) -> None:
        checkout = Checkout(self.directory)
        state = checkout.state()
        if state is None or state.number != version:
            raise errors.DigestMismatch(f"the checkout {self.directory} no longer holds version {version}")
        with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
            if not checkout.verify(state, pool, deep=True):
                raise errors.DigestMismatch(
                    f"the checkout {self.directory} changed behind its back: its files are not version {version}"
                )

    # --- switch ---------------------------------------------------------------------------

    def switch(self, update: Update) -> SwitchReport:
        """Pause, reload from the stage, check every parameter, then resume on it or on the last good version."""
        if not isinstance(update, DiskUpdate):
            raise errors.InvalidArgument("VllmDisk.switch takes the DiskUpdate its prepare returned")
        previous, good = self.version, self._good
        t0 = time.perf_counter()
        self.client.pause(self.pause_mode)
        self.version = None  # from here until verified, the engine's weights are not known
        failure, mismatched = "", list[str]()
        t_reload = time.perf_counter()
        try:
            self.client.reload(update.stage)
            t_verify = time.perf_counter()
            mismatched = digests.differing(self.engine_digests(), update.want)
        except EngineUnavailable:
            raise
        except EngineError as exc:
            failure, t_verify = str(exc), time.perf_counter()
        t_done = time.perf_counter()
        if not failure and not mismatched:
            self.client.set_weight_version(str(update.version))
            self.client.resume()
            pause_s = time.perf_counter() - t0
            self.version, self._good = update.version, update
            self._drop_stages(keep=update.stage)
            timings = {"reload_s": t_verify - t_reload, "verify_s": t_done - t_verify}
            return SwitchReport(
                update.version,
                previous,
                pause_s,
                "disk",
                len(update.want),
                update.bytes_received,
                update.prepare_s,
                timings,
            )
        why = failure or f"{len(mismatched)} parameters differ from the version ({', '.join(mismatched[:5])})"
        self._roll_back(good, update, why)
        raise SwitchFailed(
            f"vLLM did not switch to version {update.version}: {why}; it serves version {previous} again",
            target=update.version,
            held=previous,
            mismatched=mismatched,
        )

    def _roll_back(self, good: DiskUpdate | None, failed: DiskUpdate, why: str) -> None:
        """Reload the last verified version and resume on it; EngineUnhealthy (still paused) if impossible."""
        if good is None:
            raise EngineUnhealthy(
                f"vLLM failed to switch to version {failed.version} ({why}) and no verified version is staged "
                "to go back to: left paused",
                target=failed.version,
            )
        try:
            self.client.reload(good.stage)
            bad = digests.differing(self.engine_digests(), good.want)
        except EngineUnavailable:
            raise
        except EngineError as exc:
            raise EngineUnhealthy(
                f"vLLM failed to switch to version {failed.version} ({why}) and to reload version "
                f"{good.version} ({exc}): left paused",
                target=failed.version,
            ) from exc
        if bad:
            raise EngineUnhealthy(
                f"vLLM failed to switch to version {failed.version} ({why}) and version {good.version} reloaded "
                f"with {len(bad)} parameters wrong: left paused",
                target=failed.version,
            )
        self.client.set_weight_version(str(good.version))
        self.client.resume()
        self.version = good.version
        if failed.stage != good.stage:
            shutil.rmtree(failed.stage, ignore_errors=True)

    def _drop_stages(self, *, keep: Path) -> None:
        for entry in self.stages.iterdir():
            if entry != keep:
                shutil.rmtree(entry, ignore_errors=True)
