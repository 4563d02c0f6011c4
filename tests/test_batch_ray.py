"""``batch --executor ray``: the family manifest through Ray gives what the local executor gave.

The test starts a local Ray (``ray.init(num_cpus=2)``) and runs the command in a child process
against it (``--ray-address``), as with a running cluster. Weights and configs must be the same
bytes; certificates, cards and the report the same apart from timestamps, timings and paths.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _batch import GOOD_JOBS, digests, family_manifest, family_run, run

ray = pytest.importorskip(
    "ray", reason="ray is not installed: pip install 'precision-convert[ray]'"
)

#: Files that record when they were written (the certificate) or quote it (the card).
_DATED = ("precision_certificate.json", "README.md")


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def _undated(text: str, created: str) -> str:
    return text.replace(created, "<created>")


def _comparable(report: dict[str, Any], root: Path) -> list[dict[str, Any]]:
    """The results without timings, and with paths under ``root`` relative to it."""
    results = [
        {k: v for k, v in result.items() if k not in ("timings", "seconds")}
        for result in report["results"]
    ]
    return json.loads(json.dumps(results).replace(str(root), "<root>"))


def test_ray_gives_the_same_outputs_certificates_and_report(
    tmp_path_factory: pytest.TempPathFactory,
    tiny_model: Callable[[str], Path],
    cluster: str,
) -> None:
    local = family_run(tmp_path_factory, tiny_model)
    root = tmp_path_factory.mktemp("batch-ray")
    family_manifest(root, tiny_model)
    remote = run(root, "--jobs", "2", "--executor", "ray", "--ray-address", cluster)
    assert remote.returncode == local.returncode == 1, remote.stderr

    for key in GOOD_JOBS:
        mine, theirs = local.output_dir / key, remote.output_dir / key
        local_files, ray_files = digests(mine), digests(theirs)
        assert set(local_files) == set(ray_files)
        for name in set(local_files) - set(_DATED):
            assert local_files[name] == ray_files[name], f"{key}/{name} differs"
        certificates = [json.loads((d / _DATED[0]).read_text()) for d in (mine, theirs)]
        created = [c.pop("created") for c in certificates]
        assert certificates[0] == certificates[1]  # every metric, bit for bit
        pairs = zip((mine, theirs), created, strict=True)
        cards = [_undated((d / _DATED[1]).read_text(), c) for d, c in pairs]
        assert cards[0] == cards[1]

    ours, theirs = local.report, remote.report
    assert theirs["executor"] == "ray" and ours["executor"] == "local"
    assert theirs["threads_per_job"] == ours["threads_per_job"]
    assert _comparable(ours, local.root) == _comparable(theirs, remote.root)
    assert re.search(r"✗ broken-bf16: convert: ", remote.stdout)
