"""vLLM, in-process mode: the sidecar's side, driving the workers' own subscribers over ``/collective_rpc``.

vLLM runs with ``--worker-extension-cls weightsync.engines.vllm_worker.Worker``
and ``VLLM_SERVER_DEV_MODE=1``; each worker then downloads, decodes and applies
versions itself (engines/vllm_worker.py). This adapter only tells them what to
do, through the server's dev routes (docs/ENGINES.md "vLLM in-process mode"):

1. :meth:`VllmInProcess.held`: each worker's verified version (attaching the
   workers first when they are not: they prove which recent version their
   parameters are from the manifests' digests);
2. :meth:`VllmInProcess.prepare`: ``weightsync_prepare`` starts the download and
   decode in a thread of each worker and answers at once (the engine serves
   meanwhile); the adapter polls ``weightsync_status`` until it is ready;
3. :meth:`VllmInProcess.switch`: ``POST /pause?mode=...``, ``weightsync_switch``
   (the element update with its base and result checks, and the layer-wise
   reload of packed modules whose tensors changed), tag the weight version,
   ``POST /resume``. A failed check is undone by the worker: the engine resumes
   on its version (SwitchFailed). A failure the worker could not undo leaves the
   engine paused (EngineUnhealthy).

With ``confirm=True`` the switch is confirmed after the resume (outside the
pause): the SHA-256 that vLLM's ``/weight_checker`` reports for each in-place
parameter must equal the one the worker computes from the views it wrote, which
proves the views are the parameters vLLM serves with.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from weightsync import errors
from weightsync.client.subscriber import Subscriber
from weightsync.engines import errors as engine_errors
from weightsync.engines.base import Engine, SwitchReport, Update
from weightsync.engines.errors import EngineError, EngineUnhealthy, SwitchFailed, UnverifiableEngine
from weightsync.engines.vllm import PAUSE_MODES, PauseMode, VllmClient, by_parameter

WORKER_EXTENSION = "weightsync.engines.vllm_worker.Worker"
"""What ``--worker-extension-cls`` must name."""
RECENT = 8
"""Versions below the head a worker's parameters are compared with when it is attached."""


class RpcClient(VllmClient):
    """:class:`VllmClient` plus the worker extension's calls through ``POST /collective_rpc``."""

    @classmethod
    def of(cls, client: VllmClient) -> RpcClient:
        """``client``'s connection (URL, token, timeouts: one HTTP client, shared) with the extension's calls."""
        if isinstance(client, cls):
            return client
        rpc = cls.__new__(cls)
        rpc.__dict__.update(vars(client))
        return rpc

    def rpc(self, method: str, *args: Any) -> list[dict[str, Any]]:
        """Call ``method`` in every worker; their answers, each a dict (a worker's failure raised again here)."""
        body = {"method": method, "args": list(args)}
        answer = self._call("POST", "/collective_rpc", json=body, slow=True)
        results = answer.get("results") if isinstance(answer, dict) else None
        if not isinstance(results, list) or not results or not all(isinstance(r, dict) for r in results):
            raise EngineError(
                f"vLLM answered {method} without the worker extension's results ({str(answer)[:200]}): "
                f"start it with --worker-extension-cls {WORKER_EXTENSION}"
            )
        for r in results:
            if "error" in r:
                raise failure(r)
        return results


def failure(answer: dict[str, Any]) -> errors.WeightsyncError:
    """The exception a worker answered as ``{"error": class name, "message"}``, raised again by its class."""
    name, message = str(answer.get("error")), str(answer.get("message", ""))
    cls = getattr(engine_errors, name, None) or getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, errors.WeightsyncError):
        try:
            return cls(message)
        except TypeError:  # a class with required keywords (SwitchFailed...)
            pass
    return EngineError(f"vLLM worker: {name}: {message}")


@dataclass(frozen=True)
class WorkerUpdate(Update):
    """A version the workers prepared (downloaded and decoded in their own memory)."""


