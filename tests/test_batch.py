"""``precision-convert batch``: the manifest checked up front, failures isolated, ``--resume``,
the output folder's lock, and pushes to the local fake Hub that are never repeated.

Runs are the console script in a child process (see ``_batch.py``); the family run is shared
with ``test_batch_ray.py``. Manifest errors run in-process: nothing starts, so they are cheap.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import _certificates
import _models
import pytest
from _batch import (
    BROKEN_JOB,
    GOOD_JOBS,
    Run,
    family_run,
    run,
    spawn,
    stamps,
)
from _fake_hub import FakeHub
from typer.testing import CliRunner

from precision_convert.api.conversion import convert
from precision_convert.batch.manifest import read_manifest
from precision_convert.batch.state import JobState, Resume, StateStore, exclusive, resume_point
from precision_convert.cli.main import app
from precision_convert.validation.certify.certificate import CERTIFICATE_NAME
from precision_convert.validation.certify.verify import verify

TOKEN = "hf_FAKEbatchTokenDoNotLeak42"
READ_TOKEN = "hf_FAKEbatchReadOnlyDoNotLeak7"
USER = "ns"
SOURCE_REPO = "ns/tiny"
PARKED_REPO = "ns/parked"
#: Requests that write to the Hub (the card check is a read, whatever its method).
_WRITES = ("POST", "PUT")


def _writes(hub: FakeHub) -> list[tuple[str, str]]:
    return [r for r in hub.requests if r[0] in _WRITES and r[1] != "/api/validate-yaml"]


# --------------------------------------------------------------------------- the manifest

_MANIFEST = """[defaults]
to = ["bf16"]
output_dir = "out"

[[model]]
source = "./m"

