"""No command writes into, or replaces, what it did not write.

Every path is resolved (links included) before it is compared: an output that is the source,
lies inside it or contains it is refused by ``model`` (``--push`` too: ``push`` itself writes
nothing locally), ``validate`` and ``batch`` alike, and
``--overwrite`` replaces only an empty directory or one precision-convert wrote. Each refusal:
exit 2, one ``precision-convert:`` line, nothing written, and every file and folder of the
source (and of what ``--overwrite`` was pointed at) unchanged, bytes and mtimes.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
from _corrupt import assert_one_error_line, tiny_source, tree_state
from safetensors import safe_open
from test_bad_input import _invoke


def _refused(args: list[str], *watched: Path, fragments: tuple[str, ...]) -> None:
    """Exit 2 with one line holding ``fragments``; every watched tree as it was."""
    before = {path: tree_state(path) for path in watched}
    code, stdout, stderr = _invoke(args)
    assert code == 2, stderr
    assert_one_error_line(stderr, *fragments)
    assert stdout == ""
    for path in watched:
        assert tree_state(path) == before[path], path


def _model(src: Path, out: str | Path, *extra: str) -> list[str]:
    return ["model", str(src), "--to", "bf16", "--no-validate", "-o", str(out), *extra]


# -- model: outputs that overlap the source ------------------------------------------------


def test_output_that_contains_the_source_is_refused(tmp_path: Path) -> None:
    """``-o PARENT --overwrite`` used to replace PARENT, the source with it."""
    parent = tmp_path / "models"
    src = tiny_source(parent / "src")
    _refused(
        _model(src, parent, "--overwrite"),
        tmp_path,
        fragments=(f"{parent}: ", "must not contain the source directory"),
    )


def test_empty_output_from_the_source_folder_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``-o ""`` is the working directory: run where the source lives, it contains it."""
    src = tiny_source(tmp_path / "src")
    monkeypatch.chdir(tmp_path)
    _refused(_model(src, "", "--overwrite"), tmp_path, fragments=("must not contain the source",))


@pytest.mark.parametrize("into", ["source", "subfolder"])
def test_output_through_a_link_into_the_source_is_refused(into: str, tmp_path: Path) -> None:
    src = tiny_source(tmp_path / "src")
    (src / "extra").mkdir()
    link = tmp_path / "link"
    link.symlink_to(src if into == "source" else src / "extra", target_is_directory=True)
    out = link / "converted"
    _refused(
        _model(src, out),
        tmp_path,
        fragments=(f"{out}: ", "must not be the source directory or inside it"),
    )


def test_model_push_is_refused_before_its_output_is_staged(tmp_path: Path) -> None:
    """``push`` itself writes nothing locally; ``model --push`` stages its output as ``model``
    does, so the same rule stops it before any Hub call."""
    src = tiny_source(tmp_path / "src")
    link = tmp_path / "link"
    link.symlink_to(src, target_is_directory=True)
    args = ["model", str(src), "--to", "bf16", "-o", str(link / "converted"), "--push", "ns/x"]
    _refused(args, tmp_path, fragments=("must not be the source directory or inside it",))


def test_source_given_through_a_link_is_still_the_source(tmp_path: Path) -> None:
    src = tiny_source(tmp_path / "src")
    link = tmp_path / "link"
    link.symlink_to(src, target_is_directory=True)
    _refused(
        _model(link, src, "--overwrite"),
        tmp_path,
        fragments=("must not be the source directory",),
    )


# -- model: what --overwrite may replace ----------------------------------------------------


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _character_device(path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("creating a device node needs root")
    os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # what /dev/null is


def _file(path: Path) -> None:
    path.write_text("not a model")


def _link_to_a_folder(path: Path) -> None:
    elsewhere = path.parent / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("not ours")
    path.symlink_to(elsewhere, target_is_directory=True)


def _foreign_folder(path: Path) -> None:
    path.mkdir()
    (path / "notes.txt").write_text("the user's own")


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (_fifo, "is not a directory"),
        (_character_device, "is not a directory"),
        (_file, "is not a directory"),
        (_link_to_a_folder, "is a symbolic link"),
        (_foreign_folder, "holds files precision-convert did not write"),
    ],
    ids=["fifo", "character-device", "file", "link", "foreign-folder"],
)
def test_overwrite_replaces_nothing_it_did_not_write(
    make: Callable[[Path], None], fragment: str, tmp_path: Path
) -> None:
    src = tiny_source(tmp_path / "src")
    target = tmp_path / "out"
    make(target)
    _refused(
        _model(src, target, "--overwrite"),
        tmp_path,
        fragments=(f"{target}: ", fragment, "--overwrite replaces only"),
    )
    if stat.S_ISCHR(target.lstat().st_mode):
        assert os.major(target.lstat().st_rdev) == 1  # the node itself, not a file in its place


