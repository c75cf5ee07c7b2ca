"""Which tensors a subscriber holds: a slice of a version, named by glob patterns or a predicate.

An inference rank that serves some experts (or one pipeline stage) holds only
their tensors; it fetches, verifies and applies only the frames that change
them (docs/DESIGN.md "Slices"). A selection is given as glob patterns over
tensor names (``fnmatch``: ``*`` matches any run of characters, dots included,
``?`` one, ``[...]`` a set; case-sensitive), any one of which selects a tensor,
or as a predicate ``name -> bool``.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterable

from weightsync import errors

Selection = Iterable[str] | Callable[[str], bool]
"""Glob patterns over tensor names (any one selects), or a predicate."""

__all__ = ["Selection", "file_selector", "selector"]


def selector(tensors: Selection | None) -> Callable[[str], bool] | None:
    """The predicate of a selection (None: every tensor); InvalidArgument for an empty or malformed one.

    A single string is one pattern, not an iterable of one-character patterns.
    """
    if tensors is None:
        return None
    if callable(tensors):
        return tensors
    patterns = [tensors] if isinstance(tensors, str) else list(tensors)
    if not patterns:
        raise errors.InvalidArgument("a tensor selection needs at least one pattern (None selects every tensor)")
    for p in patterns:
        if not isinstance(p, str) or not p:
            raise errors.InvalidArgument(f"a tensor pattern must be a non-empty string, not {p!r}")
    matcher = re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in patterns))
    return lambda name: matcher.match(name) is not None


def file_selector(include: Iterable[str] | None) -> Callable[[str], bool] | None:
    """The predicate of file globs over a version's relative paths (``pull --include``; None: every file).

    ``*`` matches across ``/`` too (``fnmatch``), so ``*.json`` takes every JSON file of the tree.
    """
    if include is None:
        return None
    if isinstance(include, str):
        raise errors.InvalidArgument("include takes a list of file globs, not one string")
    patterns = list(include)
    if not patterns:
        raise errors.InvalidArgument("include needs at least one file glob (None takes every file)")
    return selector(patterns)
