"""The user cache of skeleton analysis: a hit gives exactly what the skeleton gives, a
structural config change misses, and a broken cache never breaks a conversion."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from precision_convert.conversion.analysis import norm_cache, norms
from precision_convert.conversion.io.source import ModelSource, open_source


@pytest.fixture
def cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    directory = tmp_path / "cache"
    monkeypatch.setenv(norm_cache.CACHE_VARIABLE, str(directory))
    return directory


@pytest.fixture
def no_skeleton(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building a skeleton fails the test: the answer must come from the cache."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        pytest.fail("a skeleton was built although the cache holds the answer")

    monkeypatch.setattr(norms, "_skeleton", refuse)


def _model(path: Path) -> ModelSource:
    source = open_source(path)
    assert isinstance(source, ModelSource)
    return source


def _entries(cache: Path) -> list[Path]:
    return sorted((cache / "norms").glob("*.json")) if (cache / "norms").is_dir() else []


def _copy_with_config(src: Path, dst: Path, **changes: Any) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("name", ["llama", "t5-encoder", "bert", "unet"])
def test_a_hit_is_what_the_skeleton_gives(
    name: str,
    cache: Path,
    tiny_model: Callable[[str], Path],
    request: pytest.FixtureRequest,
) -> None:
    source = _model(tiny_model(name))
    uncached = norms.skeleton_norms(source, use_cache=False)
    assert uncached is not None and uncached.modules
    assert _entries(cache) == []
    first = norms.normalization_modules(source)  # a miss: builds and stores
    assert len(_entries(cache)) == 1
    request.getfixturevalue("no_skeleton")
    assert norms.skeleton_norms(source) == uncached
    assert norms.normalization_modules(source) == first
    assert first == norms._align_names(
        uncached, {t.name.rpartition(".")[0] for t in source.tensors()}
    )


def test_a_structural_change_misses(
    cache: Path, tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    source = _model(tiny_model("llama"))
    before = norms.skeleton_norms(source)
    assert before is not None
    deeper = _model(
        _copy_with_config(tiny_model("llama"), tmp_path / "deeper", num_hidden_layers=3)
    )
    after = norms.skeleton_norms(deeper)
    assert after is not None and "model.layers.2.input_layernorm" in after.modules
    assert "model.layers.2.input_layernorm" not in before.modules
    assert len(_entries(cache)) == 2


def test_names_and_dtypes_do_not_miss(
    cache: Path, tiny_model: Callable[[str], Path], tmp_path: Path, no_skeleton: None
) -> None:
    """A copy elsewhere, or the same model in another dtype (a converted output), is a hit."""
    marker = norm_cache.SkeletonNorms(frozenset({"marker"}), "p")
    norm_cache.store(_key(_model(tiny_model("t5-encoder"))), marker)
    renamed = _copy_with_config(
        tiny_model("t5-encoder"),
        tmp_path / "renamed",
        _name_or_path="somewhere/else",
        torch_dtype="bfloat16",
        dtype="bfloat16",
        transformers_version="0.0.1",
        precision_convert={"target": "bf16-safe"},
    )
    assert norms.skeleton_norms(_model(renamed)) == marker


def _key(source: ModelSource) -> dict[str, Any]:
    key = norm_cache.cache_key(source.library, source.class_name, source.config, norms._CODE)
    assert key is not None
    return key


def test_a_corrupt_entry_is_recomputed(cache: Path, tiny_model: Callable[[str], Path]) -> None:
    source = _model(tiny_model("llama"))
    expected = norms.skeleton_norms(source, use_cache=False)
    norms.skeleton_norms(source)
    (entry,) = _entries(cache)
    for garbage in (
        b"",
        b"{not json",
        b"[]",
        json.dumps({"key": {}, "modules": [], "prefix": ""}).encode(),
    ):
        entry.write_bytes(garbage)
        assert norms.skeleton_norms(source) == expected
        assert norm_cache.load(_key(source)) == expected  # rewritten whole


def test_an_unwritable_cache_is_no_error(
    monkeypatch: pytest.MonkeyPatch, tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(norm_cache.CACHE_VARIABLE, str(blocker / "cache"))  # mkdir cannot work
    source = _model(tiny_model("llama"))
    assert norms.skeleton_norms(source) == norms.skeleton_norms(source, use_cache=False)


def test_the_cache_can_be_disabled_or_moved(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_model: Callable[[str], Path]
) -> None:
    monkeypatch.setenv(norm_cache.CACHE_VARIABLE, "off")
    assert norm_cache.cache_dir() is None
    norms.skeleton_norms(_model(tiny_model("llama")))  # stores nothing, fails nothing
    monkeypatch.delenv(norm_cache.CACHE_VARIABLE)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert norm_cache.cache_dir() == tmp_path / "xdg" / "precision-convert"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert norm_cache.cache_dir() == tmp_path / "home" / ".cache" / "precision-convert"


def test_a_cache_in_the_home_of_no_user_turns_the_cache_off_and_fails_nothing(
    monkeypatch: pytest.MonkeyPatch, tiny_model: Callable[[str], Path]
) -> None:
    source = _model(tiny_model("llama"))
    monkeypatch.setenv(norm_cache.CACHE_VARIABLE, "~pc-no-such-user/cache")
    assert norm_cache.cache_dir() is None
    assert norms.skeleton_norms(source) == norms.skeleton_norms(source, use_cache=False)
    monkeypatch.delenv(norm_cache.CACHE_VARIABLE)
    monkeypatch.setenv("XDG_CACHE_HOME", "~pc-no-such-user")
    assert norm_cache.cache_dir() is None


def test_no_home_at_all_turns_the_cache_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """No HOME and no passwd entry for the process's uid (a container run as an arbitrary
    uid): ``Path.home()`` raises, and the cache is off rather than the conversion failing."""
    import pwd

    for variable in (norm_cache.CACHE_VARIABLE, "XDG_CACHE_HOME", "HOME"):
        monkeypatch.delenv(variable, raising=False)

    def unknown(uid: int) -> Any:
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.setattr(pwd, "getpwuid", unknown)
    with pytest.raises(RuntimeError):
        Path.home()
    assert norm_cache.cache_dir() is None


def test_remote_code_is_never_cached(
    cache: Path, tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    auto_map = {"AutoModel": "modeling.Model"}
    remote = _copy_with_config(
        tiny_model("llama"), tmp_path / "remote", auto_map=auto_map, architectures=["Remote"]
    )
    source = _model(remote)
    assert norms.skeleton_norms(source) is None  # not trusted: names serve
    norms.skeleton_norms(source, trust_remote_code=True)
    assert _entries(cache) == []
    # An auto_map beside a class transformers has (Phi-3 ships one): untrusted, the native
    # class is built, as every loader builds it; trusted, the remote code is, and not cached.
    native = _model(_copy_with_config(tiny_model("llama"), tmp_path / "native", auto_map=auto_map))
    plain = _model(tiny_model("llama"))
    assert norms.skeleton_norms(native) == norms.skeleton_norms(plain, use_cache=False)
    cached = _entries(cache)
    norms.skeleton_norms(native, trust_remote_code=True)
    assert _entries(cache) == cached
