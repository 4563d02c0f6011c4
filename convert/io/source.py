"""Find what a source directory holds: its kind, configs and weight files, read lazily.

Supported layouts: a transformers model dir, a diffusers model dir, a whole diffusers pipeline
(``model_index.json``), an OpenCLIP Hub-style dir (``open_clip_config.json``), or a Hub repo id
that is downloaded first. Everything is checked here, before a single output byte is written.
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from precision_convert.conversion.io.header import read_header
from precision_convert.conversion.io.tensors import FileTensor, LazyTensor, MemoryTensor
from precision_convert.core.dtypes import from_torch
from precision_convert.core.errors import (
    InputError,
    UnsafeCheckpointError,
    first_line,
    home_expanded,
    one_line,
)
from precision_convert.core.hub_client import WaitTooLong
from precision_convert.core.patterns import HUB_ID, VARIANT_FILE, VARIANT_NAME

#: Weight file stems each library writes, in the order we prefer them.
_WEIGHT_STEMS = ("model", "diffusion_pytorch_model", "open_clip_model")
#: Legacy pickle names and the safetensors names they are written out as.
_PICKLE_TO_SAFETENSORS = {
    "pytorch_model": "model",
    "diffusion_pytorch_model": "diffusion_pytorch_model",
    "open_clip_pytorch_model": "open_clip_model",
}
#: Files that hold weights in some format. They are never copied: the converted safetensors
#: replace the chosen ones, and any other copy (another variant, another framework) would be a
#: stale full-precision duplicate.
_WEIGHT_FILE = re.compile(
    r".*\.(safetensors|msgpack|h5|ckpt|pt|pth|onnx|gguf)$|.*\.(safetensors|bin)\.index\.json$"
    r"|(pytorch_model|diffusion_pytorch_model|open_clip_pytorch_model)([-.].*)?\.bin$"
)


@dataclass(frozen=True)
class WeightFile:
    """One source weight file and the safetensors file it becomes."""

    path: Path
    output_name: str
    tensors: tuple[LazyTensor, ...]
    aliases: dict[str, str] = field(default_factory=dict)  # dropped name -> kept name
    metadata: dict[str, str] = field(default_factory=dict)  # a safetensors source's own


@dataclass(frozen=True)
class ModelSource:
    """One model: a transformers/diffusers/OpenCLIP directory (or a pipeline component)."""

    root: Path
    library: str  # "transformers", "diffusers" or "open_clip"
    config_name: str
    config: dict[str, Any]
    files: tuple[WeightFile, ...]  # output names are the plain (variant-less) names
    index_name: str | None  # output index file name when the source is sharded
    index_metadata: dict[str, Any]
    variant: str | None = None  # the Hub variant the weights were read under

    @property
    def class_name(self) -> str | None:
        if self.library == "diffusers":
            return self.config.get("_class_name")
        if self.library == "open_clip":
            text_cfg = self.config.get("model_cfg", {}).get("text_cfg", {})
            return "CustomTextCLIP" if text_cfg.get("hf_model_name") else "CLIP"
        architectures = self.config.get("architectures") or [None]
        return architectures[0]

    @property
    def model_type(self) -> str | None:
        return self.config.get("model_type")

    def tensors(self) -> Iterator[LazyTensor]:
        for weight_file in self.files:
            yield from weight_file.tensors

    def is_weight_file(self, name: str) -> bool:
        return bool(_WEIGHT_FILE.fullmatch(name))


@dataclass(frozen=True)
class PipelineSource:
    """A diffusers pipeline: torch components converted one by one, the rest copied."""

    root: Path
    model_index: dict[str, Any]
    components: dict[str, ModelSource]


Source = ModelSource | PipelineSource


def resolve(
    source: str | Path,
    revision: str | None = None,
    *,
    timeout: float | None = None,
    variant: str | None = None,
) -> Path:
    """A local directory for ``source``, downloading a Hub repo id when no such path exists
    (with ``variant``, only that variant's weights beside the other files: see
    :func:`_variant_files`).

    ``timeout`` bounds, in seconds, what huggingface_hub lets a caller bound per call: each
    file's metadata request (``etag_timeout``; the ``HF_HUB_ETAG_TIMEOUT`` variable, when set,
    takes precedence inside huggingface_hub). File data reads are bounded by huggingface_hub
    itself (``HF_HUB_DOWNLOAD_TIMEOUT``, 10 s by default). The repo look-up and the file listing
    take no per-call timeout: they wait as long as huggingface_hub's shared HTTP client lets
    them, which is process-wide (``huggingface_hub.set_client_factory``) and so left to the
    application; this function changes no huggingface_hub setting. The ``precision-convert``
    command bounds them for its own process (``PRECISION_CONVERT_HUB_TIMEOUT``).
    """
    path = local_directory(source, revision)
    if path is not None:
        return path
    text = str(source)
    from huggingface_hub import snapshot_download

    options: dict[str, Any] = {} if timeout is None else {"etag_timeout": timeout}
    try:
        if variant is not None:
            options["allow_patterns"] = _variant_files(text, revision, variant)
        return Path(snapshot_download(text, revision=revision, **options))
    except Exception as exc:  # whatever the download raises, the Hub could not provide it
        raise InputError(_hub_failure(exc, revision), text) from exc


def local_directory(source: str | Path, revision: str | None = None) -> Path | None:
    """The local directory ``source`` names, or None when it names no path and reads as a Hub
    repo id; :class:`InputError` when it can be neither (a path that does not exist, a file,
    ``revision`` given for a directory). Cheap: no import, no request, so a command says so
    before its heavy imports."""
    path = home_expanded(source)
    if path.exists():
        if not path.is_dir():
            raise InputError(
                "not a directory: a source is a model directory or a Hub repo id", path
            )
        if revision is not None:
            raise InputError("--revision applies to Hub repo ids, not local directories", path)
        return path
    text = str(source)
    if text.startswith((".", "/", "~")) or not HUB_ID.fullmatch(text):
        raise InputError("no such directory", path)
    return None


def _variant_files(repo_id: str, revision: str | None, variant: str) -> list[str] | None:
    """What loading ``variant`` of a Hub repo needs: every file of the repo's listing but the
    weights that are not the variant's (the plain fp32 ones above all, often the bulk of the
    repo), as exact ``allow_patterns``. None offline: the cache holds what it holds."""
    from huggingface_hub import HfApi, constants

    if constants.HF_HUB_OFFLINE:
        return None
    wanted = []
    for path in HfApi().list_repo_files(repo_id, revision=revision):
        found = VARIANT_FILE.fullmatch(path.rsplit("/", 1)[-1])
        ours = found is not None and variant in (found["variant"], found["ivariant"])
        if ours or not _WEIGHT_FILE.fullmatch(path):
            wanted.append(glob.escape(path))  # allow_patterns are fnmatch patterns
    return wanted


def _hub_failure(exc: Exception, revision: str | None) -> str:
    """One line saying why ``snapshot_download`` failed, and the fix where there is one.

    The client's own messages start with "404 Client Error." whether the repo or the revision
    is missing, so those are named here. Transport errors (a connection dropped mid-download)
    are not ``OSError`` in huggingface_hub >= 1 (httpx), hence the catch-all around the call.
    """
    from huggingface_hub.errors import (
        GatedRepoError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(exc, GatedRepoError):
        return "gated repo on the Hub: accept its terms on its page, then log in (hf auth login)"
    if isinstance(exc, RepositoryNotFoundError):
        return (
            "not a local directory, and no such model repo on the Hub "
            "(a private or gated repo needs a token: hf auth login)"
        )
    if isinstance(exc, RevisionNotFoundError):
        return f"the Hub repo has no revision {revision or 'main'!r}"
    if isinstance(exc, WaitTooLong):  # its text says what was asked and when to come back
        return f"not a local directory, and the Hub could not provide it now: {exc}"
    text = first_line(str(exc)).removeprefix("Got: ")
    detail = text or type(exc).__name__
    if text and not isinstance(exc, OSError):  # transport errors: their text alone is vague
        detail = f"{type(exc).__name__}: {detail}"
    return f"not a local directory, and the Hub could not provide it: {detail}"


def open_source(path: Path, variant: str | None = None) -> Source:
    """Inspect ``path`` and return what it holds, every file checked.

    ``variant`` reads the Hub variant's weight files (``model.<variant>.safetensors``…), as
    ``from_pretrained(..., variant=)`` does. Without one, a model that holds only one variant's
    weights (an output written with ``--variant``) is read under that variant.
    """
    if variant is not None and not VARIANT_NAME.fullmatch(variant):
        raise InputError(f"not a variant name: {variant!r} (letters, digits and _)", path)
    check_links(path)
    if (path / "model_index.json").is_file():
        return _pipeline(path, variant)
    return _model(path, variant)


#: Folders nested deeper than this under a model directory are refused. Real layouts are a
#: few levels (a pipeline's component, a tokenizer's subfolder); a deeper tree is no model, and
#: the standard library's tree walks and copies (``shutil.copytree``, ``os.walk`` before Python
#: 3.12) recurse once per level into Python's recursion limit.
MAX_DEPTH = 32


def check_links(root: Path) -> None:
    """Refuse a symbolic link anywhere under ``root`` that leads out of it, a name that is not
    UTF-8 text, and folders nested deeper than :data:`MAX_DEPTH`.

    Everything under a model directory is read or copied into the output (and from there
    pushed to the Hub), so a link to ``~/.ssh/id_rsa`` named ``tokenizer.json``, or a shard
    index entry that is a link to another model's weights, would leak or mix in files the
    user never meant to convert. The one exception is the Hub cache's own layout: a snapshot
    (``…/snapshots/<revision>/``) holds links into its repo's ``blobs/`` folder. Names end up
    as text in the certificate, the model card and the Hub, so a name with bytes that are not
    UTF-8 (possible on Linux) is refused, the directory's own path included.
    """
    check_text(str(root.absolute()), root)
    base = root.resolve()
    blobs = next((a.parent / "blobs" for a in (base, *base.parents) if a.name == "snapshots"), None)
    pending = [(root, 0)]
    while pending:  # depth first, without recursion
        directory, depth = pending.pop()
        if depth > MAX_DEPTH:
            raise InputError(
                f"folders nested more than {MAX_DEPTH} levels deep: not a model directory", root
            )
        try:
            with os.scandir(directory) as listing:
                entries = sorted(listing, key=lambda e: e.name)
        except OSError as exc:
            raise InputError(f"cannot read it ({exc.strerror or exc})", directory) from None
        for found in entries:
            entry = Path(found.path)
            check_text(found.name, entry)
            if found.is_symlink():
                _check_link(entry, base, blobs)
            elif found.is_dir(follow_symlinks=False):
                pending.append((entry, depth + 1))


def check_text(name: str, path: Path) -> None:
    """Refuse ``name`` (``path``'s, or its last component) unless it is UTF-8 text."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise InputError(
            "the name is not valid UTF-8 text (the certificate, the card and the Hub keep "
            "names as text): rename it",
            path,
        ) from None


