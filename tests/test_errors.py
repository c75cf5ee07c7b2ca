"""The error table (weightsync.errors): each class's code, status, exit code and resource, and its documentation."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from weightsync import errors

ROOT = Path(__file__).resolve().parents[1]

# README "Exit codes": 0 ok, 1 error, 2 usage, 3 conflict (stale parent), 4 auth, 5 server unavailable, 6 not found.
EXPECTED_EXIT = {
    errors.StaleParent: 3,
    errors.Conflict: 3,
    errors.BaseMismatch: 3,
    errors.IncompletePublish: 3,
    errors.RemovesContent: 3,
    errors.PartConflict: 3,
    errors.ParentPending: 3,
    errors.UnmanagedFiles: 3,
    errors.AuthError: 4,
    errors.Forbidden: 4,
    errors.ServerUnavailable: 5,
    errors.StoreUnavailable: 5,
    errors.CatalogUnavailable: 5,
    errors.ModelNotFound: 6,
    errors.VersionNotFound: 6,
    errors.NotFound: 6,
}
# The wire format of docs/API.md, pinned: (code, resource) -> (status, class a client raises).
EXPECTED_WIRE = {
    ("stale-parent", None): (409, errors.StaleParent),
    ("conflict", None): (409, errors.Conflict),
    ("incomplete-publish", None): (409, errors.IncompletePublish),
    ("removes-content", None): (409, errors.RemovesContent),
    ("part-conflict", None): (409, errors.PartConflict),
    ("parent-pending", None): (409, errors.ParentPending),
    ("format-not-readable", None): (406, errors.FormatNotReadable),
    ("invalid-checkpoint", None): (422, errors.InvalidCheckpoint),
    ("base-mismatch", None): (409, errors.BaseMismatch),
    ("not-found", None): (404, errors.NotFound),
    ("not-found", "model"): (404, errors.ModelNotFound),
    ("not-found", "version"): (404, errors.VersionNotFound),
    ("not-found", "publish"): (404, errors.PublishNotFound),
    ("not-found", "object"): (404, errors.ObjectNotFound),
    ("not-supported", None): (404, errors.Unsupported),
    ("invalid-name", None): (422, errors.InvalidName),
    ("invalid-digest", None): (422, errors.InvalidDigest),
    ("invalid-argument", None): (422, errors.InvalidArgument),
    ("digest-mismatch", None): (422, errors.DigestMismatch),
    ("bad-manifest", None): (422, errors.FormatError),
    ("too-large", None): (413, errors.TooLarge),
    ("bad-range", None): (416, errors.InvalidRange),
    ("unauthorized", None): (401, errors.AuthError),
    ("forbidden", None): (403, errors.Forbidden),
    ("unavailable", None): (503, errors.ServerUnavailable),
    ("read-only", None): (405, errors.ReadOnly),
}
# Codes the service sends that no error class names: request shape and HTTP-level cases.
HTTP_ONLY = {"validation", "length-required", "internal"}


def _all_classes() -> list[type[errors.WeightsyncError]]:
    return [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.WeightsyncError)]


def test_the_table_is_the_documented_wire_format() -> None:
    table = errors.problem_classes()
    assert {k: (cls.status, cls) for k, cls in table.items()} == EXPECTED_WIRE
    for (code, resource), cls in table.items():
        assert errors.problem_class(code, resource) is cls
        assert cls.code == code and cls.resource == resource


@pytest.mark.parametrize("cls", _all_classes(), ids=lambda c: c.__name__)
def test_every_class_has_a_coherent_contract(cls: type[errors.WeightsyncError]) -> None:
    assert cls.exit_code == EXPECTED_EXIT.get(cls, errors.EXIT_ERROR)
    assert (
        errors.exit_code_of(cls("x") if cls is not errors.StaleParent else cls("x", current_head=None)) == cls.exit_code
    )
    assert 400 <= cls.status < 600 and cls.code and cls.title
    assert (cls.resource is not None) == (issubclass(cls, errors.NotFound) and cls is not errors.NotFound)
    if cls.status >= 500 and cls.status != 503:
        assert cls.code == "internal"  # a fault of the server: nothing for a client to act on
    # What a client raises for this class's problem exits the CLI the same way.
    decoded = errors.problem_class(cls.code, cls.resource)
    if cls.code != "internal":
        assert decoded is not None and decoded.exit_code == cls.exit_code and decoded.status == cls.status


def test_subclasses_inherit_and_override() -> None:
    assert errors.ChecksumMismatch.code == "bad-manifest" and errors.ChecksumMismatch.status == 422
    assert errors.TooLarge.code == "too-large" and issubclass(errors.TooLarge, errors.LimitExceeded)
    assert errors.ObjectNotFound.status == 404 and errors.ObjectNotFound.exit_code == errors.EXIT_ERROR
    assert issubclass(errors.ObjectNotFound, errors.StoreError)  # still caught as a store error
    assert errors.problem_class("stale-parent") is errors.StaleParent
    assert errors.problem_class("no-such-code") is None
    assert errors.exit_code_of(ValueError("x")) == errors.EXIT_ERROR
    assert errors.exit_code_of(KeyError("x")) == errors.EXIT_ERROR


def test_a_second_class_claiming_a_problem_is_refused_at_definition() -> None:
    with pytest.raises(TypeError, match="both claim problem"):
        type("AnotherConflict", (errors.WeightsyncError,), {"code": "conflict"})
    with pytest.raises(TypeError, match="both claim problem"):
        type("AnotherModelNotFound", (errors.NotFound,), {"resource": "model"})
    assert errors.problem_class("conflict") is errors.Conflict
    # A server-side cause may share a code when it says a client raises another class for it.
    alias = type(
        "QueueUnavailable", (errors.WeightsyncError,), {"code": "unavailable", "status": 503, "client_raises": False}
    )
    assert errors.problem_class("unavailable") is errors.ServerUnavailable and alias.code == "unavailable"


def test_stale_parent_carries_current_head_both_ways() -> None:
    exc = errors.StaleParent("lost", current_head=7)
    assert exc.problem_members() == {"current_head": 7}
    back = errors.StaleParent.from_problem("lost (HTTP 409)", exc.problem_members())
    assert isinstance(back, errors.StaleParent) and back.current_head == 7
    for junk in ("7", True, 7.5, None):
        got = errors.StaleParent.from_problem("x", {"current_head": junk})
        assert isinstance(got, errors.StaleParent) and got.current_head is None
    assert errors.Conflict.from_problem("x", {"current_head": 1}).problem_members() == {}


def test_docs_api_errors_table_lists_every_code() -> None:
    text = (ROOT / "docs" / "API.md").read_text()
    section = text.split("## Errors", 1)[1].split("\n## ", 1)[0]
    documented: dict[str, int] = {}
    for codes, statuses in re.findall(r"^\| (`[^|]+`) \| ([\d /]+) \|", section, flags=re.M):
        for code, status in zip(re.findall(r"`([a-z-]+)`", codes), statuses.split("/"), strict=True):
            documented[code] = int(status)
    claimed = {code: cls.status for (code, _), cls in errors.problem_classes().items()}
    assert {c: s for c, s in documented.items() if c not in HTTP_ONLY} == claimed


def test_readme_exit_codes_match() -> None:
    readme = " ".join((ROOT / "README.md").read_text().split())  # as prose reads: line breaks are spaces
    assert (
        "Exit codes: 0 ok, 1 error, 2 usage, 3 conflict (stale parent, removals), 4 auth, 5 server unavailable,"
        " 6 not found"
    ) in readme
    assert (
        errors.EXIT_OK,
        errors.EXIT_ERROR,
        errors.EXIT_USAGE,
        errors.EXIT_CONFLICT,
        errors.EXIT_AUTH,
        errors.EXIT_UNAVAILABLE,
        errors.EXIT_NOT_FOUND,
    ) == (0, 1, 2, 3, 4, 5, 6)
