"""The one interface every engine adapter has: hold version N, prepare N+1, switch, verify, report.

An adapter keeps one inference engine (a vLLM server, an SGLang server, a
PyTorch module) on one model's versions. The work is split where serving is
not affected: :meth:`Engine.prepare` downloads and stages the next version while
the engine serves; :meth:`Engine.switch` is the only part that pauses serving
(it changes the weights, checks them and resumes); :meth:`Engine.held` asks the
engine what it holds, from its own weights, never from the adapter's memory
(after an engine restart the adapter's memory is wrong).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True)
class Update:
    """A version made ready for a switch, off the critical path."""

    version: int
    bytes_received: int
    """Bytes over the network to prepare it."""
    prepare_s: float


@dataclass(frozen=True)
class SwitchReport:
    """What a switch did: the version the engine holds now and how long serving paused."""

    version: int
    """The version the engine holds and serves now (verified when ``checked`` > 0)."""
    previous: int | None
    pause_s: float
    """From the pause request to the resume's answer: the change of weights and their check."""
    mode: str
    """How the weights changed: ``disk`` (reload from a directory), ``in-place`` or ``reload`` (tensors
    replaced whole); the replica ledger's ``mode`` (docs/API.md, Replica)."""
    checked: int
    """Engine parameters whose bytes were checked against the version (0: not checked)."""
    bytes_received: int = 0
    prepare_s: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds per phase (``reload_s``, ``verify_s`` inside the pause; ``apply_s``...)."""
    elements: int | None = None
    """Elements changed, where the switch changes elements in place (None: reloaded whole)."""

    def ledger_extra(self) -> dict[str, Any]:
        """The free-form ``extra`` of this switch's replica report: what the ledger has no column for.

        The version, pause, bytes and ``mode`` travel as the report's own fields (and the status and
        engine, which the caller knows).
        """
        out: dict[str, Any] = {"checked": self.checked, "prepare_s": round(self.prepare_s, 4)}
        out.update({k: round(v, 4) for k, v in self.timings.items()})
        if self.elements is not None:
            out["elements"] = self.elements
        return out


class Engine(ABC):
    """An inference engine kept on one model's versions (see the module docstring).

    ``version`` is the version the adapter last verified the engine to hold
    (None: unknown). One switch at a time; :meth:`prepare` may run in another
    thread while the engine serves.
    """

    kind: ClassVar[str]
    """The engine's name on the command line (``vllm``, ``torch``...)."""
    reports_itself: ClassVar[bool] = False
    """True when the adapter's own subscriber already reports each switch to the replica ledger."""

    version: int | None = None

    @abstractmethod
    def held(self) -> int | None:
        """Ask the engine which version it holds, proven from its weights where the engine can show them."""

    @abstractmethod
    def prepare(self, version: int) -> Update:
        """Make ``version`` ready for :meth:`switch` while the engine serves (download, stage, precompute)."""

    @abstractmethod
    def switch(self, update: Update) -> SwitchReport:
        """Pause, change the engine's weights to ``update``'s version, verify them, resume.

        On failure the engine is back on :attr:`version` and serving
        (SwitchFailed), or left paused holding no verified version (EngineUnhealthy).
        """

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the adapter holds (connections); the engine itself keeps running."""

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
