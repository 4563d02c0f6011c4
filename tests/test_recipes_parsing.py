"""Recipe files: every defect is an InputError naming the file; the builtins parse; lookup order.

A user passes ``--recipe FILE``; the CLI turns an InputError into one line and exit code 2, but
any other exception escapes as a traceback. So a broken recipe must always end as InputError,
and one that parses must mean what it says.
"""

from __future__ import annotations

import tomllib
from importlib import resources
from pathlib import Path
from types import MappingProxyType

import pytest

from precision_convert.core.errors import InputError
from precision_convert.core.names import validate_pattern
from precision_convert.recipes import (
    GENERIC,
    ISLAND_REASONS,
    SAFE_TARGETS,
    TARGETS,
    Recipe,
    builtin,
    get,
    load_file,
    match,
)

LIBRARIES = {"transformers", "diffusers", "open_clip", "any"}


def write(tmp_path: Path, text: str | bytes, name: str = "mine.toml") -> Path:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def load_error(path: Path) -> InputError:
    with pytest.raises(InputError) as info:
        load_file(path)
    assert info.value.path == str(path)
    assert str(info.value).startswith(f"{path}: ")  # one line naming the file first
    assert "\n" not in str(info.value)
    return info.value


# --- a minimal recipe and its defaults ------------------------------------------------------


def test_minimal_recipe_gets_the_documented_defaults(tmp_path: Path) -> None:
    path = write(tmp_path, 'name = "mine"\n[[fp32]]\nmodules = ["**.wo"]\n')
    recipe = load_file(path)
    assert recipe.name == "mine"
    assert recipe.library == "any"
    assert recipe.keep_normalization is True
    assert recipe.class_names == () and recipe.model_types == ()
    assert recipe.path == str(path)
    (rule,) = recipe.fp32
    assert rule.modules == ("**.wo",)
    assert rule.targets == SAFE_TARGETS  # rules apply to the safe targets unless told
    assert rule.reason == "precision"
    assert recipe.rules_for("bf16-safe") == (rule,)
    assert recipe.rules_for("bf16") == ()
    assert recipe.config_flags("fp16") == {}