def _check_link(entry: Path, base: Path, blobs: Path | None) -> None:
    try:
        target = entry.resolve()
    except (OSError, RuntimeError):  # a loop of links
        raise InputError("is a symbolic link that leads nowhere (a loop)", entry) from None
    inside = target == base or base in target.parents
    if not inside and not (blobs is not None and target.parent == blobs):
        raise InputError(
            f"is a symbolic link to {target}, outside the model directory "
            "(copy the file in instead)",
            entry,
        )


def variant_name(name: str, variant: str | None) -> str:
    """``name`` as the Hub names it for ``variant`` (transformers' and diffusers' rule):
    ``model.safetensors`` -> ``model.fp16.safetensors``, shard ``model-00001-of-00002.safetensors``
    -> ``model.fp16-00001-of-00002.safetensors``, ``model.safetensors.index.json`` ->
    ``model.safetensors.index.fp16.json``."""
    if variant is None:
        return name
    if name.endswith(".index.json"):
        return f"{name.removesuffix('.json')}.{variant}.json"
    stem, _, extension = name.rpartition(".")
    shard = re.search(r"-\d+-of-\d+$", stem)
    if shard:
        return f"{stem[: shard.start()]}.{variant}{shard.group()}.{extension}"
    return f"{stem}.{variant}.{extension}"


