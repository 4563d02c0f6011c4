"""A source whose own weights hold NaN or ±inf is not certified.

The read that hashes the source checks every floating tensor in the same pass (in a
conversion, the writer's own read): a broken source is refused with nothing written at the
target (exit 2, the tensor named); with ``--allow-nonfinite-source`` it goes on and the
certificate fails, naming the tensors and the probes its fp32 baseline could not answer,
which count against coverage. Attention masks stored as ±inf by design are reported, not
refused.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _batch
import _models
import pytest
import torch
from _corrupt import (
    assert_one_error_line,
    raw_safetensors,
    shard,
    tiny_source,
    tree_digest,
)
from jsonschema import Draft202012Validator
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import precision_convert.api.conversion as conversion
import precision_convert.conversion.io.finite as finite
from precision_convert.api.conversion import convert
from precision_convert.cli.main import app
from precision_convert.conversion.io import tensors as tensors_module
from precision_convert.conversion.io.context import PREFETCH_THREAD
from precision_convert.conversion.io.header import read_header
from precision_convert.conversion.io.source import open_source
from precision_convert.conversion.io.writer import write_file
from precision_convert.errors import InputError
from precision_convert.validation.certify.certificate import CERTIFICATE_NAME

SCHEMA = Path(__file__).resolve().parents[1] / "docs" / "schema" / "certificate.schema.json"
#: The embedding row given a NaN: absent from the chosen probe's seeded ids, so only sweep
#: probes (the vocabulary, a long sequence) reach it, as in a real broken row.
ROW = 37
TENSOR = "model.embed_tokens.weight"


def _llama(path: Path, value: float = float("nan")) -> Path:
    """The tiny Llama (untied head: the row is read only where its token is) with ``value``
    at one embedding entry."""
    torch.manual_seed(0)
    model = _models.llama(tie_word_embeddings=False).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight[ROW, 0] = value
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def broken(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _llama(tmp_path_factory.mktemp("broken") / "src")


def _cli(*args: str) -> object:
    return CliRunner().invoke(app, list(args))


def _assert_failed_certificate(out: Path) -> dict[str, object]:
    """The certificate of a broken source: verdict fail, the tensor named, the probes the
    baseline could not answer listed as not covered; valid against the schema."""
    on_disk = json.loads((out / CERTIFICATE_NAME).read_text())
    errors = list(Draft202012Validator(json.loads(SCHEMA.read_text())).iter_errors(on_disk))
    assert not errors, [e.message for e in errors]
    assert on_disk["verdict"] == "fail"
    assert on_disk["source"]["nonfinite"] == {
        "": [{"tensor": TENSOR, "nan": 1, "inf": 0, "by_design": False}]
    }
    assert any("not finite" in f and TENSOR in f for f in on_disk["failures"])
    [component] = on_disk["components"]
    unjudged = component["inputs"]["unjudged"]
    assert unjudged and not set(unjudged) & set(component["inputs"]["probes"])
    # Not judged: listed as not covered (what only they ran counts as not run).
    assert any(f"{len(unjudged)} probe(s) not judged" in i["what"] for i in on_disk["not_covered"])
    assert any(all(p in n for p in unjudged) for n in on_disk["notes"])
    assert "not finite" in (out / "README.md").read_text()
    return on_disk


def test_model_refuses_a_broken_source(broken: Path, tmp_path: Path) -> None:
    before = tree_digest(broken)
    result = _cli("model", str(broken), "--to", "bf16-safe", "-o", str(tmp_path / "out"))
    assert result.exit_code == 2, result.output
    assert_one_error_line(result.stderr, TENSOR, "1 NaN", "--allow-nonfinite-source")
    assert list(tmp_path.iterdir()) == []  # no output, no staging, no lock
    assert tree_digest(broken) == before


def test_model_with_the_override_fails_the_certificate(broken: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = _cli(
        "model", str(broken), "--to", "bf16-safe", "-o", str(out), "--coverage", "quick",
        "--allow-nonfinite-source",
    )  # fmt: skip
    assert result.exit_code == 1, result.output
    _assert_failed_certificate(out)


def test_validate_against_a_broken_baseline(broken: Path, tmp_path: Path) -> None:
    """An output of the broken source: validating it against that source is refused (the
    output untouched), and with the override it fails."""
    out = tmp_path / "out"
    convert(broken, to="bf16", output=out, validate=False, allow_nonfinite_source=True)
    before = tree_digest(out)
    refused = _cli("validate", str(out), "--baseline", str(broken), "--coverage", "quick")
    assert refused.exit_code == 2, refused.output
    assert_one_error_line(refused.stderr, TENSOR, "--allow-nonfinite-source")
    assert tree_digest(out) == before
    allowed = _cli(
        "validate", str(out), "--baseline", str(broken), "--coverage", "quick",
        "--allow-nonfinite-source",
    )  # fmt: skip
    assert allowed.exit_code == 1, allowed.output
    _assert_failed_certificate(out)


def test_library_call_and_pickle_source(tmp_path: Path) -> None:
    """``pc.convert`` raises the same refusal for a ``.bin`` source (read through
    ``torch.load``), an Inf this time; with the override it certifies nothing."""
    src = _llama(tmp_path / "src", float("-inf"))
    state = load_file(src / "model.safetensors")
    (src / "model.safetensors").unlink()
    torch.save(state, src / "pytorch_model.bin")
    with pytest.raises(InputError, match=rf"{TENSOR} \(1 ±inf\)"):
        convert(src, to="bf16", output=tmp_path / "out")
    assert not (tmp_path / "out").exists()
    result = convert(
        src, to="bf16", output=tmp_path / "out", coverage="quick", allow_nonfinite_source=True
    )
    assert result.certificate.verdict == "fail"
    assert result.certificate.source["nonfinite"][""][0]["inf"] == 1


def test_the_read_hashes_and_checks_in_one_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks far smaller than the tensors (a tensor spans many, a block several tensors'
    edges): the digest is the file's sha256 and every non-finite value is counted once. A
    causal-mask buffer of -inf is by design; a mask holding NaN, or a weight holding inf, is
    not; large finite values are not mistaken for inf."""
    src = _llama(tmp_path / "src")
    weights = src / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.layers.0.self_attn.causal_mask"] = torch.full((4, 4), float("-inf")).triu(1)
    tensors["model.layers.1.self_attn.causal_mask"] = torch.tensor([0.0, float("nan")])
    # Finite, though its sum overflows float32: counted, and found clean.
    tensors["model.layers.0.big"] = torch.full((8,), 3e38)
    norm = tensors["model.norm.weight"]
    norm[-3:] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    save_file(tensors, weights, metadata={"format": "pt"})
    monkeypatch.setattr(finite, "BLOCK_BYTES", 24)
    read = finite.read_source(src, {"": open_source(src)})
    assert read.files == {"model.safetensors": hashlib.sha256(weights.read_bytes()).hexdigest()}
    found = {t.tensor: (t.nan, t.inf, t.by_design) for t in read.nonfinite[""]}
    assert found == {
        TENSOR: (1, 0, False),
        "model.layers.0.self_attn.causal_mask": (0, 6, True),
        "model.layers.1.self_attn.causal_mask": (1, 0, False),
        "model.norm.weight": (1, 2, False),
    }
    line = read.broken_line()
    assert line is not None and "(3 tensors)" in line and "causal_mask (1 NaN)" in line
    assert "layers.0.self_attn.causal_mask" not in line


