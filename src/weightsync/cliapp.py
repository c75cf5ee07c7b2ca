"""The shape every weightsync command line shares: plain help, and usage errors in one line.

:func:`new_app` makes the typer app of ``weightsync`` (and of ``python -m weightsync.service``).
Its help is click's plain layout (no boxes; flags show no value placeholder; text in
brackets such as ``[default: …]`` is printed as written, not read as markup). A usage
error is one line on stderr, exit status 2::

    weightsync: error: No such option: --bogus (see weightsync push --help)

Imports nothing heavy: the client-only install runs every client command through it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import typer
from typer.core import TyperGroup

__all__ = ["OneLineErrors", "new_app", "usage_line"]


def _click_class(name: str) -> type[Exception]:
    """The click exception class `name` that typer raises (typer ships its own copy of click since 0.20)."""
    return next(c for c in typer.BadParameter.__mro__ if c.__name__ == name)


_ClickException = _click_class("ClickException")
_UsageError = _click_class("UsageError")


def usage_line(exc: Exception, program: str) -> str:
    """A click exception as one line: the message, then where the help of the command that refused it is.

    `program` is named when the error does not say which command refused it.
    """
    message = " ".join(exc.format_message().split()).removesuffix(".")  # type: ignore[attr-defined]
    ctx = getattr(exc, "ctx", None)
    where = f" (see {ctx.command_path if ctx is not None else program} --help)" if isinstance(exc, _UsageError) else ""
    return f"weightsync: error: {message}{where}"


class OneLineErrors(TyperGroup):
    """A command group that reports usage errors in one line instead of click's usage block.

    Everything else is typer's: ``--help``, exit codes raised by commands, Ctrl-C (130).
    """

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        windows_expand_args: bool = True,
        **extra: Any,
    ) -> Any:
        """click's ``main`` (same arguments), with usage errors reported in one line."""
        try:
            code = super().main(args, prog_name, complete_var, False, windows_expand_args, **extra)
        except _ClickException as exc:
            if type(exc).__name__ == "NoArgsIsHelpError":  # no arguments at all: the help, as click prints it
                typer.echo(exc.ctx.get_help(), err=True)  # type: ignore[attr-defined]
            else:
                typer.echo(usage_line(exc, self._path(prog_name or self.name or "weightsync", args)), err=True)
            code = exc.exit_code  # type: ignore[attr-defined]
        except typer.Abort:  # a prompt answered with Ctrl-C or end of input
            typer.echo("weightsync: error: aborted", err=True)
            code = 1
        if not standalone_mode:
            return code
        sys.exit(code if isinstance(code, int) else 0)

    def _path(self, program: str, args: Sequence[str] | None) -> str:
        """The command the arguments name (``weightsync pull``): for errors that do not say which refused them."""
        path: list[str] = [program]
        group: object = self
        for word in sys.argv[1:] if args is None else args:
            group = getattr(group, "commands", {}).get(word)
            if group is None:
                break
            path.append(word)
        return " ".join(path)


def new_app(name: str, help: str | None = None) -> typer.Typer:
    """A typer app named `name` (the program name in messages) with one-line usage errors and plain help."""
    return typer.Typer(
        name=name,
        help=help,
        cls=OneLineErrors,
        add_completion=False,
        no_args_is_help=True,
        rich_markup_mode=None,
        pretty_exceptions_enable=False,
    )
