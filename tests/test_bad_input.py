"""Bad input: every unreadable, inconsistent or hostile source, and every unusable flag.

Each case must end with exit code 2, exactly one ``precision-convert: <file>: <problem>`` line
on stderr (no traceback), nothing on stdout, and nothing written anywhere: no output
directory, no staging directory, the source byte-identical, no code from a pickle executed.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from _corrupt import (
    TINY_STATE,
    RunsCode,
    assert_one_error_line,
    cli_command,
    cli_env,
    raw_safetensors,
    shard,
    tiny_source,
    tree_digest,
    tree_state,
    write_index,
)
from safetensors.torch import save_file
from typer.testing import CliRunner

from precision_convert.cli.main import app

runner = CliRunner()
#: A file the hostile pickles try to create; it must never appear.
MARKER = "CODE-WAS-EXECUTED"


@dataclass(frozen=True)
class Case:
    id: str
    make: Callable[[Path], Path]  # corrupts the source, returns the file the message names
    fragment: str  # the problem, as the one stderr line states it


def _weights(src: Path) -> Path:
    return src / "model.safetensors"


def _as_pickle(src: Path, payload: bytes, name: str = "pytorch_model.bin") -> Path:
    _weights(src).unlink()
    (src / name).write_bytes(payload)
    return src / name


def _torch_bytes(obj: object, tmp: Path) -> bytes:
    path = tmp / "tmp.pt"
    torch.save(obj, path)
    data = path.read_bytes()
    path.unlink()
    return data


def _marker(src: Path) -> Path:
    return src.parent / MARKER


# -- safetensors files ---------------------------------------------------------------------


def truncated(src: Path) -> Path:
    data = _weights(src).read_bytes()
    _weights(src).write_bytes(data[:-10])
    return _weights(src)


def header_past_end(src: Path) -> Path:
    raw_safetensors(_weights(src), {}, header_len=1_000_000)
    return _weights(src)


def shorter_than_size_field(src: Path) -> Path:
    _weights(src).write_bytes(b"\x01\x02\x03")
    return _weights(src)


def header_over_limit(src: Path) -> Path:
    raw_safetensors(_weights(src), {}, header_len=2**40)
    return _weights(src)


def overlapping_offsets(src: Path) -> Path:
    header = {
        "a.weight": {"dtype": "F32", "shape": [16], "data_offsets": [0, 64]},
        "b.weight": {"dtype": "F32", "shape": [16], "data_offsets": [32, 96]},
    }
    raw_safetensors(_weights(src), header, bytes(96))
    return _weights(src)


def non_json_header(src: Path) -> Path:
    raw_safetensors(_weights(src), b"this is {not json", bytes(8))
    return _weights(src)


def header_not_object(src: Path) -> Path:
    raw_safetensors(_weights(src), b"[1, 2, 3]")
    return _weights(src)


def header_deeply_nested(src: Path) -> Path:
    raw_safetensors(_weights(src), b"[" * 100_000 + b"]" * 100_000)
    return _weights(src)


def header_duplicate_name(src: Path) -> Path:
    entry = '{"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}'
    raw_safetensors(_weights(src), f'{{"a": {entry}, "a": {entry}}}'.encode(), bytes(4))
    return _weights(src)


def unknown_dtype(src: Path) -> Path:
    header = {"a.weight": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}}
    raw_safetensors(_weights(src), header, bytes(16))
    return _weights(src)


def offsets_disagree_with_shape(src: Path) -> Path:
    header = {"a.weight": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}
    raw_safetensors(_weights(src), header, bytes(16))
    return _weights(src)


def bad_metadata(src: Path) -> Path:
    header = {
        "__metadata__": {"format": 1},
        "a.weight": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
    }
    raw_safetensors(_weights(src), header, bytes(4))
    return _weights(src)


# -- sharded indexes -----------------------------------------------------------------------


def _sharded(src: Path) -> dict[str, str]:
    shard(src, ["layer.weight"])
    index = json.loads((src / "model.safetensors.index.json").read_text())
    return index["weight_map"]


def index_points_to_parent(src: Path) -> Path:
    weight_map = _sharded(src)
    # The file exists, so only the containment check can stop it.
    (src.parent / "outside.safetensors").write_bytes(
        (src / weight_map["layer.weight"]).read_bytes()
    )
    weight_map["layer.weight"] = "../outside.safetensors"
    write_index(src, weight_map)
    return src / "model.safetensors.index.json"


def index_absolute_path(src: Path) -> Path:
    weight_map = _sharded(src)
    weight_map["layer.weight"] = str((src / weight_map["layer.weight"]).absolute())
    write_index(src, weight_map)
    return src / "model.safetensors.index.json"


def index_missing_shard(src: Path) -> Path:
    weight_map = _sharded(src)
    weight_map["layer.weight"] = "model-00009-of-00009.safetensors"
    write_index(src, weight_map)
    return src / "model.safetensors.index.json"


def index_lists_absent_tensor(src: Path) -> Path:
    weight_map = _sharded(src)
    weight_map["ghost.weight"] = weight_map["layer.weight"]
    write_index(src, weight_map)
    return src / "model.safetensors.index.json"


def index_names_config(src: Path) -> Path:
    weight_map = _sharded(src)
    weight_map["layer.weight"] = "config.json"
    write_index(src, weight_map)
    return src / "model.safetensors.index.json"


def index_not_json(src: Path) -> Path:
    _sharded(src)
    (src / "model.safetensors.index.json").write_text('{"weight_map": ')
    return src / "model.safetensors.index.json"


# -- pickle checkpoints --------------------------------------------------------------------


def pickle_runs_os_system(src: Path) -> Path:
    evil = {"w": torch.ones(2), "x": RunsCode(os.system, f"touch {_marker(src)}")}
    return _as_pickle(src, _torch_bytes(evil, src.parent))


def pickle_runs_open_protocol_4(src: Path) -> Path:
    # A plain pickle.dumps (protocol 4, legacy non-zip layout), not torch.save.
    return _as_pickle(src, pickle.dumps({"w": RunsCode(open, str(_marker(src)), "w")}, 4))


def pickle_runs_exec_in_shard(src: Path) -> Path:
    _weights(src).unlink()
    good = {k: v for k, v in TINY_STATE.items() if k != "layer.weight"}
    torch.save(good, src / "pytorch_model-00001-of-00002.bin")
    payload = f"open({str(_marker(src))!r}, 'w').close()"
    evil = {"layer.weight": RunsCode(exec, payload)}
    torch.save(evil, src / "pytorch_model-00002-of-00002.bin")
    weight_map = dict.fromkeys(good, "pytorch_model-00001-of-00002.bin")
    weight_map["layer.weight"] = "pytorch_model-00002-of-00002.bin"
    (src / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return src / "pytorch_model-00002-of-00002.bin"


def pickle_not_a_pickle(src: Path) -> Path:
    return _as_pickle(src, b'{"layer.weight": [1, 2]}')


def pickle_not_a_state_dict(src: Path) -> Path:
    return _as_pickle(src, _torch_bytes([torch.ones(2)], src.parent))


def pickle_sparse_tensor(src: Path) -> Path:
    return _as_pickle(src, _torch_bytes({"w": torch.eye(3).to_sparse()}, src.parent))


def pickle_truncated(src: Path) -> Path:
    data = _torch_bytes({"w": torch.ones(1000)}, src.parent)
    return _as_pickle(src, data[: len(data) // 2])


# -- configs and layout --------------------------------------------------------------------


def config_not_json(src: Path) -> Path:
    (src / "config.json").write_text('{"model_type": "llama",')
    return src / "config.json"


def config_not_object(src: Path) -> Path:
    (src / "config.json").write_text("[]")
    return src / "config.json"


def config_not_utf8(src: Path) -> Path:
    (src / "config.json").write_bytes(b'{"model_type": "\xff\xfe"}')
    return src / "config.json"


def config_deeply_nested(src: Path) -> Path:
    (src / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    return src / "config.json"


def config_architectures_not_list(src: Path) -> Path:
    (src / "config.json").write_text(json.dumps({"architectures": 5}))
    return src / "config.json"


def config_model_type_not_string(src: Path) -> Path:
    (src / "config.json").write_text(json.dumps({"model_type": ["llama"]}))
    return src / "config.json"


def no_weights(src: Path) -> Path:
    _weights(src).unlink()
    return src


def no_config(src: Path) -> Path:
    (src / "config.json").unlink()
    return src


def pipeline_index_not_json(src: Path) -> Path:
    (src / "model_index.json").write_text("{")
    return src / "model_index.json"


def pipeline_without_components(src: Path) -> Path:
    index = {"_class_name": "StableDiffusionPipeline", "unet": ["diffusers", "UNet"]}
    (src / "model_index.json").write_text(json.dumps(index))
    return src / "model_index.json"


def pipeline_component_corrupt(src: Path) -> Path:
    index = {"_class_name": "StableDiffusionPipeline", "unet": ["diffusers", "UNet"]}
    (src / "model_index.json").write_text(json.dumps(index))
    unet = tiny_source(src / "unet")
    return non_json_header(unet)


CASES = [
    Case("truncated", truncated, "truncated: tensor"),
    Case("header-past-end", header_past_end, "header length 1000000 runs past the end"),
    Case("shorter-than-size-field", shorter_than_size_field, "shorter than its 8-byte"),
    Case("header-over-limit", header_over_limit, "exceeds the 100 MB limit"),
    Case("overlapping-offsets", overlapping_offsets, "overlap in the data section"),
    Case("non-json-header", non_json_header, "header is not valid JSON"),
    Case("header-not-object", header_not_object, "header is not a JSON object"),
    Case("header-deeply-nested", header_deeply_nested, "header is not valid JSON"),
    Case("header-duplicate-name", header_duplicate_name, "duplicate key 'a'"),
    Case("unknown-dtype", unknown_dtype, "unknown dtype 'F128'"),
    Case("offsets-vs-shape", offsets_disagree_with_shape, "data_offsets span 8 bytes"),
    Case("bad-metadata", bad_metadata, "__metadata__ must map strings to strings"),
    Case("index-parent", index_points_to_parent, "points outside the model directory"),
    Case("index-absolute", index_absolute_path, "points outside the model directory"),
    Case("index-missing-shard", index_missing_shard, "missing shard"),
    Case("index-absent-tensor", index_lists_absent_tensor, "'ghost.weight'"),
    Case("index-names-config", index_names_config, "not a .safetensors weight file"),
    Case("index-not-json", index_not_json, "not valid JSON"),
    Case("pickle-os-system", pickle_runs_os_system, "refusing to load"),
    Case("pickle-open-protocol-4", pickle_runs_open_protocol_4, "refusing to load"),
    Case("pickle-exec-in-shard", pickle_runs_exec_in_shard, "refusing to load"),
    Case("pickle-not-a-pickle", pickle_not_a_pickle, "neither a zip archive nor a binary pickle"),
    Case("pickle-not-state-dict", pickle_not_a_state_dict, "not a state dict"),
    Case("pickle-sparse", pickle_sparse_tensor, "not a dense tensor"),
    Case("pickle-truncated", pickle_truncated, "cannot read PyTorch checkpoint"),
    Case("config-not-json", config_not_json, "not valid JSON"),
    Case("config-not-object", config_not_object, "expected a JSON object"),
    Case("config-not-utf8", config_not_utf8, "not valid JSON"),
    Case("config-deeply-nested", config_deeply_nested, "not valid JSON"),
    Case("config-architectures", config_architectures_not_list, "'architectures' must be"),
    Case("config-model-type", config_model_type_not_string, "'model_type' must be a string"),
    Case("no-weights", no_weights, "no weights found"),
    Case("no-config", no_config, "not a model directory"),
    Case("pipeline-index-not-json", pipeline_index_not_json, "not valid JSON"),
    Case("pipeline-no-components", pipeline_without_components, "no component with weights"),
    Case("pipeline-component-corrupt", pipeline_component_corrupt, "header is not valid JSON"),
]


def _invoke(args: list[str]) -> tuple[int, str, str]:
    result = runner.invoke(app, args)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"{args}: escaped {result.exception!r}\n{result.stderr}")
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.parametrize("command", ["model", "inspect"])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_source(case: Case, command: str, tmp_path: Path, workdir: Path) -> None:
    src = tiny_source(tmp_path / "src")
    named = case.make(src)
    before = tree_digest(tmp_path)
    args = [command, str(src)] + (["--to", "bf16", "--no-validate"] if command == "model" else [])

    code, stdout, stderr = _invoke(args)

    assert code == 2, stderr
    assert_one_error_line(stderr, f"{named}: ", case.fragment)
    assert stdout == ""
    # Nothing written anywhere under tmp_path: no output, no staging, no marker, source intact.
    assert tree_digest(tmp_path) == before
    assert not (workdir / "src-bf16").exists()
    assert not (tmp_path / MARKER).exists()


def test_hostile_pickles_really_run_code_when_unpickled_unsafely(tmp_path: Path) -> None:
    """The payloads above are live: a plain unpickler runs them (so the tests prove a refusal)."""
    loaders: dict[Callable[[Path], Path], Callable[[Path], object]] = {
        pickle_runs_os_system: lambda path: torch.load(path, weights_only=False),
        pickle_runs_open_protocol_4: lambda path: pickle.loads(path.read_bytes()),
    }
    for make, load in loaders.items():
        src = tiny_source(tmp_path / make.__name__)
        load(make(src))
        assert _marker(src).exists()
        _marker(src).unlink()


def test_bad_source_with_nested_output_creates_no_parents(tmp_path: Path) -> None:
    src = tiny_source(tmp_path / "src")
    truncated(src)
    out = tmp_path / "a" / "b" / "out"

    code, _, stderr = _invoke(["model", str(src), "--to", "bf16", "--no-validate", "-o", str(out)])

    assert code == 2
    assert_one_error_line(stderr, f"{_weights(src)}: ", "truncated")
    assert not (tmp_path / "a").exists()


def test_missing_path(tmp_path: Path, workdir: Path) -> None:
    missing = tmp_path / "no-such-model"
    for source in (str(missing), "./no-such-model"):
        code, _, stderr = _invoke(["model", source, "--to", "bf16", "--no-validate"])
        assert code == 2
        assert_one_error_line(stderr, "no-such-model: no such directory")
    assert list(workdir.iterdir()) == []


def test_source_is_a_file(tmp_path: Path, workdir: Path) -> None:
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"")
    code, _, stderr = _invoke(["model", str(file), "--to", "bf16", "--no-validate"])
    assert code == 2
    assert_one_error_line(stderr, f"{file}: not a directory")
    assert list(workdir.iterdir()) == []


# -- flags and output locations ------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "fragments"),
    [
        (["--to", "fp8-safe"], ["unknown target 'fp8-safe'", "bf16-safe"]),
        (["--to", "fp16_safe"], ["unknown target 'fp16_safe' (did you mean 'fp16-safe'?)"]),
        (["--to", "bf16", "--keep-fp32", "no.such.module"], ["'no.such.module' matches no"]),
        (["--to", "bf16", "--keep-fp32", "layer..weight"], ["--keep-fp32"]),
        (["--to", "bf16", "--revision", "main"], ["--revision applies to Hub repo ids"]),
        (["--to", "bf16", "--recipe", "no-such-recipe"], ["no-such-recipe"]),
    ],
    ids=[
        "unknown-target",
        "target-misspelled",
        "keep-fp32-no-match",
        "keep-fp32-invalid",
        "revision-local",
        "recipe",
    ],
)
def test_bad_flags(flags: list[str], fragments: list[str], tmp_path: Path, workdir: Path) -> None:
    src = tiny_source(tmp_path / "src")
    before = tree_digest(tmp_path)

    code, stdout, stderr = _invoke(["model", str(src), "--no-validate", *flags])

    assert code == 2, stderr
    assert_one_error_line(stderr, *fragments)
    assert stdout == ""
    assert tree_digest(tmp_path) == before


@pytest.mark.parametrize(
    ("flags", "fragments"),
    [
        (["--inputs", "inputs.safetensors"], ["inputs.safetensors: ", "--inputs must be"]),
        (["--variant", "fp/16"], ["--variant 'fp/16'", "letters, digits and _"]),
        (["--coverage", "bogus"], ["bogus"]),
    ],
    ids=["inputs-not-safetensors", "variant-name", "coverage-level"],
)
def test_bad_validation_flags_refused_before_any_work(
    flags: list[str], fragments: list[str], tmp_path: Path, workdir: Path
) -> None:
    """Flags only validation reads are still checked first: nothing is converted for a run
    whose certificate could never be made."""
    src = tiny_source(tmp_path / "src")
    (workdir / "inputs.safetensors").write_text("not safetensors")
    before = tree_digest(tmp_path)

    code, stdout, stderr = _invoke(["model", str(src), "--to", "bf16", *flags])

    assert code == 2, stderr
    assert_one_error_line(stderr, *fragments)
    assert stdout == ""
    assert tree_digest(tmp_path) == before


def test_validate_refuses_an_unknown_coverage_level(tmp_path: Path) -> None:
    src = tiny_source(tmp_path / "src")
    before = tree_digest(tmp_path)
    code, _, stderr = _invoke(["validate", str(src), "--coverage", "bogus"])
    assert code == 2
    assert_one_error_line(stderr, "bogus")
    assert tree_digest(tmp_path) == before


def test_existing_output_needs_overwrite(tmp_path: Path) -> None:
    """An existing output is replaced only when asked, and only when this tool wrote it (a
    folder of the user's own is refused even with ``--overwrite``: see
    tests/reliability/test_source_safety.py)."""
    src = tiny_source(tmp_path / "src")
    out = tmp_path / "out"
    args = ["model", str(src), "--to", "bf16", "--no-validate", "-o", str(out)]
    assert _invoke(args)[0] == 0
    (out / "mine.txt").write_text("left in our output")
    before = tree_digest(tmp_path)

    code, _, stderr = _invoke(args)

    assert code == 2
    assert_one_error_line(stderr, f"{out}: output already exists", "--overwrite")
    assert tree_digest(tmp_path) == before

    code, _, stderr = _invoke([*args, "--overwrite"])

    assert code == 0, stderr
    assert not (out / "mine.txt").exists()
    assert (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]
    src_digest = {k: v for k, v in before.items() if k.startswith("src")}
    assert {k: v for k, v in tree_digest(tmp_path).items() if k.startswith("src")} == src_digest


@pytest.mark.parametrize("where", ["same", "inside"])
def test_output_in_source_refused(where: str, tmp_path: Path) -> None:
    src = tiny_source(tmp_path / "src")
    out = src if where == "same" else src / "converted"
    before = tree_digest(tmp_path)

    code, _, stderr = _invoke(
        ["model", str(src), "--to", "bf16", "--no-validate", "-o", str(out), "--overwrite"]
    )

    assert code == 2
    assert_one_error_line(stderr, f"{out}: output must not be the source directory")
    assert tree_digest(tmp_path) == before


def test_output_under_a_file(tmp_path: Path) -> None:
    src = tiny_source(tmp_path / "src")
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    before = tree_digest(tmp_path)
    out = blocker / "out"

    code, _, stderr = _invoke(["model", str(src), "--to", "bf16", "--no-validate", "-o", str(out)])

    assert code == 2
    assert_one_error_line(stderr, f"{out}: ", f"{blocker} is not a directory")
    assert tree_digest(tmp_path) == before


# -- the real executable -------------------------------------------------------------------


def test_real_process_exit_2_one_line(tmp_path: Path) -> None:
    """The installed command, in real processes: exit 2, one stderr line, nothing written."""
    cases: list[tuple[str, list[str], list[str]]] = []

    evil = tiny_source(tmp_path / "evil")
    pickle_runs_os_system(evil)
    cases.append(("evil", [str(evil), "--to", "bf16"], [f"{evil}/pytorch_model.bin: ", "refus"]))

    broken = tiny_source(tmp_path / "broken")
    overlapping_offsets(broken)
    cases.append(("broken", [str(broken), "--to", "bf16-safe"], ["overlap"]))

    existing = tiny_source(tmp_path / "existing")
    (tmp_path / "existing-out").mkdir()
    cases.append(
        (
            "existing",
            [str(existing), "--to", "bf16", "-o", str(tmp_path / "existing-out")],
            ["output already exists"],
        )
    )
    cases.append(("hub", ["no-such-org/no-such-model", "--to", "bf16"], ["no-such-org/"]))
    cases.append(("target", [str(existing), "--to", "int4"], ["unknown target 'int4'"]))

    work = tmp_path / "work"
    work.mkdir()
    before = tree_digest(tmp_path)
    procs = {
        name: subprocess.Popen(
            [*cli_command(), "model", *args, "--no-validate"],
            cwd=work,
            env=cli_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, args, _ in cases
    }
    for name, _, fragments in cases:
        stdout, stderr = procs[name].communicate(timeout=120)
        assert procs[name].returncode == 2, (name, stderr)
        assert_one_error_line(stderr, *fragments)
        assert stdout == "", name
    assert tree_digest(tmp_path) == before
    assert not (tmp_path / MARKER).exists()


def test_a_deleted_working_directory(tmp_path: Path) -> None:
    """A shell left in a folder deleted under it: one line saying so, before any work."""
    src = tiny_source(tmp_path / "src")
    gone = tmp_path / "gone"
    gone.mkdir()
    before = tree_digest(src)
    in_gone = ["sh", "-c", 'cd "$0" && rmdir "$0" && exec "$@"', str(gone)]
    proc = subprocess.run(
        [*in_gone, *cli_command(), "model", str(src), "--to", "bf16", "--no-validate"],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert_one_error_line(proc.stderr, "the current directory no longer exists")
    assert proc.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    assert tree_digest(src) == before


# -- sources and data that used to end in a traceback ----------------------------------------


def _refused_cleanly(args: list[str], root: Path, *fragments: str) -> str:
    """Exit 2, one line holding ``fragments``, nothing on stdout, and every entry under
    ``root`` (the source included) as it was: bytes and mtimes. Only ``root``'s own mtime may
    change: a staging directory beside the output may have come and gone there."""

    def state() -> dict[str, tuple[str, int]]:
        return {k: (v[0], 0) if k == "." else v for k, v in tree_state(root).items()}

    before = state()
    code, stdout, stderr = _invoke(args)
    assert code == 2, stderr
    line = assert_one_error_line(stderr, *fragments)
    assert stdout == ""
    assert state() == before
    return line


def _llama_with(tmp_path: Path, tiny_model: Callable[[str], Path], **changes: object) -> Path:
    src = tmp_path / "src"
    shutil.copytree(tiny_model("llama"), src)
    config = json.loads((src / "config.json").read_text())
    config.update(changes)
    (src / "config.json").write_text(json.dumps(config))
    return src


UNBUILDABLE = [
    ({"num_attention_heads": 0}, "('num_attention_heads' = 0): ZeroDivisionError"),
    ({"architectures": ["__class__"]}, "'architectures' names '__class__', which is not a"),
    ({"model_type": "no-such-type"}, "('model_type' = 'no-such-type'): ValueError"),
    ({"hidden_size": "16"}, "('hidden_size' = '16')"),
]


@pytest.mark.parametrize("target", ["bf16", "fp16-safe"])
@pytest.mark.parametrize(
    ("changes", "fragment"),
    UNBUILDABLE,
    ids=["heads-zero", "architecture-dunder", "unknown-model-type", "hidden-size-string"],
)
def test_configs_the_library_cannot_build(
    changes: dict[str, object],
    fragment: str,
    target: str,
    tmp_path: Path,
    tiny_model: Callable[[str], Path],
) -> None:
    """Validation (and, for fp16-safe, calibration) builds the model: what transformers raises
    about its config is one line naming the key, and the staged output is gone."""
    src = _llama_with(tmp_path, tiny_model, **changes)
    out = tmp_path / "out"
    args = ["model", str(src), "--to", target, "--coverage", "quick", "-o", str(out)]
    _refused_cleanly(args, tmp_path, f"{src}/config.json: ", fragment)


@pytest.mark.parametrize(
    ("changes", "fragment"),
    UNBUILDABLE,
    ids=["heads-zero", "architecture-dunder", "unknown-model-type", "hidden-size-string"],
)
def test_configs_it_cannot_build_with_a_tokenizer_and_text_data(
    changes: dict[str, object],
    fragment: str,
    tmp_path: Path,
    tiny_model: Callable[[str], Path],
) -> None:
    """Text calibration data loads the model's tokenizer, which reads its config too: the
    model is built first, so the refusal is the same one line."""
    from _models import t5_tokenizer

    src = _llama_with(tmp_path, tiny_model, **changes)
    t5_tokenizer().save_pretrained(src)
    data = tmp_path / "data.txt"
    data.write_text("a line of text\n")
    args = ["model", str(src), "--to", "bf16", "--coverage", "quick", "--calibration-data"]
    _refused_cleanly([*args, str(data), "-o", str(tmp_path / "out")], tmp_path, fragment)


def test_a_diffusers_config_it_cannot_build(
    tmp_path: Path, tiny_model: Callable[[str], Path]
) -> None:
    src = tmp_path / "unet"
    shutil.copytree(tiny_model("unet"), src)
    config = json.loads((src / "config.json").read_text())
    config["down_block_types"] = ["NoSuchBlock2D"] * len(config["down_block_types"])
    (src / "config.json").write_text(json.dumps(config))
    args = ["model", str(src), "--to", "bf16", "--coverage", "quick", "-o", str(tmp_path / "o")]
    _refused_cleanly(
        args, tmp_path, f"{src}/config.json: diffusers cannot build", "'down_block_types'"
    )


def _nest(root: Path, depth: int) -> None:
    """``depth`` folders inside each other under ``root`` (os.makedirs would recurse)."""
    fd = os.open(root, os.O_RDONLY)
    for _ in range(depth):
        os.mkdir("d", dir_fd=fd)
        inner = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = inner
    os.close(fd)


def _unnest(root: Path) -> None:
    """Remove what :func:`_nest` made, without recursion (shutil.rmtree recurses)."""
    chain = [root / "d"]
    while (chain[-1] / "d").is_dir():
        chain.append(chain[-1] / "d")
    for folder in reversed(chain):
        folder.rmdir()


def test_a_thousand_nested_folders(tmp_path: Path, workdir: Path) -> None:
    src = tiny_source(tmp_path / "src")
    _nest(src, 1100)
    try:
        _refused_cleanly(
            ["model", str(src), "--to", "bf16", "--no-validate"],
            tmp_path,
            f"{src}: folders nested more than 32 levels deep",
        )
    finally:
        _unnest(src)


@pytest.mark.parametrize("which", ["source", "output"])
def test_a_folder_name_that_is_not_utf8(which: str, tmp_path: Path, workdir: Path) -> None:
    """The name would reach the card (and the Hub) as text: refused before anything runs."""
    odd = os.fsdecode(b"model-\xff")
    src = tiny_source(tmp_path / (odd if which == "source" else "src"))
    out = tmp_path / (odd if which == "output" else "out")
    _refused_cleanly(
        ["model", str(src), "--to", "bf16", "--coverage", "quick", "-o", str(out)],
        tmp_path,
        "model-\\udcff: the name is not valid UTF-8",
    )


def test_a_hub_id_with_a_trailing_newline(tmp_path: Path, workdir: Path) -> None:
    _refused_cleanly(
        ["model", "ns/tiny\n", "--to", "bf16"], tmp_path, "ns/tiny\\n: no such directory"
    )


def test_calibration_token_id_beyond_64_bits(
    tmp_path: Path, tiny_model: Callable[[str], Path]
) -> None:
    src = _llama_with(tmp_path, tiny_model)
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"input_ids": [[1, 2**70]]}) + "\n")
    args = ["model", str(src), "--to", "bf16", "--calibration-data", str(data), "-o", "x"]
    _refused_cleanly(args, tmp_path, f"{data}: ", "line 1", "does not fit a 64-bit integer")


def test_a_200000_token_line_is_refused_at_once(
    tmp_path: Path, tiny_model: Callable[[str], Path]
) -> None:
    """A 64-position Llama (rotary positions: it would run the line, for minutes) and one
    JSONL line of 200,000 ids: refused within seconds, saying the limit."""
    src = _llama_with(tmp_path, tiny_model)
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"input_ids": [[i % 200 for i in range(200_000)]]}) + "\n")
    args = ["model", str(src), "--to", "bf16", "--coverage", "quick", "--calibration-data"]
    started = time.monotonic()
    _refused_cleanly(
        [*args, str(data), "-o", str(tmp_path / "out")],
        tmp_path,
        f"{data}: --calibration-data: line 1: 'input_ids' is 200000 tokens long",
        "at most 64 positions",
    )
    assert time.monotonic() - started < 10


def test_a_200000_token_text_line_is_cut_at_once_saying_so(
    tmp_path: Path, tiny_model: Callable[[str], Path], caplog: pytest.LogCaptureFixture
) -> None:
    """Text is not written to fit a model: the probes cut a long line to the position limit
    (no minutes-long forward), and a warning says which line and to how many tokens."""
    from _models import t5_tokenizer

    from precision_convert.conversion.io.source import open_source
    from precision_convert.validation.probe.inputs.preflight import check_user_inputs
    from precision_convert.validation.probe.inputs.userdata import read_calibration_data

    src = _llama_with(tmp_path, tiny_model)
    t5_tokenizer().save_pretrained(src)
    data = tmp_path / "data.txt"
    data.write_text("a short line\n" + " ".join(["the"] * 200_000) + "\n")
    started = time.monotonic()

    with caplog.at_level(logging.WARNING):
        check_user_inputs(open_source(src), data=read_calibration_data(data))

    assert time.monotonic() - started < 10
    [record] = caplog.records
    assert record.getMessage() == (
        f"{data}: --calibration-data: 1 text line(s) longer than LlamaForCausalLM's 64 "
        "positions are cut to their first 64 tokens (line 2: 200001 tokens)"
    )


@pytest.mark.parametrize("command", ["model", "validate"])
@pytest.mark.parametrize(
    ("tensors", "fragment"),
    [
        ({"no_such_arg": torch.ones(1, 4, dtype=torch.int64)}, "no_such_arg: not an argument"),
        ({"input_ids": torch.tensor([[1, 5000]])}, "token id 5000, outside"),
        ({"input_ids": torch.zeros(1, 65, dtype=torch.int64)}, "65 tokens long"),
    ],
    ids=["unknown-argument", "outside-vocabulary", "too-long"],
)
def test_inputs_the_model_cannot_take(
    tensors: dict[str, torch.Tensor],
    fragment: str,
    command: str,
    tmp_path: Path,
    tiny_model: Callable[[str], Path],
) -> None:
    """``--inputs`` is checked up front as ``--calibration-data`` is: exit 2, nothing written
    (it used to convert, then write a failing certificate)."""
    src = _llama_with(tmp_path, tiny_model)
    inputs = tmp_path / "inputs.safetensors"
    save_file(tensors, inputs)
    args = [command, str(src), "--inputs", str(inputs), "--coverage", "quick"]
    if command == "model":
        args += ["--to", "bf16", "-o", str(tmp_path / "out")]
    _refused_cleanly(args, tmp_path, f"{inputs}: --inputs: ", fragment)


def test_a_converted_output_given_as_source_names_its_source(
    zoo_converted: Callable[[str, str], Any], tmp_path: Path, workdir: Path
) -> None:
    """An output of this tool is refused as a source before any work, naming the source its
    certificate records: converting it again would round rounded weights and certify them
    against themselves."""
    converted = zoo_converted("gpt2", "bf16-safe").output
    source_id = json.loads((converted / "precision_certificate.json").read_text())["source"]["id"]
    before = tree_digest(converted)

    code, stdout, stderr = _invoke(["model", str(converted), "--to", "fp16-safe"])

    assert code == 2, stderr
    line = assert_one_error_line(
        stderr,
        f"{converted}: is a precision-convert output (bf16-safe, converted from {source_id})",
        "convert the source instead",
    )
    assert "pc-staging" not in line and "--baseline" not in line
    assert stdout == ""
    assert tree_digest(converted) == before
    assert list(workdir.iterdir()) == []


def test_an_uncertified_output_given_as_source_is_refused(tmp_path: Path, workdir: Path) -> None:
    """A ``--no-validate`` output carries the record in its weights but no certificate: refused
    all the same, saying its source is not recorded."""
    src = tiny_source(tmp_path / "src")
    out = tmp_path / "out"
    code, _, stderr = _invoke(["model", str(src), "--to", "bf16", "--no-validate", "-o", str(out)])
    assert code == 0
    # The uncertified output is said so, with the command that certifies it.
    assert f"{out} is not certified (--no-validate): precision-convert validate {out}" in stderr
    before = tree_digest(tmp_path)

    code, _, stderr = _invoke(["model", str(out), "--to", "fp16", "--no-validate"])

    assert code == 2, stderr
    assert_one_error_line(
        stderr, f"{out}: is a precision-convert output (bf16", "its source is not recorded",
        "convert the source instead",
    )  # fmt: skip
    assert tree_digest(tmp_path) == before
    assert list(workdir.iterdir()) == []