[[model]]
source = "{source}"
{line10}
"""


@pytest.mark.parametrize(
    ("source", "line10", "line", "fragment"),
    [
        ("./m", 'kep_fp32 = "x"', 10, "unknown key 'kep_fp32'"),
        ("./m", 'to = ["bf17"]', 10, "unknown target 'bf17'"),
        ("./m", 'name = "m"', 8, "output name 'm-bf16' is also used by [[model]] #1 (line 5)"),
        ("./m", 'name = "a/b"', 10, "name 'a/b' must be a plain folder name"),
        ("./m", 'name = ".."', 10, "name '..' must be a plain folder name"),
        ("./missing", 'name = "x"', 9, "source './missing': no such directory"),
        ("./m", 'name = "x"\npush = "pr"\nvariant = "bf16"', 11, "the source must be a Hub"),
        ("ns/tiny", 'push = "pr"', 10, 'push = "pr" needs a variant'),
        ("./m", 'push = "org/{nope}"\nname = "x"', 10, "push pattern 'org/{nope}'"),
    ],
)
def test_a_bad_manifest_names_its_line_and_runs_nothing(
    tmp_path: Path, source: str, line10: str, line: int, fragment: str
) -> None:
    (tmp_path / "m").mkdir()
    manifest = tmp_path / "batch.toml"
    manifest.write_text(_MANIFEST.format(source=source, line10=line10))
    done = CliRunner().invoke(app, ["batch", str(manifest)])
    assert done.exit_code == 2, done.output
    assert "Traceback" not in done.output, done.stderr
    lines = done.stderr.strip().splitlines()  # one per problem (entry #2 may also clash with #1)
    assert all(line.startswith(f"precision-convert: {manifest}:") for line in lines), lines
    [found] = [line for line in lines if fragment in line]
    assert found.startswith(f"precision-convert: {manifest}:{line}: [[model]] #2: "), found
    assert not (tmp_path / "out").exists()  # nothing ran, not even the lock was taken


def test_every_problem_of_a_manifest_is_reported_with_what_was_meant(tmp_path: Path) -> None:
    """Not only the first problem: each on its own line, in the text's order, and a
    misspelled key, target or table gets the likely intended word."""
    (tmp_path / "m").mkdir()
    manifest = tmp_path / "batch.toml"
    manifest.write_text(
        '[defaults]\nto = ["bf16"]\noutput_dir = "out"\ncalbrate = true\n\n'
        '[[model]]\nsource = "./m"\nto = ["bf61"]\n\n'
        '[[model]]\nsource = "./missing"\n\n'
        '[modle]\nsource = "./m"\n'
    )
    done = CliRunner().invoke(app, ["batch", str(manifest)])
    assert done.exit_code == 2 and "Traceback" not in done.output, done.output
    assert done.stderr.splitlines() == [
        f"precision-convert: {manifest}:4: [defaults]: unknown key 'calbrate' (did you mean "
        "'calibrate'?) (known: allow_nonfinite_source, allow_unexercised, budget, calibrate, "
        "calibration_data, "
        "coverage, "
        "create_pr, device, inputs, keep_fp32, output_dir, private, push, recipe, revision, to, "
        "trust_remote_code, variant)",
        f"precision-convert: {manifest}:8: [[model]] #1: unknown target 'bf61' (did you mean "
        "'bf16'?); choose one of bf16-safe, fp16-safe, bf16, fp16",
        f"precision-convert: {manifest}:11: [[model]] #2: source './missing': no such directory",
        f"precision-convert: {manifest}:13: unknown table or key 'modle' (did you mean 'model'?) "
        "(a manifest has [defaults] and [[model]] entries)",
    ]
    assert not (tmp_path / "out").exists()


def test_resume_and_overwrite_together_are_refused(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    manifest = tmp_path / "batch.toml"
    manifest.write_text('[defaults]\nto = "bf16"\n\n[[model]]\nsource = "./m"\n')
    done = CliRunner().invoke(app, ["batch", str(manifest), "--resume", "--overwrite"])
    assert done.exit_code == 2
    assert done.stderr == (
        "precision-convert: --resume keeps finished jobs, --overwrite redoes them: choose one\n"
    )
    assert not (tmp_path / "converted").exists()


def test_an_unknown_table_or_no_manifest_is_refused(tmp_path: Path) -> None:
    manifest = tmp_path / "batch.toml"
    manifest.write_text('[defaults]\nto = "bf16"\n\n[models]\nsource = "x"\n')
    done = CliRunner().invoke(app, ["batch", str(manifest)])
    assert done.exit_code == 2
    assert f"{manifest}:4: unknown table or key 'models'" in done.stderr
    done = CliRunner().invoke(app, ["batch", str(tmp_path / "nope.toml")])
    assert done.exit_code == 2
    assert "nope.toml: cannot read the manifest (No such file or directory)" in done.stderr


# --------------------------------------------------------------------------- the family


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory, tiny_model: Callable[[str], Path]) -> Run:
    return family_run(tmp_path_factory, tiny_model)


def test_good_jobs_are_certified_and_the_broken_one_is_reported(family: Run) -> None:
    assert family.returncode == 1, family.stderr
    report = family.report
    assert report["summary"] == {"done": 4, "skipped": 0, "failed": 1}
    results = family.results()
    assert list(results) == [*GOOD_JOBS, BROKEN_JOB]  # manifest order, whatever finished first
    for key in GOOD_JOBS:
        result = results[key]
        assert result["status"] == "done" and result["verdict"] == "pass", result
        assert result["key_metric"]["metric"] == "rel_l2"
        assert result["key_metric"]["value"] < result["key_metric"]["threshold"]
        assert set(result["timings"]) == {"download", "convert", "validate"}
        checked = verify(family.output_dir / key)  # the push gate: pass, files match
        assert checked.certificate.target == result["target"]
    assert results["llama-bf16"]["fp32_share"] == 0.0  # a plain cast keeps nothing in fp32
    assert results["llama-bf16-safe"]["fp32_share"] > 0.0  # the norms stay fp32
    broken = results[BROKEN_JOB]
    assert broken["status"] == "failed" and broken["verdict"] is None
    assert broken["reason"].startswith("convert: ") and "model.safetensors" in broken["reason"]
    assert not (family.output_dir / BROKEN_JOB).exists()
    # The report on stdout lists every job in the JSON's words, and says why one failed.
    table = {line.split("│")[1].strip(): line for line in family.stdout.splitlines() if "│" in line}
    for key in GOOD_JOBS:
        assert "│ done " in table[key], table[key]
    assert "│ failed " in table[BROKEN_JOB]
    assert "batch: 4 done, 0 skipped, 1 failed in " in family.stdout
    assert f"✗ {BROKEN_JOB}: {broken['reason']}" in family.stdout
    assert "Traceback" not in family.stderr
    # This run's report is kept under its start time; batch_report.json is the latest run's.
    [kept] = (family.output_dir / "batch_reports").iterdir()
    assert json.loads(kept.read_text()) == report
    assert f"report: {kept} (latest: {family.output_dir / 'batch_report.json'})" in family.stderr


def test_a_second_run_on_a_busy_output_dir_stops(family: Run) -> None:
    with exclusive(family.output_dir):
        done = CliRunner().invoke(app, ["batch", str(family.root / "batch.toml")])
    assert done.exit_code == 2
    assert "another batch run (pid " in done.stderr and "is writing here" in done.stderr
    assert done.stderr.count("\n") == 1


def test_a_killed_job_leaves_nothing_and_outputs_are_replaced_only_when_asked(
    tmp_path: Path, tiny_model: Callable[[str], Path]
) -> None:
    """A job validates in its staging folder: killed meanwhile, its target holds nothing (not
    a complete but uncertified output). The next run does it; the one after stops before
    anything runs, naming the output (``model``'s rule: replacing needs --overwrite);
    ``--overwrite`` redoes it. Each run's report is kept."""
    llama = tiny_model("llama")
    (tmp_path / "batch.toml").write_text(
        '[defaults]\nto = ["bf16"]\noutput_dir = "out"\ncoverage = "quick"\n\n'
        f'[[model]]\nsource = "{llama}"\n'
    )
    out = tmp_path / "out"
    target = out / "llama-bf16"
    staging = out / ".precision-convert-batch" / "staging"
    process = spawn(tmp_path)
    deadline = time.monotonic() + 120
    while not (staging / target.name / "model.safetensors").is_file():  # validating it now
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.02)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(30)
    assert not target.exists() and not target.is_symlink()

    first = run(tmp_path)
    assert first.returncode == 0, first.stderr
    assert verify(target).certificate.passed
    assert not staging.exists() or not any(staging.iterdir())
    assert [p.name for p in out.iterdir() if ".pc-" in p.name] == []
    before = stamps(target)

    again = run(tmp_path)
    assert again.returncode == 2 and again.stdout == "", again.stderr
    assert again.stderr.strip() == (
        f"precision-convert: an output exists already ({target}): --resume keeps finished "
        "jobs and redoes the rest, --overwrite redoes every job"
    )
    assert stamps(target) == before
    assert len(list((out / "batch_reports").iterdir())) == 1

    redone = run(tmp_path, "--overwrite")
    assert redone.returncode == 0, redone.stderr
    after = stamps(target)
    assert after.keys() == before.keys() and after != before  # written again
    assert verify(target).certificate.passed
    reports = sorted((out / "batch_reports").iterdir())
    assert len(reports) == 2 and reports[-1].read_text() == (out / "batch_report.json").read_text()
    assert json.loads(reports[-1].read_text())["overwrite"] is True