def test_full_recipe_round_trips(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
name = "full"
description = "everything"
library = "diffusers"
keep_normalization = false
hazards = ["one", "two"]
[match]
class_names = ["MyModel"]
model_types = ["mine"]
[[fp32]]
modules = ["a.b", "**.c"]
targets = ["fp16-safe"]
reason = "range"
why = "overflows"
[config.fp16-safe]
force_upcast = true
[validation]
task = "vae"
""",
    )
    recipe = load_file(path)
    assert (recipe.description, recipe.library) == ("everything", "diffusers")
    assert recipe.keep_normalization is False
    assert recipe.hazards == ("one", "two")
    assert (recipe.class_names, recipe.model_types) == (("MyModel",), ("mine",))
    (rule,) = recipe.fp32
    assert (rule.modules, rule.targets, rule.reason, rule.why) == (
        ("a.b", "**.c"),
        ("fp16-safe",),
        "range",
        "overflows",
    )
    assert recipe.rules_for("bf16-safe") == ()
    assert recipe.config_flags("fp16-safe") == {"force_upcast": True}
    assert recipe.validation == {"task": "vae"}
    # parsed recipes are shared (builtin() is cached): they must be read-only
    with pytest.raises(TypeError):
        recipe.config["fp16-safe"]["force_upcast"] = False  # type: ignore[index]
    with pytest.raises(TypeError):
        recipe.validation["task"] = "x"  # type: ignore[index]


def test_get_loads_a_file_by_path(tmp_path: Path) -> None:
    path = write(tmp_path, 'name = "from-file"\n')
    assert get(str(path)).name == "from-file"


# --- defects the parser reports -------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('name = "x"\nfp32_modules = ["a"]\n', "unknown keys ['fp32_modules']"),
        ('name = "x"\nzeta = 1\nalpha = 2\n', "unknown keys ['alpha', 'zeta']"),
        ('description = "no name"\n', "'name' must be a non-empty string"),
        ('name = ""\n', "'name' must be a non-empty string"),
        ("name = 3\n", "'name' must be a non-empty string"),
        ('name = ["x"]\n', "'name' must be a non-empty string"),
        ('name = "x"\n[[fp32]]\nmodules = ["a"]\ntargets = ["fp8"]\n', "targets"),
        ('name = "x"\n[[fp32]]\nmodules = ["a"]\ntargets = ["bf16", "f16"]\n', "targets"),
        ('name = "x"\n[[fp32]]\nmodules = ["a"]\nreason = "because"\n', "'because'"),
        ('name = "x"\n[[fp32]]\nmodules = ["a"]\nreason = "Range"\n', "'Range'"),
        ('name = "x"\n[[fp32]]\nwhy = "no modules"\n', "list of module patterns"),
        ('name = "x"\n[[fp32]]\nmodules = 3\n', "list of module patterns"),
        ('name = "x"\n[[fp32]]\nmodules = ["a..b"]\n', "'a..b'"),
        ('name = "x"\n[[fp32]]\nmodules = ["ok", ""]\n', "empty name component"),
        ('name = "x"\n[[fp32]]\nmodules = ["**.wo."]\n', "'**.wo.'"),
        ('name = "x"\n[config.fp8]\nflag = true\n', "[config] tables must be named after"),
    ],
)
def test_invalid_recipe_is_an_input_error_naming_the_file(
    tmp_path: Path, text: str, expected: str
) -> None:
    error = load_error(write(tmp_path, text))
    assert "invalid recipe" in str(error)
    assert expected in str(error)


def test_reason_and_target_messages_list_the_choices(tmp_path: Path) -> None:
    reason = load_error(write(tmp_path, 'name="x"\n[[fp32]]\nmodules=["a"]\nreason="r"\n'))
    assert all(choice in str(reason) for choice in ISLAND_REASONS)
    target = load_error(write(tmp_path, 'name="x"\n[[fp32]]\nmodules=["a"]\ntargets=["t"]\n'))
    assert all(choice in str(target) for choice in TARGETS)


@pytest.mark.parametrize(
    "content",
    [
        'name = "x"\nfp32 = [\n',  # TOML syntax error
        'name = "x"\nname = "y"\n',  # duplicate key: invalid TOML
        b'name = "\xff\xfe"\n',  # not UTF-8
    ],
)
def test_unreadable_recipe_file_is_an_input_error(tmp_path: Path, content: str | bytes) -> None:
    error = load_error(write(tmp_path, content))
    assert "cannot read recipe" in str(error)


def test_missing_recipe_file_is_an_input_error(tmp_path: Path) -> None:
    path = tmp_path / "absent.toml"
    with pytest.raises(InputError, match="cannot read recipe") as info:
        get(str(path))
    assert info.value.path == str(path)


def test_unknown_recipe_name_lists_the_known_ones() -> None:
    with pytest.raises(InputError, match="unknown recipe 'no-such-family'") as info:
        get("no-such-family")
    for name in builtin():
        assert name in str(info.value)


# Value types and unknown keys at every level: the first group used to escape as another
# exception (a traceback from the CLI); the second used to be silently misread.


@pytest.mark.parametrize(
    "text",
    [
        pytest.param('name = "x"\nmatch = "LlamaModel"\n', id="match-not-a-table"),
        pytest.param('name = "x"\nfp32 = ["norm"]\n', id="fp32-not-tables"),
        pytest.param('name = "x"\n[fp32]\nmodules = ["norm"]\n', id="fp32-table-not-array"),
        pytest.param('name = "x"\n[[fp32]]\nmodules = [1]\n', id="pattern-not-a-string"),
        pytest.param('name = "x"\n[[fp32]]\nmodules = ["a"]\ntargets = [["bf16"]]\n', id="nested"),
        pytest.param('name = "x"\n[config]\nbf16-safe = 1\n', id="config-not-a-table"),
        pytest.param('name = "x"\nvalidation = 3\n', id="validation-not-a-table"),
    ],
)
def test_malformed_types_are_input_errors(tmp_path: Path, text: str) -> None:
    load_error(write(tmp_path, text))


@pytest.mark.parametrize(
    "text",
    [
        # a string where a list belongs is iterated character by character
        pytest.param('name = "x"\n[[fp32]]\nmodules = "norm"\n', id="modules-string"),
        pytest.param('name = "x"\n[match]\nclass_names = "LlamaModel"\n', id="class-names-str"),
        pytest.param('name = "x"\nhazards = "careful"\n', id="hazards-string"),
        # a typo in a rule's key falls back to the default: "range" silently becomes
        # "precision", the island kind whose output the loader casts back (the overflow again)
        pytest.param('name = "x"\n[[fp32]]\nmodules = ["a"]\nreasn = "range"\n', id="rule-typo"),
        # a typo under [match] leaves a recipe that never matches
        pytest.param('name = "x"\n[match]\nclass_name = ["A"]\n', id="match-typo"),
        # bool("false") is True
        pytest.param('name = "x"\nkeep_normalization = "false"\n', id="bool-as-string"),
    ],
)
def test_misspelled_or_mistyped_values_are_not_silently_accepted(tmp_path: Path, text: str) -> None:
    load_error(write(tmp_path, text))


# --- the builtin recipes ---------------------------------------------------------------------


def test_every_builtin_recipe_file_parses_and_is_well_formed() -> None:
    recipes = builtin()
    files = sorted(
        entry.name
        for entry in resources.files("precision_convert.recipes").iterdir()
        if entry.name.endswith(".toml") and entry.name != "tasks.toml"
    )
    assert len(files) >= 10
    assert sorted(r.path for r in recipes.values()) == files  # none lost to a name clash
    assert GENERIC in recipes
    assert "tasks" not in recipes
    for name, recipe in recipes.items():
        assert isinstance(recipe, Recipe)
        assert recipe.name == name
        assert recipe.path == f"{name}.toml"
        assert recipe.library in LIBRARIES, name
        assert set(recipe.config) <= set(TARGETS), name
        for rule in recipe.fp32:
            assert rule.modules, name
            assert all(validate_pattern(p) == p for p in rule.modules), name
            assert rule.targets and set(rule.targets) <= set(TARGETS), name
            assert rule.reason in ISLAND_REASONS, name


def test_builtin_is_cached_and_read_only() -> None:
    assert builtin() is builtin()
    assert isinstance(builtin(), MappingProxyType)
    with pytest.raises(TypeError):
        builtin()["evil"] = builtin()[GENERIC]  # type: ignore[index]
    assert get("t5") is builtin()["t5"]


def test_builtin_validation_tasks_exist_in_tasks_toml() -> None:
    text = resources.files("precision_convert.recipes").joinpath("tasks.toml").read_text("utf-8")
    tasks = tomllib.loads(text)
    for recipe in builtin().values():
        task = recipe.validation.get("task")
        if task is not None:
            assert task in tasks, (recipe.name, task)


def test_no_class_name_or_model_type_is_claimed_twice() -> None:
    """Otherwise which recipe a model gets would depend on file order."""
    seen: dict[tuple[str, str, str], str] = {}
    for recipe in builtin().values():
        keys = [("class", c) for c in recipe.class_names]
        keys += [("type", t) for t in recipe.model_types]
        for kind, value in keys:
            key = (recipe.library, kind, value)
            assert key not in seen, f"{key} in both {seen[key]} and {recipe.name}"
            seen[key] = recipe.name


def test_t5_keeps_wo_fp32_for_fp16_safe_only() -> None:
    t5 = builtin()["t5"]
    (rule,) = t5.rules_for("fp16-safe")
    assert rule.modules == ("**.DenseReluDense.wo",) and rule.reason == "range"
    assert t5.rules_for("bf16-safe") == ()
    assert t5.rules_for("fp16") == ()


# --- matching --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("library", "class_name", "model_type", "expected"),
    [
        ("transformers", "LlamaForCausalLM", None, "llama"),
        ("transformers", None, "llama", "llama"),
        ("transformers", "SomethingNew", "qwen2", "llama"),  # unknown class: model_type
        ("transformers", "T5EncoderModel", "llama", "t5"),  # class name wins over model_type
        ("transformers", "LlamaModel", "t5", "llama"),
        ("transformers", "BertModel", "bert", "bert"),
        ("transformers", "CLIPModel", None, "clip"),
        ("transformers", None, None, GENERIC),
        ("transformers", "SomethingNew", "something_new", GENERIC),
        ("transformers", "", "", GENERIC),
        # recipes only match their own library
        ("diffusers", "LlamaForCausalLM", "llama", GENERIC),
        ("transformers", "AutoencoderKL", None, GENERIC),
        ("diffusers", "AutoencoderKL", None, "autoencoder-kl"),
        ("diffusers", "AutoencoderKLCogVideoX", None, "cogvideox-vae"),
        ("diffusers", "UNet2DConditionModel", None, "unet2d-condition"),
        ("open_clip", "CLIP", None, "openclip"),
        ("transformers", "CLIP", None, GENERIC),  # OpenCLIP's class name, but not open_clip
        ("open_clip", "CLIPModel", "clip", GENERIC),
        # names are exact, not prefixes or case-folded
        ("transformers", "LlamaForCausalLMX", None, GENERIC),
        ("transformers", "llamaforcausallm", None, GENERIC),
        ("transformers", None, "LLAMA", GENERIC),
    ],
)
def test_match_by_class_name_then_model_type(
    library: str, class_name: str | None, model_type: str | None, expected: str
) -> None:
    assert match(library, class_name, model_type).name == expected


def test_every_declared_class_name_and_model_type_finds_its_recipe() -> None:
    for recipe in builtin().values():
        for class_name in recipe.class_names:
            assert match(recipe.library, class_name, None) is recipe
            assert match(recipe.library, class_name, "no-such-type") is recipe
        for model_type in recipe.model_types:
            assert match(recipe.library, None, model_type) is recipe
            assert match(recipe.library, "NoSuchClass", model_type) is recipe