def variants(root: Path) -> list[str]:
    """The variants whose weights ``root`` holds (a model directory, not a pipeline)."""
    found = set()
    for entry in root.iterdir():
        match = VARIANT_FILE.fullmatch(entry.name)
        if match and (match["stem"] or match["istem"]) in (*_WEIGHT_STEMS, *_PICKLE_TO_SAFETENSORS):
            found.add(match["variant"] or match["ivariant"])
    return sorted(found)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:  # deep nesting
        raise InputError(f"not valid JSON ({exc})", path) from None
    if not isinstance(data, dict):
        raise InputError("expected a JSON object", path)
    return data


def _pipeline(root: Path, variant: str | None) -> PipelineSource:
    index = _read_json(root / "model_index.json")
    components: dict[str, ModelSource] = {}
    for name, spec in index.items():
        if name.startswith("_") or not isinstance(spec, list) or spec[:1] == [None]:
            continue
        directory = root / name
        if (
            directory.is_dir()
            and "/" not in name
            and name not in ("..", ".")
            and any(_WEIGHT_FILE.fullmatch(p.name) for p in directory.iterdir())
        ):
            components[name] = _model(directory, variant)
    if not components:
        raise InputError("pipeline has no component with weights", root / "model_index.json")
    return PipelineSource(root, index, components)