def test_a_mask_by_design_is_reported_not_refused(tmp_path: Path) -> None:
    src = tmp_path / "src"
    torch.manual_seed(0)
    _models.llama(tie_word_embeddings=False).eval().save_pretrained(src)
    weights = src / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.causal_mask"] = torch.full((4, 4), float("-inf")).triu(1)
    save_file(tensors, weights, metadata={"format": "pt"})
    read = finite.read_source(src, {"": open_source(src)})
    read.refuse_broken(src, allow=False)  # nothing to refuse
    assert [t.by_design for t in read.nonfinite[""]] == [True]


def test_a_smoke_check_of_an_output_with_inf_is_no_broken_source(tmp_path: Path) -> None:
    """A plain fp16 output whose weight overflowed to inf is what a smoke check finds, not a
    broken source: ``validate`` without ``--baseline`` runs and fails, it refuses nothing."""
    src = _llama(tmp_path / "src", 1e6)  # finite in fp32, inf in fp16
    out = tmp_path / "out"
    convert(src, to="fp16", output=out, validate=False)
    assert finite.read_source(out, {"": open_source(out)}).broken()  # the inf is there
    result = _cli("validate", str(out), "--coverage", "quick")
    assert result.exit_code == 1, result.output
    on_disk = json.loads((out / CERTIFICATE_NAME).read_text())
    assert on_disk["verdict"] == "fail" and on_disk["source"]["nonfinite"] == {}
    assert not any("source's own weights" in f for f in on_disk["failures"])