def test_resume_redoes_a_job_whose_certificate_contradicts_itself(
    tmp_path: Path, tiny_model: Callable[[str], Path]
) -> None:
    """``--resume`` keeps a finished job only where the verifier passes: a certificate whose
    records contradict its ``pass`` (its card re-rendered, the job's state recording that very
    certificate) is not counted as done, and the job is converted again."""
    llama = tiny_model("llama")
    (tmp_path / "batch.toml").write_text(
        '[defaults]\nto = ["bf16"]\noutput_dir = "out"\ncoverage = "quick"\n\n'
        f'[[model]]\nsource = "{llama}"\n'
    )
    [job] = read_manifest(tmp_path / "batch.toml").jobs
    convert(llama, to="bf16", output=job.output, coverage="quick")
    store = StateStore(job.output.parent)

    def recorded() -> None:
        certificate = (job.output / CERTIFICATE_NAME).read_bytes()
        store.write(JobState(job.key, job.digest, hashlib.sha256(certificate).hexdigest()))

    recorded()
    assert resume_point(job, store).point is Resume.DONE
    _certificates.rewrite(job.output, _certificates.every_record_failed)
    recorded()  # the state names the files as they are: only the records disagree
    assert resume_point(job, store).point is Resume.CONVERT


# --------------------------------------------------------------------------- the Hub


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeHub]:
    source = tmp_path_factory.mktemp("hub-source") / "tiny"
    _models.save("t5-encoder", source)
    with FakeHub() as server:
        server.add_token(TOKEN, USER)
        server.add_token(READ_TOKEN, USER, write=False)
        server.add_commit(SOURCE_REPO, source)
        server.add_commit(PARKED_REPO, source)
        yield server


