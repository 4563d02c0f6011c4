"""Interrupt the command at seeded random points and check what it leaves behind.

One *trial* starts a command (a conversion, a calibrating conversion, a validation, a batch
run, a push), waits until it has really begun its work, sleeps a delay drawn from
``random.Random(seed)`` and sends SIGKILL, SIGINT, SIGTERM or SIGHUP. Then it checks the
promises of the tool:

- the target path holds nothing, or a complete output: every file byte-identical to what an
  uninterrupted run writes, and, when a certificate is there, one that ``validate --verify``
  accepts. The one other state allowed is a complete output without a certificate when the
  signal cut validation short (conversion commits before it validates; ``validate`` then
  certifies it), and the trial records it;
- the source is byte-identical (a digest of every file before and after);
- SIGINT exits 130, SIGTERM 143 (what ``kill``, ``timeout`` and schedulers send) and SIGHUP
  129, each with one line that says what is on disk, no traceback, and neither its staging
  directory nor its lock left beside the target;
- a rerun succeeds (the same command; ``validate`` for an output whose validation was cut
  short; ``batch --resume``; ``push`` again), and afterwards no staging directory is left.

Commands that build a torch model run in processes forked from a *warm* forkserver (torch,
transformers and this package already imported, so a trial costs seconds, not the minute of
imports a cold start takes on a busy 2-core machine); batch and push run the installed
command in a fresh process, since batch spawns fresh workers anyway and push imports little.
Both are real processes that receive real signals. Source reads are slowed down (see
``_sitecustom/sitecustomize.py``) so that writes span seconds and a signal lands mid-write.

A problem the tool is known to have (a defect in a file this suite does not own) is recorded
in :attr:`Trial.defects` instead of failing the trial; the tests turn it into an ``xfail``
and the bench counts it. Anything else that breaks a promise raises AssertionError.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import multiprocessing
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from _corrupt import cli_env, leftovers, tiny_source, tree_digest
from typer.testing import CliRunner

from precision_convert.cli.main import app

#: The kinds of work a trial interrupts.
KINDS = ("conversion", "calibration", "validation", "batch", "push")
SIGNALS = {
    "SIGKILL": signal.SIGKILL,
    "SIGINT": signal.SIGINT,
    "SIGTERM": signal.SIGTERM,
    "SIGHUP": signal.SIGHUP,
}
#: The signals of the full mode (SIGHUP is handled exactly as SIGTERM: sampled once).
FULL_SIGNALS = ("SIGKILL", "SIGINT", "SIGTERM")
#: Where a trial's processes find the read throttle (``sitecustomize``).
SITECUSTOM = Path(__file__).with_name("_sitecustom")
#: Seconds of sleep per 256 KiB source chunk: an 8 MiB source takes ~3 s to write.
READ_DELAY = 0.1
#: How the CLI says that an interrupted run left nothing (older and newer wording).
_NOTHING_WRITTEN = ("no output was written", "nothing was written")
#: Seconds between a SIGINT and an exit 0 within which the signal came too late to matter.
_LATE_S = 1.0
#: What the forkserver imports once, so that each forked command starts warm.
_PRELOAD = [
    "torch",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "precision_convert.cli.main",
    "precision_convert.cli.model",
    "precision_convert.cli.validate",
    "precision_convert.api.conversion",
    "precision_convert.validation.calibration.plans",
    "precision_convert.validation.certify.runner",
]
#: Models the trials convert: 8 MiB of fp32 without an architecture (a plain cast needs no
#: model), and a small Llama (calibration and validation run it).
_PLAIN_STATE = {
    **{
        f"layers.{i}.weight": torch.randn(512, 1024, generator=torch.Generator().manual_seed(i))
        for i in range(4)
    },
    "position_ids": torch.arange(64, dtype=torch.int64),
}


@dataclass
class Trial:
    """One interrupted run and what it left behind."""

    kind: str
    signal: str  # a key of SIGNALS
    seed: int
    delay: float = 0.0  # seconds after the command began its work
    interrupted: bool = False  # the command was still running when the signal arrived
    late: bool = False  # the signal arrived as it exited after finishing (exit 0)
    swallowed: bool = False  # SIGINT/SIGTERM arrived, but it did not exit 128+signal (a defect)
    returncode: int | None = None
    stderr: str = ""
    left: str = ""  # what the target held: nothing, certified, complete, uncertified
    defects: list[str] = field(default_factory=list)  # known defects it ran into

    def defect(self, what: str) -> None:
        self.defects.append(what)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "signal": self.signal,
            "seed": self.seed,
            "delay": round(self.delay, 3),
            "interrupted": self.interrupted,
            "late": self.late,
            "swallowed": self.swallowed,
            "returncode": self.returncode,
            "left": self.left,
            "defects": self.defects,
        }


# --------------------------------------------------------------------------- processes


class Child:
    """A running command: a forked warm process or a fresh subprocess, leading its own process
    group (signals go to the group, as a terminal's Ctrl-C does)."""

    def __init__(self, pid: int, wait: Callable[[float], int | None], logs: Path) -> None:
        self.pid = pid
        self._wait = wait
        self.logs = logs

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:  # not yet its own group leader
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def poll(self) -> int | None:
        return self._wait(0)

    def wait(self, timeout: float = 300) -> int:
        code = self._wait(timeout)
        if code is None:
            self.signal(signal.SIGKILL)
            code = self._wait(30)
            raise AssertionError(f"the command did not finish within {timeout} s")
        return code

    @property
    def stdout(self) -> str:
        return (self.logs / "stdout").read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return (self.logs / "stderr").read_text(errors="replace")

    @property
    def started(self) -> bool:
        return (self.logs / "started").exists()


def _forked_main(
    args: list[str], cwd: str, logs: str, env: dict[str, str], max_file_size: int | None
) -> None:
    """The forked command: its own session and logs, SIGINT at Python's default, slow reads,
    and optionally a cap on the size of any file it writes (``RLIMIT_FSIZE``: a disk that
    fills up; SIGXFSZ ignored, so that the write fails with EFBIG instead of killing it)."""
    os.setsid()
    if max_file_size is not None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_size, max_file_size))
    os.chdir(cwd)
    os.environ.update(env)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        target = os.open(os.path.join(logs, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", encoding="utf-8", closefd=False, buffering=1)  # noqa: SIM115
    sys.stderr = open(2, "w", encoding="utf-8", closefd=False, buffering=1)  # noqa: SIM115
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _throttle_module().throttle(READ_DELAY)
    sys.argv = ["precision-convert", *args]
    Path(logs, "started").touch()
    from precision_convert.cli.main import run

    run()


def _throttle_module() -> Any:
    spec = importlib.util.spec_from_file_location("_pc_throttle", SITECUSTOM / "sitecustomize.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_FORKSERVER: Any = None


def _context() -> Any:
    global _FORKSERVER
    if _FORKSERVER is None:
        _FORKSERVER = multiprocessing.get_context("forkserver")
        _FORKSERVER.set_forkserver_preload(_PRELOAD)
    return _FORKSERVER


def fork_cli(
    args: list[str],
    cwd: Path,
    logs: Path,
    env: dict[str, str] | None = None,
    *,
    max_file_size: int | None = None,
) -> Child:
    """``precision-convert ARGS`` in a process forked from the warm forkserver."""
    logs.mkdir(parents=True, exist_ok=True)
    process = _context().Process(
        target=_forked_main,
        args=(args, str(cwd), str(logs), dict(env or {}), max_file_size),
        daemon=False,
    )
    process.start()

    def wait(timeout: float) -> int | None:
        process.join(timeout)
        return process.exitcode

    return Child(process.pid, wait, logs)


#: The console script with SIGINT at Python's default (a child inherits an ignored SIGINT).
_SCRIPT = (
    "import signal, sys, pathlib\n"
    "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
    "logs = sys.argv.pop(1)\n"
    "from precision_convert.cli.main import run\n"
    "pathlib.Path(logs, 'started').touch()\n"
    "sys.argv[0] = 'precision-convert'\n"
    "run()\n"
)


def spawn_cli(args: list[str], cwd: Path, logs: Path, env: dict[str, str]) -> Child:
    """``precision-convert ARGS`` in a fresh interpreter (its own session), reads slowed down
    in it and in every Python process it starts."""
    logs.mkdir(parents=True, exist_ok=True)
    full_env = {
        **env,
        "PYTHONPATH": os.pathsep.join([str(SITECUSTOM), env.get("PYTHONPATH", "")]),
        "PC_TEST_READ_DELAY": str(READ_DELAY),
    }
    with (logs / "stdout").open("w") as out, (logs / "stderr").open("w") as err:
        process = subprocess.Popen(
            [sys.executable, "-c", _SCRIPT, str(logs), *args],
            cwd=cwd,
            env=full_env,
            stdout=out,
            stderr=err,
            start_new_session=True,
        )

    def wait(timeout: float) -> int | None:
        try:
            return process.wait(timeout) if timeout else process.poll()
        except subprocess.TimeoutExpired:
            return None

    return Child(process.pid, wait, logs)


def interrupt(
    trial: Trial,
    child: Child,
    ready: Callable[[], bool],
    window: float,
) -> None:
    """Once ``ready()`` holds (the command has begun the work under test), wait a seeded
    random part of ``window`` seconds and send the trial's signal; then wait for the end.

    ``trial.interrupted`` says whether the command was still running when the signal came
    (a draw past its end finds it finished: the trial then checks a complete run).
    """
    sig = SIGNALS[trial.signal]
    fraction = random.Random(f"{trial.kind}-{trial.signal}-{trial.seed}").random()
    deadline = time.monotonic() + 300
    while not (child.started and ready()):
        if child.poll() is not None:
            break
        assert time.monotonic() < deadline, "the command never reached the work under test"
        time.sleep(0.01)
    trial.delay = fraction * window
    end = time.monotonic() + trial.delay
    while time.monotonic() < end and child.poll() is None:
        time.sleep(0.005)
    trial.interrupted = child.poll() is None
    if trial.interrupted:
        child.signal(sig)
    signalled = time.monotonic()
    trial.returncode = child.wait()
    went_on = time.monotonic() - signalled
    trial.stderr = child.stderr
    if not trial.interrupted or trial.returncode in (exit_code(trial.signal), -signal.SIGKILL):
        return
    if trial.returncode in (0, -sig) and went_on < _LATE_S:
        # A signal that lands while the interpreter shuts down after the work is done (the
        # command had already returned) changes nothing: a finished run, checked as one. Late
        # in that shutdown the interpreter has put the signal's default action back, so the
        # signal kills it (-sig); a kill before the work was done fails that check.
        trial.interrupted, trial.late = False, True
        return
    trial.swallowed = True
    if went_on >= _LATE_S:
        # A library caught the KeyboardInterrupt (e.g. torch's import of numpy, which a
        # Ctrl-C during start-up interrupts) and the command went on as if nothing happened.
        trial.defect(
            f"Ctrl-C swallowed: the command went on for {went_on:.1f} s and exited "
            f"{trial.returncode}"
        )
    else:
        # Only a Ctrl-C has a known way to go astray (typer's silent exit before the command
        # began); a SIGTERM or SIGHUP that kills the process is a failure.
        wrong = (
            f"{trial.signal} exit code: {trial.returncode}, not {exit_code(trial.signal)} "
            f"({trial.stderr[-200:]!r})"
        )
        assert trial.signal == "SIGINT", wrong
        trial.defect(wrong)


# --------------------------------------------------------------------------- checks


def digest_without_certificate(root: Path) -> dict[str, str]:
    """Every file of an output except the certificate and the card (they carry a time)."""
    return {
        name: value
        for name, value in tree_digest(root).items()
        if name != "README.md" and not name.startswith("precision_certificate")
    }


def run_in_process(args: list[str]) -> Any:
    """The command in this process (already warm): used for reruns and references."""
    result = CliRunner().invoke(app, args)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"{args}: {result.exception!r}\n{result.stderr}")
    return result


def verify(output: Path) -> None:
    """``validate --verify`` accepts ``output``'s files and certificate."""
    done = run_in_process(["validate", str(output), "--verify"])
    assert done.exit_code == 0, (output, done.stdout, done.stderr)


def check_output(trial: Trial, output: Path, reference: Path, *, certifies: bool) -> None:
    """The target holds nothing, or a complete output (see the module docstring)."""
    if not output.exists() and not output.is_symlink():
        trial.left = "nothing"
        return
    assert output.is_dir() and not output.is_symlink(), output
    assert digest_without_certificate(output) == digest_without_certificate(reference), (
        f"{output} is not the complete output"
    )
    has_certificate = any(output.glob("precision_certificate*.json"))
    if has_certificate:
        try:
            verify(output)
        except AssertionError as exc:
            # Validation writes the certificate, then the card, neither inside a staging
            # directory: a kill between the two leaves a card that quotes another certificate.
            trial.defect(f"certificate or card left inconsistent by the interruption: {exc}")
        trial.left = "certified"
    elif certifies:
        trial.left = "uncertified"  # validation was cut short after the commit
    else:
        trial.left = "complete"


def check_signal_exit(
    trial: Trial, holds_output: bool, truthful: Callable[[str], bool] | None
) -> None:
    """SIGKILL: killed. Any other: exit 128 + the signal, one line that says what is on disk,
    no traceback.

    ``holds_output``: whether the target holds something now; then the line must not say that
    nothing was written, and ``truthful(line)`` (e.g. "it names the output") must hold. Without
    output the line must say that nothing was written.
    """
    if not trial.interrupted or trial.swallowed:
        return
    if trial.signal == "SIGKILL":
        assert trial.returncode == -signal.SIGKILL, (trial.returncode, trial.stderr)
        return
    assert trial.returncode == exit_code(trial.signal), (trial.returncode, trial.stderr)
    if not trial.stderr.strip():
        # typer turns a KeyboardInterrupt that escapes the command into a silent exit 130:
        # Ctrl-C while a command still imports what it needs, before its error handler.
        trial.defect("interrupted before the command's error handler: exit 130, no message")
        return
    if "Traceback" in trial.stderr:
        trial.defect(f"Ctrl-C printed a traceback: {trial.stderr[-300:]!r}")
        return
    line = last_line(trial.stderr)
    assert line.startswith("precision-convert: interrupted"), trial.stderr
    if holds_output and (says_nothing(line) or (truthful is not None and not truthful(line))):
        trial.defect(f"interrupted with output on disk, the message says: {line!r}")
    if not holds_output:
        assert says_nothing(line) or truthful is None, line


def exit_code(sig: str) -> int:
    """What a command stopped by ``sig`` (a key of :data:`SIGNALS`) exits with: 128 + the
    signal, as a shell reports it (130 for SIGINT, 143 for SIGTERM, 129 for SIGHUP)."""
    return 128 + SIGNALS[sig]


def check_cleaned_up(trial: Trial, parent: Path) -> None:
    """A command that a catchable signal stopped removed its staging directory and its lock
    before it exited: nothing of it is left beside the target for a rerun to clean up (a
    SIGKILL leaves them; the next run removes them)."""
    if trial.interrupted and trial.signal != "SIGKILL" and not trial.swallowed:
        left = [p.name for p in parent.iterdir() if p.name.endswith(".pc-lock")]
        assert leftovers(parent) + left == [], (leftovers(parent) + left, trial.stderr)


def last_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert lines, "nothing on stderr"
    return lines[-1]


def says_nothing(line: str) -> bool:
    """The line says the interrupted run left nothing on disk."""
    return any(phrase in line for phrase in _NOTHING_WRITTEN)


# --------------------------------------------------------------------------- the kinds


class Sources:
    """The models the trials use, and what an uninterrupted run of each command writes (each
    built on first use, once)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    @functools.cached_property
    def plain(self) -> Path:
        """8 MiB of fp32 without an architecture: a plain cast, no model built."""
        return tiny_source(self.root / "plain", _PLAIN_STATE)

    @functools.cached_property
    def llama(self) -> Path:
        """A small Llama: calibration and validation run it."""
        import _models

        return _models.save("llama", self.root / "llama")

    @functools.cached_property
    def plain_reference(self) -> Path:
        return self._reference("plain-bf16", self.plain, ["--to", "bf16", "--no-validate"])

    @functools.cached_property
    def calibrated_reference(self) -> Path:
        return self._reference("llama-fp16-safe", self.llama, CALIBRATE)

    @functools.cached_property
    def certified_reference(self) -> Path:
        return self._reference("llama-bf16", self.llama, VALIDATE)

    @functools.cached_property
    def safe_reference(self) -> Path:
        return self._reference("llama-bf16-safe", self.llama, ["--to", "bf16-safe", *QUICK])

    def batch_reference(self, target: str) -> Path:
        """A batch job's output holds what ``model`` writes for its target."""
        return self.certified_reference if target == "bf16" else self.safe_reference

    def _reference(self, name: str, source: Path, args: list[str]) -> Path:
        output = self.root / "references" / name
        done = run_in_process(["model", str(source), *args, "-o", str(output)])
        assert done.exit_code == 0, (args, done.stderr)
        return output


#: The calibrating conversion and the validating one (the probe budget kept small).
QUICK = ["--coverage", "quick"]
CALIBRATE = ["--to", "fp16-safe", "--no-validate", *QUICK]
VALIDATE = ["--to", "bf16", *QUICK]
#: A batch of two jobs (so that one may be finished when the other is interrupted).
_BATCH_TARGETS = ("bf16", "bf16-safe")


def _write_manifest(root: Path, llama: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    manifest = root / "batch.toml"
    manifest.write_text(
        f'[defaults]\nto = {json.dumps(list(_BATCH_TARGETS))}\noutput_dir = "out"\n'
        f'coverage = "quick"\n\n[[model]]\nsource = "{llama}"\n'
    )
    return manifest


def _staging_exists(parent: Path, target: Path) -> Callable[[], bool]:
    prefix = f".{target.name}.pc-staging-"
    return lambda: any(p.name.startswith(prefix) for p in parent.iterdir())


def staged_weights(parent: Path, target: Path) -> Callable[[], bool]:
    """The conversion has written its weights into the staging directory: it validates there
    next, before the output is renamed into place."""
    prefix = f".{target.name}.pc-staging-"
    return lambda: any(
        p.name.startswith(prefix) and (p / "model.safetensors").is_file() for p in parent.iterdir()
    )


def _convert_trial(
    trial: Trial,
    work: Path,
    source: Path,
    args: list[str],
    reference: Path,
    ready: Callable[[Path], Callable[[], bool]],
    window: float,
    *,
    certifies: bool,
) -> None:
    """A ``model`` command interrupted, checked, rerun."""
    before = tree_digest(source)
    target = work / "out"
    child = fork_cli(["model", str(source), *args, "-o", str(target)], work, work / "logs")
    interrupt(trial, child, ready(target), window)
    check_output(trial, target, reference, certifies=certifies)
    check_signal_exit(trial, trial.left != "nothing", lambda line: str(target) in line)
    check_cleaned_up(trial, work)
    assert tree_digest(source) == before, "the source changed"
    if trial.left == "uncertified":
        rerun = run_in_process(["validate", str(target), "--coverage", "quick"])
    else:
        overwrite = ["--overwrite"] if trial.left != "nothing" else []
        rerun = run_in_process(["model", str(source), *args, "-o", str(target), *overwrite])
    assert rerun.exit_code == 0, rerun.stderr
    assert leftovers(work) == [], leftovers(work)
    assert digest_without_certificate(target) == digest_without_certificate(reference)
    if certifies:
        verify(target)


def conversion(trial: Trial, work: Path, sources: Sources) -> None:
    """``model PLAIN --to bf16 --no-validate``, signalled while the weights are written."""
    _convert_trial(
        trial,
        work,
        sources.plain,
        ["--to", "bf16", "--no-validate"],
        sources.plain_reference,
        lambda target: _staging_exists(work, target),
        window=3.0,
        certifies=False,
    )


def calibration(trial: Trial, work: Path, sources: Sources) -> None:
    """``model LLAMA --to fp16-safe --no-validate``: calibration runs the model on probes
    (and the island search) before anything is written; signalled anywhere in the run."""
    _convert_trial(
        trial,
        work,
        sources.llama,
        CALIBRATE,
        sources.calibrated_reference,
        lambda target: lambda: True,
        window=6.0,
        certifies=False,
    )


def validation(trial: Trial, work: Path, sources: Sources) -> None:
    """Even seeds: ``model LLAMA --to bf16`` signalled once its weights are staged, i.e.
    while it validates (before the output is renamed into place). Odd seeds: ``validate OUT``
    on a complete, uncertified output."""
    if trial.seed % 2 == 0:
        _convert_trial(
            trial,
            work,
            sources.llama,
            VALIDATE,
            sources.certified_reference,
            lambda target: staged_weights(work, target),
            window=0.8,
            certifies=True,
        )
        return
    before = tree_digest(sources.llama)
    target = work / "out"
    shutil.copytree(sources.certified_reference, target)
    for certified in (*target.glob("precision_certificate*.json"), target / "README.md"):
        certified.unlink()
    args = ["validate", str(target), "--baseline", str(sources.llama), "--coverage", "quick"]
    child = fork_cli(args, work, work / "logs")
    interrupt(trial, child, lambda: True, window=0.9)
    check_output(trial, target, sources.certified_reference, certifies=True)
    check_signal_exit(trial, True, lambda line: str(target) in line)
    check_cleaned_up(trial, work)
    assert tree_digest(sources.llama) == before, "the baseline changed"
    rerun = run_in_process(args)
    assert rerun.exit_code == 0, rerun.stderr
    verify(target)
    assert leftovers(work) == []


def batch(trial: Trial, work: Path, sources: Sources) -> None:
    """``batch`` (one Llama, two targets, one worker) in a fresh process, signalled anywhere;
    rerun with ``--resume``."""
    before = tree_digest(sources.llama)
    manifest = _write_manifest(work, sources.llama)
    # The driver forks warm; its workers are fresh interpreters, slowed down like it.
    slow = {"PYTHONPATH": str(SITECUSTOM), "PC_TEST_READ_DELAY": str(READ_DELAY)}
    child = fork_cli(["batch", str(manifest), "--jobs", "1"], work, work / "logs", slow)
    out = work / "out"
    interrupt(trial, child, lambda: True, window=15.0)
    states = []
    for target in _BATCH_TARGETS:
        job = Trial(trial.kind, trial.signal, trial.seed)
        check_output(job, out / f"llama-{target}", sources.batch_reference(target), certifies=True)
        trial.defects += job.defects
        states.append(job.left)
    trial.left = ",".join(states)
    # Finished jobs are kept: the line must not say that nothing was written.
    check_signal_exit(trial, any(state != "nothing" for state in states), None)
    check_cleaned_up(trial, out)
    assert tree_digest(sources.llama) == before, "the source changed"
    rerun = run_in_process(["batch", str(manifest), "--resume"])
    assert rerun.exit_code == 0, rerun.stderr
    assert leftovers(out) == [], leftovers(out)
    for target in _BATCH_TARGETS:
        output = out / f"llama-{target}"
        reference = sources.batch_reference(target)
        assert digest_without_certificate(output) == digest_without_certificate(reference)
        verify(output)


def hub_env(endpoint: str, token: str, home: Path) -> dict[str, str]:
    """A command's environment for talking to the (fake) Hub at ``endpoint`` with ``token``."""
    env = {k: v for k, v in cli_env().items() if not k.startswith(("HF_", "HUGGING"))}
    env.update(
        HF_ENDPOINT=endpoint,
        HF_TOKEN=token,
        HF_HUB_DISABLE_XET="1",
        HF_HUB_OFFLINE="0",
        HF_HOME=str(home / ".hf-home"),
        HF_HUB_DISABLE_TELEMETRY="1",
    )
    return env


@contextlib.contextmanager
def slowed_hub(hub: Any, seconds: float) -> Iterator[None]:
    """Every request to ``hub`` waits ``seconds`` first: a push spans a few seconds."""
    fault = hub.inject(r".", before=lambda: time.sleep(seconds))
    try:
        yield
    finally:
        hub.faults.remove(fault)


def push(
    trial: Trial,
    work: Path,
    sources: Sources,
    hub: Any,
    env: dict[str, str],
    rerun: Callable[[list[str]], Any],
) -> None:
    """``push OUT REPO`` in a fresh process against the fake Hub, signalled anywhere; the
    repo then holds nothing of it or all of it, the local output is untouched, and a second
    push completes it."""
    output = work / "certified"
    shutil.copytree(sources.certified_reference, output)
    before = tree_digest(output)
    repo_id = f"ns/interrupted-{trial.signal.lower()}-{trial.seed}"
    with slowed_hub(hub, 0.3):
        child = spawn_cli(["push", str(output), repo_id], work, work / "logs", env)
        interrupt(trial, child, lambda: True, window=6.0)
    local = {
        p.relative_to(output).as_posix(): p.read_bytes() for p in output.rglob("*") if p.is_file()
    }
    # The card as pushed names the repo in its loading snippet; every other byte is the same.
    local["README.md"] = local["README.md"].replace(
        b'"<this repo or dir>"', f'"{repo_id}"'.encode()
    )
    repo = hub.repos.get(repo_id)
    remote = {} if repo is None or "main" not in repo.refs else hub.files(repo_id)
    remote.pop(".gitattributes", None)
    assert remote in ({}, local), f"{repo_id} holds part of the output: {sorted(remote)}"
    trial.left = "pushed" if remote else "nothing"
    # Nothing local is written either way; the line must say what happened.
    check_signal_exit(trial, True, lambda line: str(output) in line)
    assert tree_digest(output) == before, "push changed the local output"
    done = rerun(["push", str(output), repo_id])
    assert done.exit_code == 0, done.stderr
    pushed = hub.files(repo_id)
    pushed.pop(".gitattributes")
    assert pushed == local