@pytest.mark.parametrize("kind", ["empty", "own-output"])
def test_overwrite_replaces_an_empty_folder_or_its_own_output(kind: str, tmp_path: Path) -> None:
    src = tiny_source(tmp_path / "src")
    target = tmp_path / "out"
    if kind == "empty":
        target.mkdir()
    else:
        code, _, stderr = _invoke(_model(src, target))
        assert code == 0, stderr
    before = tree_state(src)

    code, _, stderr = _invoke(
        ["model", str(src), "--to", "fp16", "--no-validate", "-o", str(target), "--overwrite"]
    )

    assert code == 0, stderr
    with safe_open(target / "model.safetensors", "pt") as written:
        assert json.loads(written.metadata()["precision_convert"])["target"] == "fp16"
    assert tree_state(src) == before


def test_a_folder_that_merely_holds_an_output_is_not_replaced(tmp_path: Path) -> None:
    """``-o ~ --overwrite``: a folder of the user's, with one of this tool's outputs among its
    files, is not this tool's to remove."""
    src = tiny_source(tmp_path / "src")
    home = tmp_path / "home"
    code, _, stderr = _invoke(_model(src, home / "converted"))
    assert code == 0, stderr
    (home / "notes.txt").write_text("the user's own")
    _refused(
        _model(src, home, "--overwrite"),
        tmp_path,
        fragments=(f"{home}: ", "holds files precision-convert did not write"),
    )


def test_overwrite_replaces_its_own_pipeline_output(
    tmp_path: Path, tiny_model: Callable[[str], Path]
) -> None:
    """A pipeline's record is in its components' folders (no certificate without
    validation): still this tool's output."""
    src = tiny_model("sd-pipeline")
    target = tmp_path / "out"
    assert _invoke(_model(src, target))[0] == 0
    before = tree_state(src)

    code, _, stderr = _invoke(_model(src, target, "--overwrite"))

    assert code == 0, stderr
    assert (target / "model_index.json").is_file() and tree_state(src) == before


# -- validate --------------------------------------------------------------------------------


def test_validate_does_not_write_its_certificate_into_the_baseline(tmp_path: Path) -> None:
    src = tiny_source(tmp_path / "src")
    link = tmp_path / "link"
    link.symlink_to(src, target_is_directory=True)
    _refused(
        ["validate", str(src), "--baseline", str(link)],
        tmp_path,
        fragments=(f"{src}: ", "the converted directory must not be the source directory"),
    )


def test_validate_of_an_output_kept_inside_its_source_is_refused(tmp_path: Path) -> None:
    src = tiny_source(tmp_path / "src")
    out = tmp_path / "out"
    assert _invoke(_model(src, out))[0] == 0
    inside = src / "converted"
    out.rename(inside)
    _refused(
        ["validate", str(inside), "--baseline", str(src)],
        tmp_path,
        fragments=(f"{inside}: ", "must not be the source directory or inside it"),
    )


def test_validate_keeps_the_card_of_a_folder_it_did_not_write(tmp_path: Path) -> None:
    """The card goes into README.md: a folder of the user's own keeps its README; an output
    of ``model`` (whose README is the source's copy) gets the card."""
    import shutil

    import _models

    src = _models.save("bert", tmp_path / "src")
    (src / "README.md").write_text("# my notes\n")
    mine = tmp_path / "mine"
    shutil.copytree(src, mine)
    _refused(
        ["validate", str(mine), "--baseline", str(src)],
        tmp_path,
        fragments=(f"{mine}: ", "README.md is this folder's own", "move it aside"),
    )
    out = tmp_path / "out"
    assert _invoke(_model(src, out))[0] == 0
    assert (out / "README.md").read_text() == "# my notes\n"
    code, _, stderr = _invoke(["validate", str(out), "--baseline", str(src), "--coverage", "quick"])
    assert code == 0, stderr
    assert (out / "README.md").read_text().startswith("---\n")  # the card replaced the copy


# -- batch -----------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["source", "parent", "inside", "link"])
def test_batch_output_dir_never_overlaps_a_source(where: str, tmp_path: Path) -> None:
    """Refused while the manifest is checked: no report, no resume state, no lock."""
    src = tiny_source(tmp_path / "m")
    (tmp_path / "into-m").symlink_to(src, target_is_directory=True)
    output_dir = {"source": "m", "parent": ".", "inside": "m/out", "link": "into-m/out"}[where]
    manifest = tmp_path / "batch.toml"
    manifest.write_text(
        f'[defaults]\nto = "bf16"\noutput_dir = "{output_dir}"\n\n[[model]]\nsource = "./m"\n'
    )
    fragment = "contain" if where == "parent" else "must not be the source directory"
    _refused(["batch", str(manifest)], tmp_path, fragments=(f"{manifest}:3: ", fragment))