def _hub_env(hub: FakeHub, root: Path) -> dict[str, str]:
    return {
        "HF_ENDPOINT": hub.endpoint,
        "HF_TOKEN": TOKEN,
        "HF_HUB_OFFLINE": "0",
        "HF_HUB_DISABLE_XET": "1",
        "HF_HOME": str(root / ".hf-home"),
    }


def _manifest(root: Path, tiny_model: Callable[[str], Path], entries: str, extra: str = "") -> None:
    text = f'[defaults]\nto = ["bf16"]\noutput_dir = "out"\ncoverage = "quick"\n{extra}\n'
    text += entries.format(llama=tiny_model("llama"), source=SOURCE_REPO, parked=PARKED_REPO)
    (root / "batch.toml").write_text(text)


@pytest.mark.parametrize(
    ("token", "push", "fragment"),
    [
        (None, "ns/{name}-{target}", "no Hugging Face token"),
        ("hf_FAKEwrongBatchToken99", "ns/{name}-{target}", "rejected the token (401"),
        (READ_TOKEN, "ns/{name}-{target}", "this token is read-only"),
        (TOKEN, "someone-else/{name}-{target}", "someone-else/llama-bf16: ns may create"),
    ],
    ids=["no-token", "wrong-token", "read-only", "foreign-namespace"],
)
def test_pushes_the_token_cannot_make_stop_the_run_before_it_starts(
    tmp_path: Path,
    tiny_model: Callable[[str], Path],
    hub: FakeHub,
    token: str | None,
    push: str,
    fragment: str,
) -> None:
    """A bad token used to be found after every conversion and validation: now it is one
    line, exit 2, nothing run."""
    _manifest(tmp_path, tiny_model, '\n[[model]]\nsource = "{llama}"\n', f'push = "{push}"')
    env = {**_hub_env(hub, tmp_path), "HF_TOKEN": token or ""}
    done = run(tmp_path, env=env)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("precision-convert: "), done.stderr
    assert fragment in lines[0]
    assert not (tmp_path / "out" / "llama-bf16").exists()
    assert not (tmp_path / "out" / "batch_report.json").exists()
    for secret in (TOKEN, READ_TOKEN, "hf_FAKEwrongBatchToken99"):
        assert secret not in done.stderr


