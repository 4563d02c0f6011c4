"""The ``precision-convert`` command: a thin Typer app; each command lives in its own module."""

from __future__ import annotations

import gc
import io
import os
import sys
import warnings
from typing import Annotated

import typer

from precision_convert.cli import batch as batch_cmd
from precision_convert.cli import inspect as inspect_cmd
from precision_convert.cli import model as model_cmd
from precision_convert.cli import push as push_cmd
from precision_convert.cli import recipes as recipes_cmd
from precision_convert.cli import validate as validate_cmd
from precision_convert.cli._commands import Command, Group, one_line_usage_errors
from precision_convert.cli._common import say
from precision_convert.conversion.runtime.memory import own_heap
from precision_convert.core import interrupts
from precision_convert.core.hub_client import bound_hub_requests
from precision_convert.core.imports import when_imported

app = typer.Typer(
    name="precision-convert",
    help="Rewrite PyTorch checkpoints to bf16/fp16 safely: fp32 islands where the numbers "
    "need them, a recorded dtype map, and a parity certificate against fp32.",
    no_args_is_help=True,
    add_completion=False,
    # Rich tracebacks print local variables, and push handles tokens: never show them.
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
    cls=Group,
)
app.command("model", cls=Command)(model_cmd.model)
app.command("inspect", cls=Command)(inspect_cmd.inspect)
app.command("validate", cls=Command)(validate_cmd.validate_command)
app.command("push", cls=Command)(push_cmd.push_command)
app.command("batch", cls=Command)(batch_cmd.batch)
app.command("recipes", cls=Command)(recipes_cmd.recipes)


def _version(value: bool) -> None:
    if value:
        from precision_convert.core._version import __version__

        typer.echo(f"precision-convert {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Show the version."),
    ] = False,
) -> None:
    """Rewrite PyTorch checkpoints to bf16/fp16 safely."""


def run() -> None:
    """Console-script entry point."""
    try:
        os.getcwd()
    except FileNotFoundError:
        # Deleted under a shell still in it: every relative path (a default output, the
        # libraries' own lookups) would fail later with a bare "No such file or directory".
        say("the current directory no longer exists: cd to one that does and run again")
        sys.exit(2)
    if isinstance(sys.stdout, io.TextIOWrapper):
        # What a stdout that is not UTF-8 cannot encode (typer's help on a LANG=C terminal)
        # is written as an escape, as on stderr, not a crash; the reports spell their own
        # symbols in ASCII there (see _common.encodable).
        sys.stdout.reconfigure(errors="backslashreplace")
    # First, so that a SIGTERM or SIGHUP from here on ends in the command's one line and exit
    # code (143, 129) like a Ctrl-C, with its cleanup, not in a silent death that leaves the
    # lock and staging directory behind. Every such signal is recorded as well as raised: one
    # that something swallows on its way up (seen while torch imports numpy) still stops the
    # run before it renames an output into place or commits to the Hub.
    interrupts.watch()
    # transformers/diffusers draw their own tqdm bars ("Loading weights") on every model they
    # build; the command shows one progress display of its own instead.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # torch.load's notes about pickle protocols would break the one-line-on-stderr contract
    # for a checkpoint we reject; the command owns its process, so it filters them here.
    warnings.filterwarnings("ignore", module=r"torch\.(serialization|_weights_only_unpickler)")
    bound_hub_requests()  # the command owns its process
    # torch's import leaves some 165,000 objects that live as long as the process, and each
    # full collection after it (one more at exit) walks them all again: a fifth of a small
    # run's time. Frozen once torch is in, the collector leaves them be.
    when_imported("torch", lambda _: gc.freeze())
    # Peak memory that follows what is live, not the heap's history (a hooked forward's freed
    # activations otherwise stay in the heap between live ones), without a page fault for
    # every activation of every other forward.
    own_heap()
    try:
        one_line_usage_errors(app)
    except SystemExit as done:
        if interrupts.terminating():
            # SIGTERM or SIGHUP: the run has cleaned up and said so; the interpreter's own
            # teardown (freeing a big model object by object) would hold the exit for
            # seconds a scheduler does not wait, so the process ends here.
            interrupts.exit_now(done.code)
        raise