class VllmInProcess(Engine):
    """Keeps a vLLM server on a model's versions through its workers' own subscribers (module docstring).

    ``client``: the server's root URL, or a :class:`VllmClient` (its token and
    timeouts are kept; :class:`RpcClient` adds the worker extension's calls).
    ``subscriber`` is the sidecar's (its server, model, name and site are given to
    the workers; ``report=False`` is fine: this adapter does not report itself, the
    follow loop reports each switch with its ``mode``, ``elements`` and phases).
    ``token`` is the weightsync token the workers use. ``pause`` says what happens
    to requests in flight during the switch. ``host_dir``: the host store the
    workers of a tensor-parallel engine share on each host (one download per
    host; ``engines/host_store.py``; default ``$WEIGHTSYNC_HOST_DIR``, else
    ``/dev/shm/weightsync``).
    """

    kind = "vllm"
    reports_itself = False

    def __init__(
        self,
        client: VllmClient | str,
        subscriber: Subscriber,
        *,
        token: str | None = None,
        pause: PauseMode = "keep",
        confirm: bool = False,
        prepare_timeout: float = 3600.0,
        poll: float = 0.02,
        host_dir: str | None = None,
    ) -> None:
        if pause not in PAUSE_MODES:
            raise errors.InvalidArgument(f"pause mode {pause!r} is not one of {', '.join(PAUSE_MODES)}")
        self.client = RpcClient(client) if isinstance(client, str) else RpcClient.of(client)
        self.subscriber = subscriber
        self.token = token
        self.pause_mode: PauseMode = pause
        self.confirm = confirm
        self.prepare_timeout = prepare_timeout
        self.poll = poll
        self.host_dir = host_dir
        self.version: int | None = None
        self.last: list[dict[str, Any]] = []
        """Each worker's answer to the last successful switch: ``elements``, ``tensors_in_place``,
        ``tensors_reloaded``, ``modules_reloaded``, ``apply_s``, ``reload_s``..."""

    def close(self) -> None:
        self.client.close()

    # --- what the engine holds ----------------------------------------------------------------

    def status(self) -> list[dict[str, Any]]:
        """Each worker's status (held, update in preparation, layout, counters); attaches them when needed."""
        try:
            answers = self.client.rpc("weightsync_status")
        except errors.InvalidArgument:  # not attached (a new adapter, or the engine restarted)
            return self.attach()
        if any(a.get("attaching") for a in answers):
            return self._attached()
        return answers

    def attach(self) -> list[dict[str, Any]]:
        """Start every worker's subscriber; each proves which recent version its parameters are, in a
        thread of its own while the engine serves (engines/vllm_worker.py ``weightsync_attach``).

        Candidates: the engine's weight-version tag, the version this adapter last
        verified, and the head and the :data:`RECENT` versions below it.
        """
        sub = self.subscriber
        candidates: list[int] = []
        try:
            candidates.append(int(self.client.weight_version()))
        except ValueError:
            pass  # "default": never tagged by weightsync
        if self.version is not None:
            candidates.append(self.version)
        head = sub.api.head(sub.model)
        if head is not None:
            candidates.extend(range(head.number, max(0, head.number - RECENT - 1), -1))
        self.client.rpc(
            "weightsync_attach", sub.api.server, sub.model, candidates, self.token, sub.name, sub.site, self.host_dir
        )
        return self._attached()

    def _attached(self) -> list[dict[str, Any]]:
        """Wait for the workers' attach threads (the engine serves meanwhile), then let each finish its
        attach (the one-time reload of its packed modules); their status, or ``held`` None."""
        deadline = time.monotonic() + self.prepare_timeout
        while True:
            answers = self.client.rpc("weightsync_attached")
            if not any(a.get("attaching") for a in answers):
                return answers
            if time.monotonic() > deadline:
                raise EngineError(f"vLLM workers did not attach in {self.prepare_timeout:g}s")
            time.sleep(self.poll)

    def held(self) -> int | None:
        """The version every worker verified (their subscribers' version), None when they disagree or hold none.

        An adapter without memory (new, or after the engine restarted) attaches the
        workers and then confirms with ``/weight_checker`` that the parameters they
        read are the ones vLLM serves with (:meth:`confirm_views`).
        """
        fresh = self.version is None
        answers = self.status()
        found = {a.get("held") for a in answers}
        held = found.pop() if len(found) == 1 else None
        if held is not None and fresh:
            self.confirm_views()
        self.version = held
        return held

    def confirm_views(self) -> int:
        """``/weight_checker``'s SHA-256 of each in-place parameter equals the worker's of its views; the count.

        UnverifiableEngine otherwise: the worker writes where vLLM does not read.
        """
        engine = by_parameter(self.client.checksums())
        count = 0
        for answer in self.client.rpc("weightsync_sha256"):
            mine = answer["sha256"]
            wrong = sorted(n for n, d in mine.items() if engine.get(n) != d)
            if wrong:
                raise UnverifiableEngine(
                    f"vLLM serves other bytes than the worker's views of {len(wrong)} parameters "
                    f"({', '.join(wrong[:3])}): in-process updates would not reach them"
                )
            count += len(mine)
        return count

    # --- prepare ------------------------------------------------------------------------------

    def prepare(self, version: int) -> WorkerUpdate:
        """Have every worker download and decode ``version`` in the background; return once all are ready."""
        t0 = time.perf_counter()
        if self.version is None:
            self.held()
        self.client.rpc("weightsync_prepare", int(version))
        deadline = time.monotonic() + self.prepare_timeout
        while True:
            answers = self.client.rpc("weightsync_status")
            for a in answers:
                if a.get("prepare_error"):
                    raise failure(a["prepare_error"])
            if all(a.get("ready") and a.get("target") == version for a in answers):
                received = sum(int(a.get("bytes", 0)) for a in answers)
                return WorkerUpdate(int(version), received, time.perf_counter() - t0)
            if time.monotonic() > deadline:
                raise EngineError(f"vLLM workers did not prepare version {version} in {self.prepare_timeout:g}s")
            time.sleep(self.poll)

    # --- switch -------------------------------------------------------------------------------

    def switch(self, update: Update) -> SwitchReport:
        """Pause, apply the prepared version in every worker, tag it, resume (module docstring)."""
        if not isinstance(update, WorkerUpdate):
            raise errors.InvalidArgument("VllmInProcess.switch takes the WorkerUpdate its prepare returned")
        previous = self.version
        t0 = time.perf_counter()
        self.client.pause(self.pause_mode)
        t1 = time.perf_counter()
        try:
            answers = self.client.rpc("weightsync_switch", update.version)
        except errors.WeightsyncError as exc:
            if isinstance(exc, engine_errors.EngineUnavailable):
                self.version = None
                raise
            self._back(previous, update.version, exc)
            raise SwitchFailed(
                f"vLLM did not switch to version {update.version}: {exc}; it serves version {previous} again",
                target=update.version,
                held=previous,
            ) from exc
        t2 = time.perf_counter()
        self.client.set_weight_version(str(update.version))
        self.client.resume()
        t3 = time.perf_counter()
        self.version, self.last = update.version, answers
        timings = {
            "pause_request_s": t1 - t0,
            "switch_rpc_s": t2 - t1,
            "apply_s": max(a["apply_s"] for a in answers),
            "reload_s": max(a["reload_s"] for a in answers),
            "resume_s": t3 - t2,
        }
        if self.confirm:
            self.confirm_views()
            timings["confirm_s"] = time.perf_counter() - t3
        first = answers[0]
        return SwitchReport(
            update.version,
            previous,
            t3 - t0,
            "in-place",
            int(first["tensors_in_place"]) + int(first["tensors_reloaded"]),
            update.bytes_received,
            update.prepare_s,
            timings,
            int(first["elements"]),
        )

    def _back(self, previous: int | None, target: int, why: Exception) -> None:
        """After a failed switch: resume when every worker holds ``previous`` (workers that did switch, as other ranks
        of a tensor-parallel engine may have, are asked to revert first), else EngineUnhealthy (paused)."""
        try:
            answers = self.client.rpc("weightsync_status")
            if previous is not None and any(a.get("held") == target for a in answers):
                answers = self.client.rpc("weightsync_revert", target)
        except errors.WeightsyncError as exc:
            self.version = None
            raise EngineUnhealthy(
                f"vLLM failed to switch to version {target} ({why}) and its workers cannot say what they hold "
                f"({exc}): left paused",
                target=target,
            ) from exc
        if previous is None or any(a.get("held") != previous for a in answers):
            self.version = None
            raise EngineUnhealthy(
                f"vLLM failed to switch to version {target} ({why}) and its workers hold no verified version: "
                "left paused",
                target=target,
            )
        self.client.resume()
        self.version = previous

    def counters(self) -> list[dict[str, int]]:
        """Each worker's counters: switches, failed, elements, tensors_in_place, tensors_reloaded, reloads..."""
        return [a["counters"] for a in self.status()]

    def detach(self) -> None:
        """Stop the workers' subscribers (the engine keeps its weights)."""
        self.client.rpc("weightsync_detach")
        self.version = None