@pytest.mark.slow  # 90 s: two runs, each with a warm worker; the kill itself is in reliability/
def test_killed_resumed_and_pushed_once(
    tmp_path: Path, tiny_model: Callable[[str], Path], hub: FakeHub
) -> None:
    """One story in two runs (each starts a warm worker): every certified output is published;
    a run killed mid-way is resumed, redoing only what was unfinished, publishing nothing
    twice and opening no second PR."""
    entries = """
[[model]]
source = "{source}"
to = ["bf16-safe"]
variant = "bf16"
push = "pr"

[[model]]
source = "{llama}"
push = "ns/{{name}}-{{target}}"

[[model]]
source = "ns/does-not-exist"

[[model]]
source = "{parked}"
"""
    _manifest(tmp_path, tiny_model, entries)
    env = _hub_env(hub, tmp_path)
    out = tmp_path / "out"
    hub.requests.clear()

    # One worker takes the jobs in order: a variant PR into the source repo; a new repo (after
    # one 429: the job backs off and pushes again); a Hub id that does not exist; and a job
    # that parks on its download. Then the run is killed, workers and all.
    hub.inject(r"^/api/models/ns/llama-bf16/commit/", status=429, times=1)
    parked = hub.inject(rf"^/api/models/{PARKED_REPO}/revision/", hold=True)
    process = spawn(tmp_path, "--jobs", "1", env=env)
    try:
        assert parked.reached.wait(120), process.stderr
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(30)
    finally:
        parked.release.set()
        hub.faults.clear()
    assert not (out / "batch_report.json").exists() and not (out / "parked-bf16").exists()
    commits = [r for r in hub.requests if r[1] == "/api/models/ns/llama-bf16/commit/main"]
    assert len(commits) == 2  # refused once with 429, then accepted
    pushed = hub.files("ns/llama-bf16")
    assert set(pushed) - {".gitattributes"} == set(verify(out / "llama-bf16").files)
    (pr,) = [d for d in hub.repos[SOURCE_REPO].discussions if d.is_pull_request]
    assert "model.bf16.safetensors" in hub.files(SOURCE_REPO, f"refs/pr/{pr.num}")
    finished = {key: stamps(out / key) for key in ("tiny-bf16-safe", "llama-bf16")}
    # As if killed between the PR's commit and the state file that records it.
    state_file = out / ".precision-convert-batch/jobs/tiny-bf16-safe.json"
    state = json.loads(state_file.read_text())
    assert state["push"]["pull_request"] == pr.num
    state["push"] = None
    state_file.write_text(json.dumps(state))

    hub.requests.clear()
    resumed = run(tmp_path, "--resume", env=env)
    assert resumed.returncode == 1, resumed.stderr  # the missing repo fails again
    results = resumed.results()
    assert [r["status"] for r in results.values()] == ["done", "skipped", "failed", "done"]
    # Finished outputs are kept as they are: same bytes, same mtimes.
    assert {key: stamps(out / key) for key in finished} == finished
    # The pushed job sends nothing; the unrecorded push goes into the same PR.
    assert not [r for r in _writes(hub) if "llama" in r[1]]
    assert results["llama-bf16"]["push"]["url"] in resumed.stdout
    assert results["tiny-bf16-safe"]["push"]["pull_request"] == pr.num
    assert len([d for d in hub.repos[SOURCE_REPO].discussions if d.is_pull_request]) == 1
    missing = results["does-not-exist-bf16"]
    assert missing["reason"].startswith("download: ns/does-not-exist: ")
    assert "no such model repo" in missing["reason"]
    assert verify(out / "parked-bf16").certificate.source["id"] == PARKED_REPO

    # The token is nowhere in what the runs wrote or printed.
    assert TOKEN not in resumed.stdout + resumed.stderr
    for path in out.rglob("*"):
        assert not path.is_file() or TOKEN.encode() not in path.read_bytes()


def test_a_silent_hub_fails_the_job_instead_of_hanging_its_worker(tmp_path: Path) -> None:
    """A Hub that accepts the connection and never answers: huggingface_hub's own client would
    wait forever; batch workers get the command's bounded client, so the job fails quickly."""
    (tmp_path / "batch.toml").write_text(
        '[defaults]\nto = ["bf16"]\noutput_dir = "out"\n\n[[model]]\nsource = "ns/silent"\n'
    )
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)  # handshakes complete; nobody ever answers
        env = {
            "HF_ENDPOINT": f"http://127.0.0.1:{silent.getsockname()[1]}",
            "HF_HUB_OFFLINE": "0",
            "HF_HOME": str(tmp_path / ".hf-home"),
            "PRECISION_CONVERT_HUB_TIMEOUT": "2",
        }
        started = time.monotonic()
        done = run(tmp_path, env=env)
        elapsed = time.monotonic() - started
    assert done.returncode == 1, done.stderr
    reason = done.results()["silent-bf16"]["reason"]
    assert reason.startswith("download: ns/silent: ") and "Timeout" in reason, reason
    assert elapsed < 60, f"took {elapsed:.0f} s to give up on a silent Hub"


_ORPHAN = """
import os, subprocess, sys
worker = (
    "import os, sys, time; sys.platform = 'darwin'  # no PR_SET_PDEATHSIG: the watchdog runs\\n"
    "from precision_convert.batch.local import _die_with_the_driver\\n"
    "_die_with_the_driver(os.getppid()); print('ready', flush=True); time.sleep(120)"
)
child = subprocess.Popen(
    [sys.executable, "-c", worker], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
)
child.stdout.readline()
print(child.pid, flush=True)
os._exit(0)  # the driver dies without stopping its worker
"""


