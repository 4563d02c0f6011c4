"""The command classes every command is built with: usage and help that read like a command
line (the plain help off a wide terminal, so no option name is cut), ``~`` expanded in paths,
and click's usage errors as the command's one line and exit code."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

from precision_convert.cli._common import NOTHING_WRITTEN, reported_errors, say
from precision_convert.core.errors import InputError, home_expanded


def _no_flag_placeholders(params: list[Any]) -> list[Any]:
    """A flag takes no value: no ``<bool>`` after it in the help (``--help`` included); an
    argument is named by its word (``SOURCE``), not followed by its Python type (``<str>``)."""
    for param in params:
        if isinstance(param, TyperOption) and param.is_flag and param.metavar is None:
            param.metavar = ""
        if isinstance(param, TyperArgument):
            param.display_type_rich = _no_type  # type: ignore[method-assign]
    return params


def _no_type(ctx: Any) -> None:
    """An argument's type column in the help: empty (its name column already says it)."""
    return None


#: The narrowest terminal whose boxed help keeps every option name whole. Rich sizes the
#: options table by shrinking its widest columns together: once the help text is narrowed to
#: the width of the longest name, the names are cut with it (``--trust-remote-co…``).
BOXED_HELP_MIN_WIDTH = 100


def _boxed_help_fits() -> bool:
    """Whether typer's boxed help suits where it goes: a terminal at least
    :data:`BOXED_HELP_MIN_WIDTH` wide. A pipe, a file or a narrower terminal gets the plain
    help, whose option names are never cut and whose help text wraps beside or below them."""
    screen = Console()
    return screen.is_terminal and screen.width >= BOXED_HELP_MIN_WIDTH


class _CommandLineHelp:
    """What the group and every command share: flags shown without ``<bool>``, and the boxed
    help only where it fits (:func:`_boxed_help_fits`), click's plain help elsewhere."""

    def get_params(self, ctx: Any) -> list[Any]:
        return _no_flag_placeholders(super().get_params(ctx))  # type: ignore[misc]

    #: The typer class whose boxed help this one replaces off a wide terminal: the help of the
    #: class below it (click's plain one) is used there.
    boxed: type

    def format_help(self, ctx: Any, formatter: Any) -> None:
        if _boxed_help_fits():
            super().format_help(ctx, formatter)  # type: ignore[misc]
        else:
            super(self.boxed, self).format_help(ctx, formatter)  # type: ignore[arg-type]


class Group(_CommandLineHelp, TyperGroup):
    """The command group, its flags (``--version``, ``--help``) shown without ``<bool>``."""

    boxed = TyperGroup


class Command(_CommandLineHelp, TyperCommand):
    """A command whose help reads like a command line: the usage names its arguments as the
    README does (``model [OPTIONS] SOURCE``, not ``{source}``), and a flag shows no value
    placeholder (``--overwrite``, not ``--overwrite <bool>``: a flag takes none)."""

    boxed = TyperCommand

    def invoke(self, ctx: Any) -> Any:
        try:
            ctx.params = {name: expand_home(name, value) for name, value in ctx.params.items()}
        except InputError as exc:  # "~name" of no user: a usage error, one line, exit 2
            raise typer.BadParameter(str(exc)) from None
        # A command wraps everything it may write in reported_errors; a Ctrl-C before that
        # (while its arguments are converted, or its first imports run) wrote nothing, and
        # would otherwise end in typer's silent exit 130.
        with reported_errors():
            return super().invoke(ctx)

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if isinstance(param, TyperArgument):
                name = param.metavar or (param.name or "").upper()
                pieces.append(name if param.required else f"[{name}]")
            else:
                pieces += param.get_usage_pieces(ctx)
        return pieces


#: Parameters that are a path or a name (a Hub id, a recipe): a value starting with ``~`` can
#: only be a path, since no Hub id or recipe name starts with it.
PATH_OR_NAME = frozenset({"source", "baseline", "recipe"})


def expand_home(name: str, value: Any) -> Any:
    """``value`` of the parameter ``name`` with a leading ``~`` expanded to the home folder.

    The shell expands ``~`` only at the start of a word, so ``--output=~/x`` arrives as is and
    would otherwise be written into a folder literally named ``~``. Every path parameter
    (``Path`` values, lists of them) and :data:`PATH_OR_NAME` are expanded here, once, before a
    command runs, so what it writes and prints is the expanded path.
    """
    if isinstance(value, Path):
        return home_expanded(value)
    if isinstance(value, list | tuple) and any(isinstance(v, Path) for v in value):
        return type(value)(expand_home(name, v) for v in value)
    if name in PATH_OR_NAME and isinstance(value, str) and value.startswith("~"):
        return str(home_expanded(value))
    return value


def one_line_usage_errors(app: typer.Typer) -> None:
    """Run ``app`` with a usage error (a missing argument, an unknown option) reported as one
    line on stderr, exit 2, like every other error, instead of typer's box."""
    try:
        code = app(standalone_mode=False)
    except KeyboardInterrupt as exc:  # before any command began (typer building the commands)
        from precision_convert.core import interrupts

        say(f"{interrupts.stopped_by(exc)}; {NOTHING_WRITTEN}")
        sys.exit(interrupts.exit_code(exc))
    except typer.TyperException as exc:  # click's usage errors, as typer vendors them
        message = exc.format_message().strip().rstrip(".")
        context = getattr(exc, "ctx", None)
        see = f"; see {context.command_path} --help" if context is not None else ""
        if message:  # no message: the help was asked for by giving no arguments, and shown
            say(f"{message[:1].lower()}{message[1:]}{see}")
        sys.exit(exc.exit_code)
    except typer.Abort:
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)