def _model(root: Path, variant: str | None) -> ModelSource:
    if (root / "open_clip_config.json").is_file():
        library, config_name = "open_clip", "open_clip_config.json"
    elif (root / "config.json").is_file():
        config_name = "config.json"
        library = "diffusers" if "_class_name" in _read_json(root / config_name) else "transformers"
    else:
        raise InputError(
            "no config.json, model_index.json or open_clip_config.json: not a model directory",
            root,
        )
    config = _read_json(root / config_name)
    _check_config(config, library, root / config_name)
    if variant is not None and library == "open_clip":
        raise InputError("OpenCLIP has no variant weight files: drop the variant", root)
    if variant is None and not _plain_weights(root):
        found = variants(root)
        if len(found) > 1:
            raise InputError(
                f"no default weights, only variants {', '.join(found)}: choose one (variant=...)",
                root,
            )
        variant = found[0] if found else None
    files, index_name, index_metadata = _weight_files(root, variant)
    return ModelSource(
        root, library, config_name, config, files, index_name, index_metadata, variant
    )


def _check_config(config: dict[str, Any], library: str, path: Path) -> None:
    """Reject the keys this tool reads (recipe matching, skeletons) when their type is wrong."""
    if library == "open_clip":
        model_cfg = config.get("model_cfg")
        if not isinstance(model_cfg, dict):
            raise InputError("open_clip_config.json has no 'model_cfg' object", path)
        if not isinstance(model_cfg.get("text_cfg", {}), dict):
            raise InputError("'model_cfg.text_cfg' must be an object", path)
        return
    for key in ("model_type", "_class_name"):
        if config.get(key) is not None and not isinstance(config[key], str):
            raise InputError(f"{key!r} must be a string, not {type(config[key]).__name__}", path)
    architectures = config.get("architectures")
    if architectures is not None and not (
        isinstance(architectures, list) and all(isinstance(a, str) for a in architectures)
    ):
        raise InputError("'architectures' must be a list of strings", path)