def test_a_worker_without_pdeathsig_watches_its_driver(tmp_path: Path) -> None:
    """Off Linux there is no PR_SET_PDEATHSIG: a worker's watchdog thread ends it within a
    second or two of its driver's death."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _ORPHAN], capture_output=True, text=True, timeout=60, check=True
    )
    worker = int(done.stdout.split()[-1])
    deadline = time.monotonic() + 5
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _alive(worker):
        os.kill(worker, signal.SIGKILL)
        pytest.fail("the worker outlived its driver")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# --------------------------------------------------------------------------- Hub etiquette


def _failed(status: int, retry_after: float | None = None) -> Exception:
    """A PushFailed as hub raises it for an HTTP answer."""
    from precision_convert.core.errors import PushFailed

    return PushFailed("ns/x: the Hub answered", status=status, retry_after=retry_after)


def test_pushes_to_one_repo_are_spaced_and_429_is_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import precision_convert.hub as hub_module
    from precision_convert.batch.etiquette import Etiquette, push_politely
    from precision_convert.core.errors import PushFailed

    answers: list[Exception | str] = [_failed(429, 3.0), _failed(503), "pushed"]
    calls: list[str] = []

    def push_with_result(converted: Path, repo_id: str, **options: object) -> str:
        calls.append(repo_id)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(hub_module, "push_with_result", push_with_result)
    waits: list[float] = []
    etiquette = Etiquette(tmp_path / "locks", interval=60.0, retries=4, backoff=2.0)

    def push(repo_id: str) -> object:
        return push_politely(
            tmp_path,
            repo_id,
            create_pr=False,
            private=None,
            etiquette=etiquette,
            sleep=waits.append,
        )

    assert push("ns/x") == "pushed"
    # 429: the Hub's Retry-After; 503: the backoff (2 s) doubled for a second retry, plus up to
    # 2 s of jitter; and each retry waits for its repo's turn.
    assert waits[0] == 3.0 and 4.0 <= waits[2] <= 6.0, waits
    assert len(waits) == 4 and all(55 < w < 61 for w in waits[1::2]), waits
    waits.clear()
    answers.append("again")
    assert push("ns/x") == "again"
    assert len(waits) == 1 and 55 < waits[0] < 61  # the repo's last commit was just now
    answers.append("elsewhere")
    assert push("ns/y") == "elsewhere"
    assert len(waits) == 1  # another repo: no wait

    answers.append(_failed(403))
    with pytest.raises(PushFailed):
        push("ns/z")
    assert calls[-1] == "ns/z" and not answers  # not retried: waiting cannot help


def test_a_wait_beyond_the_maximum_is_not_waited_and_a_long_backoff_is_announced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 429 asking for more than PRECISION_CONVERT_MAX_RETRY_WAIT fails the push at once (its
    message says when to run it again); one within it is waited; a backoff longer than a few
    seconds is said on stderr."""
    import precision_convert.hub as hub_module
    from precision_convert.batch.etiquette import Etiquette, push_politely
    from precision_convert.core.errors import PushFailed

    monkeypatch.setenv("PRECISION_CONVERT_MAX_RETRY_WAIT", "60")
    answers: list[Exception | str] = [_failed(429, 86400.0), _failed(429, 60.0), _failed(503)]
    answers.append("pushed")

    def push_with_result(converted: Path, repo_id: str, **options: object) -> str:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(hub_module, "push_with_result", push_with_result)
    waits: list[float] = []
    etiquette = Etiquette(tmp_path / "locks", interval=0.0, retries=4, backoff=8.0)

    def push() -> object:
        return push_politely(
            tmp_path, "ns/x", create_pr=False, private=None, etiquette=etiquette, sleep=waits.append
        )

    with pytest.raises(PushFailed) as stopped:
        push()
    assert stopped.value.retry_after == 86400.0 and waits == []  # not retried, nothing waited
    assert push() == "pushed"
    assert waits[0] == 60.0 and 16.0 <= waits[1] <= 24.0, waits  # second try: 2 x 8 s + jitter
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines  # the Hub's own wait is announced by the worker's client
    assert lines[0].startswith("precision-convert: ns/x: push failed (503), retrying: waiting ")


def test_with_no_interval_a_turn_waits_for_nothing_however_the_clock_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lock file keeps the last commit's time exactly: read back, it is never ahead of a
    clock that has not moved (kept to the millisecond, 1000.0006 was 1000.001, and the next
    turn waited 0.4 ms with no interval set)."""
    import precision_convert.batch.etiquette as etiquette_module

    monkeypatch.setattr(etiquette_module.time, "time", lambda: 1000.0006)
    etiquette = etiquette_module.Etiquette(tmp_path / "locks", interval=0.0)
    waits: list[float] = []
    for _ in range(2):
        with etiquette_module._turn(etiquette, "ns/x", waits.append):
            pass
    assert waits == []