def test_batch_entry(broken: Path, tmp_path: Path) -> None:
    """A batch entry of the broken source fails before writing; one with
    ``allow_nonfinite_source = true`` runs and fails its certificate."""
    (tmp_path / "batch.toml").write_text(
        f"""
[defaults]
to = ["bf16"]
output_dir = "out"
coverage = "quick"

[[model]]
source = "{broken}"
name = "refused"

[[model]]
source = "{broken}"
name = "allowed"
allow_nonfinite_source = true
"""
    )
    run = _batch.run(tmp_path)
    results = run.results()
    refused, allowed = results["refused-bf16"], results["allowed-bf16"]
    assert refused["status"] == "failed" and refused["reason"].startswith("convert: ")
    assert TENSOR in refused["reason"] and "--allow-nonfinite-source" in refused["reason"]
    assert not (run.output_dir / "refused-bf16").exists()
    assert allowed["status"] == "failed" and allowed["verdict"] == "fail", allowed
    assert "Traceback" not in run.stderr


def test_nan_in_the_last_tensor_of_the_last_shard(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    """The check rides on the writer's reads, so the last tensor of the last shard is read
    after every other shard was written: the run is still refused in one line, and the
    staged shards go with it (no output directory, no staging, no lock), the source as it
    was."""
    src = tmp_path / "src"
    shutil.copytree(tiny_model("mistral-7b-v0.3"), src)
    last = sorted(src.glob("*.safetensors"))[-1]
    entry = read_header(last).tensors[-1]
    assert entry.dtype.is_float and entry.nbytes
    nan = torch.tensor([float("nan")], dtype=entry.dtype.torch).view(torch.uint8)
    with last.open("r+b") as f:
        f.seek(entry.begin)
        f.write(nan.numpy().tobytes())
    before = tree_digest(src)
    out = tmp_path / "out"
    result = _cli("model", str(src), "--to", "bf16-safe", "--no-validate", "-o", str(out))
    assert result.exit_code == 2, result.output
    assert_one_error_line(result.stderr, f"{entry.name} (1 NaN)", "--allow-nonfinite-source")
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    assert tree_digest(src) == before


class _SourceReads:
    """Every read of ``files`` through ``os.open`` + ``os.pread[v]`` or ``Path.open``, as
    (file, offset, bytes), but the prefetch thread's (it only warms the page cache for the
    reads counted here), while ``counting``."""

    def __init__(self, files: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
        self.files = {f.resolve() for f in files}
        self.reads: list[tuple[Path, int, int]] = []
        self.counting = True
        self._fds: dict[int, Path] = {}
        real_open, real_close, real_io_open = os.open, os.close, io.open
        real_preadv, real_pread = os.preadv, os.pread

        def os_open(path: Any, *args: Any, **kwargs: Any) -> int:
            fd = real_open(path, *args, **kwargs)
            if self._watched(path):
                self._fds[fd] = Path(path).resolve()
            return fd

        def os_close(fd: int) -> None:
            self._fds.pop(fd, None)
            real_close(fd)

        def preadv(fd: int, buffers: Any, offset: int, *args: Any) -> int:
            n = real_preadv(fd, buffers, offset, *args)
            self._record(self._fds.get(fd), offset, n)
            return n

        def pread(fd: int, size: int, offset: int) -> bytes:
            data = real_pread(fd, size, offset)
            self._record(self._fds.get(fd), offset, len(data))
            return data

        def io_open(file: Any, *args: Any, **kwargs: Any) -> Any:
            opened = real_io_open(file, *args, **kwargs)
            return (
                _CountedFile(opened, Path(file).resolve(), self) if self._watched(file) else opened
            )

        monkeypatch.setattr(os, "open", os_open)
        monkeypatch.setattr(os, "close", os_close)
        monkeypatch.setattr(os, "preadv", preadv)
        monkeypatch.setattr(os, "pread", pread)
        monkeypatch.setattr(io, "open", io_open)

    def _watched(self, path: Any) -> bool:
        return isinstance(path, str | Path) and Path(path).resolve() in self.files

    def _record(self, path: Path | None, offset: int, size: int) -> None:
        if path is None or not self.counting or not size:
            return
        if threading.current_thread().name.startswith(PREFETCH_THREAD):
            return
        self.reads.append((path, offset, size))

    def times_read(self, path: Path) -> list[int]:
        """How many times each byte of ``path`` was read."""
        times = [0] * path.stat().st_size
        for file, offset, size in self.reads:
            if file == path.resolve():
                for i in range(offset, offset + size):
                    times[i] += 1
        return times


class _CountedFile:
    """A file object whose reads ``reads`` records."""

    def __init__(self, opened: Any, path: Path, reads: _SourceReads) -> None:
        self._opened, self._path, self._reads = opened, path, reads

    def read(self, size: int = -1) -> bytes:
        offset = self._opened.tell()
        data = self._opened.read(size)
        self._reads._record(self._path, offset, len(data))
        return data

    def readinto(self, buffer: Any) -> int:
        offset = self._opened.tell()
        n = self._opened.readinto(buffer)
        self._reads._record(self._path, offset, n or 0)
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._opened, name)

    def __enter__(self) -> _CountedFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._opened.close()


@pytest.mark.parametrize("validate", [False, True], ids=["no-validate", "certified"])
def test_a_conversion_reads_each_source_byte_once(
    validate: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer's reads are the source's one read: every weight byte is read once, the
    headers (parsed when the source is opened) aside; the certificate records the sha256 of
    each whole file, the bytes the writer did not read (header, padding) included. Counted
    up to the certificate's own run of the fp32 model, which loads the weights to run them."""
    src = _llama(tmp_path / "src", 0.5)
    shard(src, ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"])
    weights = sorted(src.glob("*.safetensors"))
    reads = _SourceReads(weights, monkeypatch)
    certify = conversion._certify

    def certify_uncounted(*args: Any, **kwargs: Any) -> Any:
        reads.counting = False
        return certify(*args, **kwargs)

    monkeypatch.setattr(conversion, "_certify", certify_uncounted)
    result = convert(src, to="bf16-safe", output=tmp_path / "out", validate=validate,
                     coverage="quick")  # fmt: skip
    for path in weights:
        data_start = read_header(path).data_start
        times = reads.times_read(path)
        assert set(times[data_start:]) == {1}, path.name
        assert min(times) >= validate, path.name  # hashed whole when certified
    if validate:
        assert result.certificate.source["files"] == {
            p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in weights
        }


def test_the_writer_hashes_whole_files_with_gaps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file with padding between its tensors and bytes after the last one, read by the
    writer in chunks that straddle tensors: its digest is hashlib's over the whole file and
    the read finds what a read up front finds."""
    monkeypatch.setattr(tensors_module, "CHUNK_BYTES", 100)
    values = torch.randn(37)
    values[3] = float("inf")
    parts = {
        "a": ("F32", [37], values.numpy().tobytes(), b"\x01" * 12),
        "ids": ("I64", [5], torch.arange(5).numpy().tobytes(), b"\x02" * 3),
        "c": ("F16", [50], torch.randn(50).half().view(torch.int16).numpy().tobytes(), b"tail"),
    }
    header: dict[str, object] = {}
    data = b""
    for name, (code, shape, raw, padding) in parts.items():
        header[name] = {
            "dtype": code,
            "shape": shape,
            "data_offsets": [len(data), len(data) + len(raw)],
        }
        data += raw + padding
    src = tiny_source(tmp_path / "src")
    raw_safetensors(src / "model.safetensors", header, data)
    models = {"": open_source(src)}
    watch = finite.SourceWatch(src, models, allow_nonfinite=True)
    watch.read_ahead()
    [weight_file] = models[""].files
    out = tmp_path / "out.safetensors"
    write_file(out, [(t, t.dtype) for t in watch.watched(weight_file)], {})
    read = watch.result()
    whole = hashlib.sha256((src / "model.safetensors").read_bytes()).hexdigest()
    assert read.files == {"model.safetensors": whole}
    assert read.nonfinite == {"": (finite.NonFinite("a", 0, 1),)}
    assert read == finite.read_source(src, models)
    assert torch.equal(load_file(out)["a"], values)


def test_the_watched_writer_reuses_its_read_buffer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watch hands each chunk on and lets go of it before the next is read, so a tensor
    of many chunks is read through one buffer of the run's pool, not a fresh one per chunk
    (fresh memory costs a page fault per 4 KiB, and freeing it an unmap)."""
    monkeypatch.setattr(tensors_module, "CHUNK_BYTES", 4096)
    values = torch.randn(40 * 1024)  # 40 chunks of 4 KiB
    src = tiny_source(tmp_path / "src", {"w": values})
    models = {"": open_source(src)}
    made: list[int] = []
    real_init = tensors_module._Buffer.__init__

    def counted_init(self: Any, size: int) -> None:
        made.append(size)
        real_init(self, size)

    monkeypatch.setattr(tensors_module._Buffer, "__init__", counted_init)
    watch = finite.SourceWatch(src, models, allow_nonfinite=False, hashed=True)
    [weight_file] = models[""].files
    out = tmp_path / "out.safetensors"
    write_file(out, [(t, t.dtype) for t in watch.watched(weight_file)], {})
    assert len(made) == 1, made
    read = watch.result()
    assert (
        read.files["model.safetensors"]
        == hashlib.sha256((src / "model.safetensors").read_bytes()).hexdigest()
    )
    assert torch.equal(load_file(out)["w"], values)


@pytest.mark.parametrize("at", [0, tensors_module.SERIAL_ELEMENTS + 5, -1])
def test_a_nan_anywhere_in_a_chunk_is_counted(at: int) -> None:
    """The check sums a chunk in pieces on its own thread: a NaN or ±inf in any piece, the
    first, a middle one or the short last one, is found and counted exactly."""
    block = torch.randn(3 * tensors_module.SERIAL_ELEMENTS + 7)
    block[at] = float("nan")
    block[at - 3] = float("-inf")
    assert finite._count(block) == (1, 1)
    assert finite._count(torch.randn(3 * tensors_module.SERIAL_ELEMENTS)) == (0, 0)


@pytest.mark.parametrize("to", ["bf16", "fp16"])
def test_a_plain_target_reads_each_source_byte_once(
    to: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plain target's plan stores every floating tensor in its dtype: fp16's weight ranges
    only warn, so they are measured on the writer's read, not on a read of their own, and
    warn as a scan up front would."""
    src = _llama(tmp_path / "src", 0.5)
    scaled = "model.layers.0.mlp.down_proj.weight"
    state = load_file(src / "model.safetensors")
    state[scaled] = state[scaled] * 1e6  # beyond fp16's range
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    shard(src, ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"])
    weights = sorted(src.glob("*.safetensors"))
    reads = _SourceReads(weights, monkeypatch)
    result = convert(src, to=to, output=tmp_path / "out", validate=False)
    for path in weights:
        times = reads.times_read(path)
        assert set(times[read_header(path).data_start :]) == {1}, path.name
    warned = [w for w in result.components[0].plan.warnings if scaled in w]
    if to == "fp16":
        [warning] = warned
        assert "exceed the fp16 range" in warning and "stored in fp16 anyway" in warning
    else:
        assert warned == []  # bf16 has fp32's range: nothing to warn of