def _plain_weights(root: Path) -> bool:
    """Whether ``root`` holds weights under the library's default (variant-less) names."""
    stems = (*_WEIGHT_STEMS, *_PICKLE_TO_SAFETENSORS)
    return any(
        (root / f"{stem}.{ext}{index}").is_file()
        for stem in stems
        for ext in ("safetensors", "bin")
        for index in ("", ".index.json")
    )


def _weight_files(
    root: Path, variant: str | None
) -> tuple[tuple[WeightFile, ...], str | None, dict[str, Any]]:
    """The weights to convert, under ``variant``'s names; output names are always the plain
    ones (the writer adds the output's own variant)."""

    def named(name: str) -> str:
        return variant_name(name, variant)

    for stem in _WEIGHT_STEMS:
        if (root / named(f"{stem}.safetensors.index.json")).is_file():
            return _sharded(
                root,
                named(f"{stem}.safetensors.index.json"),
                f"{stem}.safetensors.index.json",
                variant,
            )
        if (root / named(f"{stem}.safetensors")).is_file():
            return (
                (_safetensors_file(root / named(f"{stem}.safetensors"), f"{stem}.safetensors"),),
                None,
                {},
            )
    for stem, out_stem in _PICKLE_TO_SAFETENSORS.items():
        if (root / named(f"{stem}.bin.index.json")).is_file():
            return _sharded(
                root, named(f"{stem}.bin.index.json"), f"{out_stem}.safetensors.index.json", variant
            )
        if (root / named(f"{stem}.bin")).is_file():
            return (
                (_pickle_file(root / named(f"{stem}.bin"), f"{out_stem}.safetensors"),),
                None,
                {},
            )
    if variant is not None:
        raise InputError(
            f"no {variant!r} variant weights (model.{variant}.safetensors, "
            f"model.safetensors.index.{variant}.json, …)",
            root,
        )
    raise InputError("no weights found (model.safetensors, pytorch_model.bin, …)", root)


def _sharded(
    root: Path, index_name: str, output_index: str, variant: str | None
) -> tuple[tuple[WeightFile, ...], str, dict[str, Any]]:
    index_path = root / index_name
    index = _read_json(index_path)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise InputError("index has no 'weight_map' object", index_path)
    shard_names: list[str] = []
    kind = ".safetensors" if ".safetensors.index" in index_name else ".bin"
    for tensor, shard in weight_map.items():
        if not isinstance(shard, str) or Path(shard).name != shard or shard in ("", ".", ".."):
            raise InputError(
                f"weight_map entry {tensor!r} points outside the model directory: {shard!r}",
                index_path,
            )
        if not shard.endswith(kind):
            raise InputError(
                f"weight_map entry {tensor!r} names {shard!r}, which is not a {kind} weight "
                "file like the index's others",
                index_path,
            )
        if not (root / shard).is_file():
            raise InputError(f"weight_map names a missing shard {shard!r}", index_path)
        if shard not in shard_names:
            shard_names.append(shard)
    files: list[WeightFile] = []
    for shard in shard_names:
        plain = _without_variant(shard, variant)
        if shard.endswith(".safetensors"):
            weight_file = _safetensors_file(root / shard, plain)
        else:
            weight_file = _pickle_file(root / shard, _safetensors_name(plain))
        listed = {t for t, s in weight_map.items() if s == shard}
        present = {t.name for t in weight_file.tensors} | set(weight_file.aliases)
        if listed - present:
            missing = sorted(listed - present)[0]
            raise InputError(
                f"index lists tensor {missing!r} in {shard}, which does not hold it", index_path
            )
        if present - listed:
            extra = sorted(present - listed)[0]
            raise InputError(
                f"shard {shard} holds tensor {extra!r} that the index does not list", index_path
            )
        files.append(weight_file)
    metadata = index.get("metadata")
    return tuple(files), output_index, dict(metadata) if isinstance(metadata, dict) else {}


