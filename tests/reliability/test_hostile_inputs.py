"""Hostile inputs that ``tests/test_bad_input.py`` does not already cover.

That file refuses 34 broken or hostile sources through ``model`` and ``inspect`` (truncated,
overlapping and oversized headers, index traversal by ``../`` and absolute paths, pickles that
run code, malformed config/index/model_index JSON) and bad flags. Here: gigantic declared
shapes, symbolic links that leave the model directory (and the Hub cache's links, which must
keep working), malformed OpenCLIP configs, pipeline indexes naming folders outside the
pipeline, hostile calibration data, ``--inputs`` files and batch manifests, and weights full
of NaN/Inf (converted, then clearly refused by validation).

Every refusal: exit 2, one ``precision-convert: <file>: <problem>`` line, no traceback,
nothing written, the source unchanged, no code run.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from _corrupt import (
    assert_one_error_line,
    raw_safetensors,
    shard,
    tiny_source,
    tree_digest,
)
from safetensors.torch import save_file
from test_bad_input import MARKER, Case, _invoke

# -- safetensors headers -------------------------------------------------------------------


def _weights(src: Path) -> Path:
    return src / "model.safetensors"


def gigantic_shape(src: Path) -> Path:
    """A shape whose element count overflows 64 bits, over 16 bytes of data."""
    header = {"a.weight": {"dtype": "F32", "shape": [2**40, 2**40, 2**40], "data_offsets": [0, 16]}}
    raw_safetensors(_weights(src), header, bytes(16))
    return _weights(src)


def gigantic_consistent_tensor(src: Path) -> Path:
    """Shape and offsets agree, on 4 EiB the file does not have."""
    header = {"a.weight": {"dtype": "F32", "shape": [2**60], "data_offsets": [0, 2**62]}}
    raw_safetensors(_weights(src), header, bytes(16))
    return _weights(src)


def many_dimensions(src: Path) -> Path:
    header = {"a.weight": {"dtype": "F32", "shape": [1] * 10_000, "data_offsets": [0, 4]}}
    raw_safetensors(_weights(src), header, bytes(4))
    return _weights(src)


def float_dimension(src: Path) -> Path:
    header = {"a.weight": {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}}
    raw_safetensors(_weights(src), header, bytes(8))
    return _weights(src)


def negative_offset(src: Path) -> Path:
    header = {"a.weight": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}}
    raw_safetensors(_weights(src), header, bytes(4))
    return _weights(src)


# -- symbolic links ------------------------------------------------------------------------


def _outside(src: Path, name: str, data: bytes) -> Path:
    path = src.parent / "elsewhere" / name
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(data)
    return path


def weights_link_outside(src: Path) -> Path:
    real = _outside(src, "other.safetensors", _weights(src).read_bytes())
    _weights(src).unlink()
    _weights(src).symlink_to(real)
    return _weights(src)


def config_link_outside(src: Path) -> Path:
    real = _outside(src, "config.json", (src / "config.json").read_bytes())
    (src / "config.json").unlink()
    (src / "config.json").symlink_to(real)
    return src / "config.json"


def copied_file_link_outside(src: Path) -> Path:
    """A file the conversion copies (and a push would upload): a link to a secret."""
    secret = _outside(src, "id_rsa", b"-----BEGIN OPENSSH PRIVATE KEY-----\n")
    (src / "tokenizer.json").symlink_to(secret)
    return src / "tokenizer.json"


def shard_link_outside(src: Path) -> Path:
    shard(src, ["layer.weight"])
    name = "model-00001-of-00002.safetensors"
    _outside(src, name, (src / name).read_bytes())
    (src / name).unlink()
    (src / name).symlink_to(Path("..") / "elsewhere" / name)  # relative, through ..
    return src / name


def directory_link_outside(src: Path) -> Path:
    (src.parent / "elsewhere").mkdir(exist_ok=True)
    (src / "extra").symlink_to(src.parent / "elsewhere", target_is_directory=True)
    return src / "extra"


def pipeline_component_link_outside(src: Path) -> Path:
    index = {"_class_name": "StableDiffusionPipeline", "unet": ["diffusers", "UNet"]}
    (src / "model_index.json").write_text(json.dumps(index))
    unet = tiny_source(src.parent / "elsewhere-unet")
    (src / "unet").symlink_to(unet, target_is_directory=True)
    return src / "unet"


def link_loop(src: Path) -> Path:
    (src / "a.json").symlink_to(src / "b.json")
    (src / "b.json").symlink_to(src / "a.json")
    return src / "a.json"


# -- OpenCLIP and pipeline configs ---------------------------------------------------------


def _open_clip(src: Path, text: str) -> Path:
    (src / "config.json").unlink()
    (src / "open_clip_config.json").write_text(text)
    return src / "open_clip_config.json"


def open_clip_not_json(src: Path) -> Path:
    return _open_clip(src, '{"model_cfg": {')


def open_clip_without_model_cfg(src: Path) -> Path:
    return _open_clip(src, json.dumps({"preprocess_cfg": {}}))


def open_clip_text_cfg_not_object(src: Path) -> Path:
    return _open_clip(src, json.dumps({"model_cfg": {"text_cfg": [1, 2]}}))


def open_clip_deeply_nested(src: Path) -> Path:
    return _open_clip(src, "[" * 100_000 + "]" * 100_000)


def pipeline_index_names_parent(src: Path) -> Path:
    """``model_index.json`` naming ``..`` and an absolute folder as components: neither is
    read, so the pipeline has no component."""
    tiny_source(src.parent / "sibling")
    index = {
        "_class_name": "StableDiffusionPipeline",
        "..": ["diffusers", "UNet"],
        str(src.parent / "sibling"): ["diffusers", "UNet"],
    }
    (src / "model_index.json").write_text(json.dumps(index))
    return src / "model_index.json"


def pipeline_index_not_object(src: Path) -> Path:
    (src / "model_index.json").write_text(json.dumps(["unet"]))
    return src / "model_index.json"


CASES = [
    Case("gigantic-shape", gigantic_shape, "data_offsets span 16 bytes"),
    Case("gigantic-tensor", gigantic_consistent_tensor, "truncated: tensor 'a.weight' ends at"),
    Case("many-dimensions", many_dimensions, "10000 dimensions"),
    Case("float-dimension", float_dimension, "shape must be a list of non-negative integers"),
    Case("negative-offset", negative_offset, "data_offsets must be [begin, end]"),
    Case("weights-link", weights_link_outside, "symbolic link to"),
    Case("config-link", config_link_outside, "outside the model directory"),
    Case("copied-file-link", copied_file_link_outside, "outside the model directory"),
    Case("shard-link", shard_link_outside, "outside the model directory"),
    Case("directory-link", directory_link_outside, "outside the model directory"),
    Case("component-link", pipeline_component_link_outside, "outside the model directory"),
    Case("link-loop", link_loop, "symbolic link"),
    Case("open-clip-not-json", open_clip_not_json, "not valid JSON"),
    Case("open-clip-no-model-cfg", open_clip_without_model_cfg, "no 'model_cfg' object"),
    Case("open-clip-text-cfg", open_clip_text_cfg_not_object, "'model_cfg.text_cfg' must be"),
    Case("open-clip-deeply-nested", open_clip_deeply_nested, "not valid JSON"),
    Case("pipeline-index-traversal", pipeline_index_names_parent, "no component with weights"),
    Case("pipeline-index-not-object", pipeline_index_not_object, "expected a JSON object"),
]


def _refused(args: list[str], root: Path, *fragments: str) -> None:
    """The command exits 2 with one line holding ``fragments`` and writes nothing under
    ``root``."""
    before = tree_digest(root)
    code, stdout, stderr = _invoke(args)
    assert code == 2, stderr
    assert_one_error_line(stderr, *fragments)
    assert stdout == ""
    assert tree_digest(root) == before
    assert not (root / MARKER).exists()


@pytest.mark.parametrize("command", ["model", "inspect"])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_source(case: Case, command: str, tmp_path: Path, workdir: Path) -> None:
    src = tiny_source(tmp_path / "src")
    named = case.make(src)
    args = [command, str(src)] + (["--to", "bf16", "--no-validate"] if command == "model" else [])
    _refused(args, tmp_path, f"{named}: ", case.fragment)


def test_validate_refuses_a_linked_file_too(tmp_path: Path) -> None:
    """``validate`` reads the converted directory (and pushes upload it): same rule."""
    src = tiny_source(tmp_path / "src")
    named = copied_file_link_outside(src)
    _refused(["validate", str(src)], tmp_path, f"{named}: ", "outside the model directory")


def test_links_inside_the_model_and_into_the_hub_cache_blobs_are_fine(tmp_path: Path) -> None:
    """A link to a file of the model itself, and the Hub cache's snapshot links into its
    ``blobs/`` (how every downloaded model looks), are read as usual."""
    repo = tmp_path / "hub" / "models--ns--tiny"
    snapshot = repo / "snapshots" / ("0" * 40)
    src = tiny_source(snapshot)
    (repo / "blobs").mkdir()
    for path in list(snapshot.iterdir()):
        blob = repo / "blobs" / hashlib.sha256(path.read_bytes()).hexdigest()
        path.rename(blob)
        path.symlink_to(Path("..", "..", "blobs", blob.name))
    (snapshot / "tokenizer.json").symlink_to("tokenizer_config.json")  # inside the model
    out = tmp_path / "out"

    code, _, stderr = _invoke(["model", str(src), "--to", "bf16", "--no-validate", "-o", str(out)])

    assert code == 0, stderr
    assert (out / "tokenizer.json").read_text() == "{}" and not (
        out / "tokenizer.json"
    ).is_symlink()


# -- files given on the command line ---------------------------------------------------------


def _deep_jsonl(path: Path) -> None:
    path.write_text('{"input_ids": ' + "[" * 100_000 + "]" * 100_000 + "}\n")


def _not_utf8(path: Path) -> None:
    path.write_bytes(b"\xff\xfe\x00\x01 not text")


def _array_too_deep_for_a_tensor(path: Path) -> None:
    path.write_text('{"input_ids": ' + "[" * 500 + "1" + "]" * 500 + "}\n")


def _nan_value(path: Path) -> None:
    path.write_text('{"input_ids": [[1, NaN]]}\n')


@pytest.mark.parametrize(
    ("write", "fragment"),
    [
        (_not_utf8, "cannot read the file"),
        (_nan_value, "input_ids"),
        (_deep_jsonl, "line 1"),
        (_array_too_deep_for_a_tensor, "line 1"),
    ],
    ids=["not-utf8", "nan", "deeply-nested-json", "deep-array"],
)
def test_hostile_calibration_data(
    write: Callable[[Path], None], fragment: str, tmp_path: Path, workdir: Path
) -> None:
    src = tiny_source(tmp_path / "src")
    data = tmp_path / "data.jsonl"
    write(data)
    args = ["model", str(src), "--to", "bf16", "--calibration-data", str(data)]
    _refused(args, tmp_path, f"{data}: ", fragment)


def _inputs_truncated(path: Path) -> None:
    save_file({"input_ids": torch.ones(1, 4, dtype=torch.int64)}, path)
    path.write_bytes(path.read_bytes()[:-5])


def _inputs_overlapping(path: Path) -> None:
    header = {
        "input_ids": {"dtype": "I64", "shape": [1, 2], "data_offsets": [0, 16]},
        "attention_mask": {"dtype": "I64", "shape": [1, 2], "data_offsets": [8, 24]},
    }
    raw_safetensors(path, header, bytes(24))


def _inputs_header_too_long(path: Path) -> None:
    raw_safetensors(path, {}, header_len=2**40)


@pytest.mark.parametrize(
    "write",
    [_inputs_truncated, _inputs_overlapping, _inputs_header_too_long],
    ids=["truncated", "overlapping", "header-length"],
)
@pytest.mark.parametrize("command", ["model", "validate"])
def test_hostile_inputs_file(
    write: Callable[[Path], None], command: str, tmp_path: Path, workdir: Path
) -> None:
    src = tiny_source(tmp_path / "src")
    inputs = tmp_path / "inputs.safetensors"
    write(inputs)
    args = [command, str(src), "--inputs", str(inputs)]
    if command == "model":
        args += ["--to", "bf16"]
    _refused(args, tmp_path, f"{inputs}: ")


# -- batch manifests -----------------------------------------------------------------------

_SOURCE = '[[model]]\nsource = "./m"\n'


MANIFESTS = [
    ("not-toml", '[defaults\nto = "bf16"\n', "not valid TOML"),
    ("binary", "\x00\x01\x02", "not valid TOML"),
    ("deeply-nested", "to = " + "[" * 100_000 + "]" * 100_000 + "\n", "not valid TOML"),
    ("to-not-string", f"[defaults]\nto = 5\n{_SOURCE}", "to must be a string or a list"),
    ("model-not-array", '[defaults]\nto = "bf16"\n[model]\nsource = "./m"\n', "at least one"),
    ("no-model", '[defaults]\nto = "bf16"\n', "at least one [[model]]"),
    ("source-not-string", '[defaults]\nto = "bf16"\n[[model]]\nsource = 1\n', "source must be"),
    ("name-slash", f'[defaults]\nto = "bf16"\n{_SOURCE}name = "a/b"\n', "plain folder name"),
    ("name-dotdot", f'[defaults]\nto = "bf16"\n{_SOURCE}name = ".."\n', "plain folder name"),
    ("name-backslash", f'[defaults]\nto = "bf16"\n{_SOURCE}name = "a\\\\b"\n', "plain folder"),
    ("name-hidden", f'[defaults]\nto = "bf16"\n{_SOURCE}name = ".ssh"\n', "plain folder name"),
    ("name-dotdot-inside", f'[defaults]\nto = "bf16"\n{_SOURCE}name = "a..b"\n', "plain folder"),
    ("bool-not-bool", f'[defaults]\nto = "bf16"\n{_SOURCE}calibrate = "yes"\n', "true or false"),
    ("push-not-repo", f'[defaults]\nto = "bf16"\n{_SOURCE}push = "../../x"\n', "not a Hub repo"),
    ("device", f'[defaults]\nto = "bf16"\n{_SOURCE}device = "tpu"\n', "device 'tpu'"),
]


@pytest.mark.parametrize(
    ("text", "fragment"), [m[1:] for m in MANIFESTS], ids=[m[0] for m in MANIFESTS]
)
def test_hostile_manifest(text: str, fragment: str, tmp_path: Path) -> None:
    tiny_source(tmp_path / "m")
    manifest = tmp_path / "batch.toml"
    manifest.write_text(text)
    _refused(["batch", str(manifest)], tmp_path, f"{manifest}", fragment)


# -- NaN and Inf ---------------------------------------------------------------------------


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_nonfinite_weights_are_refused_or_converted_and_failed_when_allowed(
    value: float, tmp_path: Path, tiny_model: Callable[[str], Path]
) -> None:
    """A source holding NaN/Inf is refused before anything is written (exit 2, the tensor
    named); with --allow-nonfinite-source conversion copies what it is given (a cast of NaN is
    NaN) and validation refuses to certify: exit 1, a last line naming the NaN/Inf, a failing
    certificate on disk."""
    from safetensors.torch import load_file

    src = tmp_path / "src"
    shutil.copytree(tiny_model("llama"), src)
    state = load_file(src / "model.safetensors")
    name = next(n for n in state if n.endswith("mlp.down_proj.weight"))
    state[name] = torch.full_like(state[name], value)
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    args = ["model", str(src), "--to", "bf16", "--coverage", "quick", "-o", str(out)]

    code, stdout, stderr = _invoke(args)
    assert code == 2, stderr
    assert_one_error_line(stderr, f"{src}: ", "not finite", name)
    assert not out.exists()

    code, stdout, stderr = _invoke([*args, "--allow-nonfinite-source"])

    assert code == 1, stderr
    assert "Traceback" not in stdout + stderr
    converted = load_file(out / "model.safetensors")[name]
    assert converted.dtype == torch.bfloat16 and not torch.isfinite(converted).any()
    certificate = json.loads((out / "precision_certificate.json").read_text())
    assert certificate["verdict"] == "fail"
    assert any(name in line for line in certificate["failures"])
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("precision-convert: ") and "NaN/Inf" in last, stderr
