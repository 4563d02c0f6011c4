"""Helpers for the bad-input and interrupted-write tests: tiny sources, hostile files, digests.

Sources here are written by hand (safetensors + a config.json of an unknown ``model_type``) so
they build in milliseconds and convert to a plain ``bf16`` without building any skeleton.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

#: The tensors of the tiny source: a 2-D weight, a norm scale, an integer buffer.
TINY_STATE: dict[str, torch.Tensor] = {
    "layer.weight": torch.arange(16, dtype=torch.float32).reshape(4, 4) / 7,
    "norm.weight": torch.ones(4),
    "position_ids": torch.arange(4, dtype=torch.int64),
}
TINY_CONFIG = {"model_type": "tiny-test", "architectures": ["TinyTestModel"]}


def tiny_source(path: Path, state: dict[str, torch.Tensor] | None = None) -> Path:
    """A single-file safetensors model directory with a config.json and a tokenizer file."""
    path.mkdir(parents=True)
    save_file(dict(state or TINY_STATE), path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(TINY_CONFIG), encoding="utf-8")
    (path / "tokenizer_config.json").write_text("{}", encoding="utf-8")
    return path


def shard(path: Path, names: list[str]) -> Path:
    """Split ``path``'s model.safetensors into two shards plus a ``weight_map`` index."""
    from safetensors.torch import load_file

    state = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    weight_map: dict[str, str] = {}
    for i, part in enumerate((names, [n for n in state if n not in names]), start=1):
        shard_name = f"model-{i:05d}-of-00002.safetensors"
        save_file({n: state[n] for n in part}, path / shard_name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard_name))
    write_index(path, weight_map)
    return path


def write_index(path: Path, weight_map: dict[str, str]) -> None:
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index), encoding="utf-8")


def raw_safetensors(
    path: Path, header: dict | bytes, data: bytes = b"", *, header_len: int | None = None
) -> None:
    """Write a safetensors file byte by byte, so any field can be made to lie."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    size = len(raw) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", size) + raw + data)


class RunsCode:
    """Unpickling this calls ``func(*args)``: the attack ``weights_only=True`` must stop."""

    def __init__(self, func: object, *args: object) -> None:
        self.func = func
        self.args = args

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return self.func, self.args


def tree_digest(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` by relative path (directories listed too)."""
    digest: dict[str, str] = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            digest[rel] = f"link:{os.readlink(path)}"
        elif path.is_dir():
            digest[rel] = "dir"
        else:
            digest[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return digest


def tree_state(root: Path) -> dict[str, tuple[str, int]]:
    """Every entry under ``root``, and ``root`` itself: its content (a file's sha256, a link's
    target, a folder's or a node's kind) and its mtime in nanoseconds. Walked without
    recursion, so a tree nested a thousand levels deep is no problem."""
    found: dict[str, tuple[str, int]] = {}
    pending = [root]
    while pending:
        path = pending.pop()
        info = path.lstat()
        if stat.S_ISLNK(info.st_mode):
            what = f"link:{os.readlink(path)}"
        elif stat.S_ISREG(info.st_mode):
            what = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            what = stat.filemode(info.st_mode)[0]
            if stat.S_ISDIR(info.st_mode):
                pending += path.iterdir()
        found[path.relative_to(root).as_posix()] = (what, info.st_mtime_ns)
    return found


def leftovers(parent: Path) -> list[str]:
    """Staging or trash entries the atomic writer may leave beside its target."""
    return sorted(
        p.name for p in parent.iterdir() if ".pc-staging-" in p.name or ".pc-trash-" in p.name
    )


def cli_command() -> list[str]:
    """The installed ``precision-convert`` console script (the way users run it)."""
    script = Path(sys.executable).with_name("precision-convert")
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-c", "from precision_convert.cli.main import run; run()"]


def cli_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PRECISION_CONVERT_DEBUG"}
    env.update(HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", COLUMNS="200")
    return env


def _progress(line: str) -> bool:
    from precision_convert.cli._common import PROGRESS_PREFIX

    return line.startswith(PROGRESS_PREFIX)


def assert_one_error_line(stderr: str, *fragments: str) -> str:
    """stderr is exactly one ``precision-convert: …`` line holding every fragment (progress
    lines, which a stderr that is no terminal gets, aside)."""
    lines = [line for line in stderr.splitlines() if line.strip() and not _progress(line)]
    assert "Traceback" not in stderr, stderr
    assert len(lines) == 1, stderr
    line = lines[0]
    assert line.startswith("precision-convert: "), line
    for fragment in fragments:
        assert fragment in line, f"{fragment!r} not in {line!r}"
    return line