def _without_variant(name: str, variant: str | None) -> str:
    """A variant shard's plain name: ``model.fp16-00001-of-00002.safetensors`` ->
    ``model-00001-of-00002.safetensors`` (other names unchanged)."""
    if variant is None:
        return name
    marker = rf"\.{re.escape(variant)}(?=-\d+-of-\d+\.|\.(safetensors|bin)$)"
    return re.sub(marker, "", name, count=1)


def _safetensors_name(pickle_name: str) -> str:
    stem, _, rest = pickle_name.partition(".bin")
    for old, new in _PICKLE_TO_SAFETENSORS.items():
        if stem == old or stem.startswith(old + "-"):
            stem = new + stem[len(old) :]
            break
    return f"{stem}.safetensors{rest}"


def _safetensors_file(path: Path, output_name: str) -> WeightFile:
    header = read_header(path)
    tensors = tuple(FileTensor.from_entry(path, e) for e in header.tensors)
    return WeightFile(path, output_name, tensors, metadata=header.metadata)


def _magic(path: Path) -> bytes:
    """The bytes that tell a zip archive (``PK``) from a binary pickle (``\\x80``)."""
    with path.open("rb") as f:
        head = f.read(2)
    return head if head == b"PK" else head[:1]


def _pickle_file(path: Path, output_name: str) -> WeightFile:
    """Read a legacy pickle checkpoint with ``weights_only=True``; shared tensors kept once."""
    import pickle

    import torch

    def load(mmap: bool) -> Any:
        # torch may warn about pickle protocols; the CLI, which owns its process, filters
        # those (a library call must not change the process's warning filters).
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)

    try:
        try:
            state = load(mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):
                raise
            state = load(mmap=False)  # legacy (pre-zip) format cannot be memory-mapped
    except pickle.UnpicklingError as exc:
        if _magic(path) not in (b"PK", b"\x80"):  # torch.save: a zip, or a binary pickle
            raise InputError(
                "not a PyTorch checkpoint (neither a zip archive nor a binary pickle)", path
            ) from None
        reason = str(exc).strip().splitlines()
        detail = next((line for line in reason if "GLOBAL" in line or "global" in line), "")
        raise UnsafeCheckpointError(
            "refusing to load: the pickle needs more than tensors to load and could run code "
            f"(torch.load weights_only=True rejected it{': ' + detail.strip() if detail else ''})",
            path,
        ) from None
    except (RuntimeError, OSError, EOFError, ValueError) as exc:
        raise InputError(f"cannot read PyTorch checkpoint: {one_line(exc)}", path) from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise InputError("not a state dict of named tensors", path)
    tensors: list[LazyTensor] = []
    aliases: dict[str, str] = {}
    seen: dict[tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype], str] = {}
    for name, tensor in state.items():
        if tensor.layout != torch.strided or tensor.device.type != "cpu":
            raise InputError(
                f"tensor {name!r} is not a dense tensor with data "
                f"(layout {tensor.layout}, device {tensor.device.type})",
                path,
            )
        key = (
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tuple(tensor.stride()),
            tensor.dtype,
        )
        if tensor.numel() and key in seen:
            aliases[name] = seen[key]  # tied weights: written once, under the first name
            continue
        seen[key] = name
        try:
            dtype = from_torch(tensor.dtype)
        except ValueError:
            raise InputError(
                f"tensor {name!r} has unsupported dtype {tensor.dtype}", path
            ) from None
        tensors.append(MemoryTensor(name, dtype, tuple(tensor.shape), tensor))
    return WeightFile(path, output_name, tuple(tensors), aliases)
