"""The named failures of keeping an inference engine on a model's versions.

They carry no problem code (the service never raises them) and are
:class:`weightsync.errors.WeightsyncError` subclasses, so a caller catching "any
weightsync failure" catches them too, and the CLI's exit codes apply.
"""

from __future__ import annotations

from collections.abc import Sequence

from weightsync import errors


class EngineError(errors.WeightsyncError):
    """The engine answered a request with an error (the message is its own, on one line)."""


class EngineUnavailable(EngineError):
    """The engine cannot be reached (not started yet, restarting, or the URL is wrong)."""

    exit_code = errors.EXIT_UNAVAILABLE


class UnverifiableEngine(EngineError):
    """The engine's parameters cannot be derived from the version's tensors, so a switch could not be checked.

    Raised before anything changes: a parameter no checkpoint tensor maps to, a
    layout sliced across ranks, a dtype the checkpoint does not have.
    """


class SwitchFailed(EngineError):
    """A switch to ``target`` did not happen; the engine was put back on ``held`` and serves it again.

    ``mismatched`` names the engine parameters whose digests differed from
    the target version's (empty when the reload itself failed).
    """

    def __init__(self, message: str, *, target: int, held: int | None, mismatched: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.target, self.held, self.mismatched = target, held, tuple(mismatched)


class EngineUnhealthy(EngineError):
    """The engine holds no verified version (a failed switch could not be undone); it is left paused.

    Serving resumes only after a later switch verifies; an operator may also
    restart the engine on a known version.
    """

    def __init__(self, message: str, *, target: int | None = None) -> None:
        super().__init__(message)
        self.target = target
