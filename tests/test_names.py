"""The module-name matcher: whole components, ``*`` for one, ``**`` for any run of them.

The matcher decides which modules stay fp32, so a false positive silently keeps the wrong
modules in fp32 (transformers once kept ``word_embeddings`` fp32 because ``wo`` is a substring
of it) and a false negative silently drops an island. Besides examples, the properties below
compare it with an independent reference matcher on random patterns and names.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from precision_convert.core.names import (
    matches,
    matches_self_or_ancestor,
    module_of,
    units,
    validate_pattern,
)

# --- reference ------------------------------------------------------------------------------


def _component_ok(pattern: str, component: str) -> bool:
    regex = "[^.]*".join(re.escape(piece) for piece in pattern.split("*"))
    return re.fullmatch(regex, component) is not None


def reference_match(pattern: str, name: str) -> bool:
    """Iterative dynamic programme over components (the library recurses): an oracle."""
    pat, parts = pattern.split("."), name.split(".")
    # ok[i][j]: pat[i:] matches parts[j:]
    ok = [[False] * (len(parts) + 1) for _ in range(len(pat) + 1)]
    ok[len(pat)][len(parts)] = True
    for i in range(len(pat) - 1, -1, -1):
        for j in range(len(parts), -1, -1):
            if pat[i] == "**":
                ok[i][j] = any(ok[i + 1][k] for k in range(j, len(parts) + 1))
            else:
                ok[i][j] = j < len(parts) and _component_ok(pat[i], parts[j]) and ok[i + 1][j + 1]
    return ok[0][0]


# --- strategies -----------------------------------------------------------------------------

component = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_", min_size=1, max_size=8)
name_parts = st.lists(component, min_size=1, max_size=6)
# A small alphabet makes collisions (and so matches) between random patterns and names common.
small_component = st.sampled_from(["a", "b", "ab", "wo", "word", "0", "1"])
small_parts = st.lists(small_component, min_size=1, max_size=5)
pattern_token = st.one_of(
    small_component,
    st.sampled_from(["*", "**", "a*", "*o", "w*d", "*b*"]),
)
small_pattern = st.lists(pattern_token, min_size=1, max_size=5).map(".".join)


# --- examples -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "name", "expected"),
    [
        # whole components, never substrings
        ("**.wo", "encoder.block.0.DenseReluDense.wo", True),
        ("**.wo", "embeddings.word_embeddings", False),
        ("**.wo", "encoder.wo_proj", False),
        ("**.wo", "encoder.two", False),
        ("wo", "word_embeddings", False),
        ("wo", "wo", True),
        ("**.DenseReluDense.wo", "decoder.block.3.layer.2.DenseReluDense.wo", True),
        ("**.DenseReluDense.wo", "decoder.block.3.layer.2.DenseReluDense.wi", False),
        # anchoring: the whole name must be matched, at both ends
        ("encoder", "encoder.layer", False),
        ("layer", "encoder.layer", False),
        ("encoder.layer", "encoder.layer.0", False),
        ("encoder.layer", "my_encoder.layer", False),
        # "*" is exactly one component
        ("*", "encoder", True),
        ("*", "encoder.layer", False),
        ("encoder.*.attn", "encoder.3.attn", True),
        ("encoder.*.attn", "encoder.attn", False),
        ("encoder.*.attn", "encoder.1.2.attn", False),
        # "**" is any run of components, including none
        ("**", "a", True),
        ("**", "a.b.c.d", True),
        ("a.**", "a", True),
        ("a.**", "a.b.c", True),
        ("a.**", "b.a", False),
        ("**.a", "a", True),
        ("a.**.d", "a.d", True),
        ("a.**.d", "a.b.c.d", True),
        ("a.**.d", "a.b.c.d.e", False),
        ("**.b.**", "a.b.c", True),
        ("**.b.**", "a.bb.c", False),
        # "*" inside a component never crosses a dot
        ("*norm*", "ln_norm", True),
        ("*norm*", "norm", True),
        ("*norm*", "ln.norm", False),
        ("encoder.*_norm", "encoder.final_layer_norm", True),
        ("encoder.*_norm", "encoder.final.layer_norm", False),
        ("h*", "h", True),
        # everything else is literal, regex metacharacters included
        ("a+b", "aab", False),
        ("a+b", "a+b", True),
        ("h?", "hx", False),
        ("h?", "h?", True),
        ("w[o]", "wo", False),
        ("w[o]", "w[o]", True),
        ("a|b", "a", False),
        ("blocks.0", "blocks.0", True),
        ("blocks.0", "blocks.00", False),
        # case-sensitive, like module names
        ("Wo", "wo", False),
    ],
)
def test_matches_examples(pattern: str, name: str, expected: bool) -> None:
    assert matches(pattern, name) is expected
    assert reference_match(pattern, name) is expected  # the oracle agrees with the examples


@pytest.mark.parametrize("pattern", ["", ".", "a.", ".a", "a..b", "**..wo", "a.b."])
def test_validate_pattern_rejects_empty_components(pattern: str) -> None:
    with pytest.raises(ValueError, match="invalid module pattern") as info:
        validate_pattern(pattern)
    message = str(info.value)
    assert repr(pattern) in message
    assert "empty name component" in message
    with pytest.raises(ValueError, match="invalid module pattern"):
        matches(pattern, "a.b")
    with pytest.raises(ValueError, match="invalid module pattern"):
        matches_self_or_ancestor(pattern, "a.b")


@pytest.mark.parametrize("pattern", ["a", "*", "**", "a.**.b", "*norm*", "x.0.y", "w[o]"])
def test_validate_pattern_returns_valid_patterns_unchanged(pattern: str) -> None:
    assert validate_pattern(pattern) == pattern


@pytest.mark.parametrize(
    ("pattern", "name", "expected"),
    [
        ("a.b", "a.b.c.d", True),  # an ancestor matches
        ("a.b", "a.b", True),  # itself
        ("a.b", "a", False),  # a descendant does not cover its ancestor
        ("a.b", "a.bc.d", False),  # whole components
        ("**.wo", "x.wo.weight", True),
        ("**.wo", "x.word_embeddings.weight", False),
        ("*", "anything.below.it", True),
        ("b", "a.b", False),  # ancestors are prefixes, not suffixes
    ],
)
def test_matches_self_or_ancestor_examples(pattern: str, name: str, expected: bool) -> None:
    assert matches_self_or_ancestor(pattern, name) is expected


def test_module_of() -> None:
    assert module_of("encoder.layer.0.weight") == "encoder.layer.0"
    assert module_of("weight") == ""
    assert module_of("a.b") == "a"


def test_a_parametrized_weight_belongs_to_its_module() -> None:
    """Weight norm stores g and v under the parametrization's container (wav2vec2's positional
    conv): they, and the conv's bias beside them, are one unit, the conv."""
    conv = "encoder.pos_conv_embed.conv"
    names = [f"{conv}.bias", *(f"{conv}.parametrizations.weight.original{i}" for i in (0, 1))]
    assert module_of(names[1]) == conv
    assert module_of("parametrizations.weight.original") == ""
    assert module_of("a.parametrizations.weight.scale") == "a.parametrizations.weight"
    assert units(names) == dict.fromkeys(names, conv)


def test_units_tensor_follows_module_except_in_containers_and_root() -> None:
    got = units(
        [
            "logit_scale",  # root: its own unit
            "visual.class_embedding",  # held by a container: its own unit
            "visual.conv1.weight",
            "visual.conv1.bias",
            "visual.transformer.resblocks.0.ln_1.weight",
            "text.proj.weight",  # text holds no child module: text.proj is a plain leaf
        ]
    )
    assert got == {
        "logit_scale": "logit_scale",
        "visual.class_embedding": "visual.class_embedding",
        "visual.conv1.weight": "visual.conv1",
        "visual.conv1.bias": "visual.conv1",
        "visual.transformer.resblocks.0.ln_1.weight": "visual.transformer.resblocks.0.ln_1",
        "text.proj.weight": "text.proj",
    }


def test_units_of_nothing_is_empty() -> None:
    assert units([]) == {}


# --- properties -----------------------------------------------------------------------------


@settings(max_examples=50)
@given(name_parts)
def test_a_name_matches_itself(parts: list[str]) -> None:
    name = ".".join(parts)
    assert matches(name, name)
    assert matches_self_or_ancestor(name, name)


@settings(max_examples=50)
@given(name_parts, st.data())
def test_replacing_any_component_by_star_still_matches(parts: list[str], data) -> None:
    name = ".".join(parts)
    i = data.draw(st.integers(0, len(parts) - 1))
    assert matches(".".join([*parts[:i], "*", *parts[i + 1 :]]), name)


@settings(max_examples=50)
@given(name_parts, st.data())
def test_replacing_any_run_by_double_star_still_matches(parts: list[str], data) -> None:
    name = ".".join(parts)
    i = data.draw(st.integers(0, len(parts)))
    j = data.draw(st.integers(i, len(parts)))  # the run parts[i:j] may be empty
    assert matches(".".join([*parts[:i], "**", *parts[j:]]), name)


@settings(max_examples=50)
@given(name_parts)
def test_double_star_alone_matches_everything(parts: list[str]) -> None:
    assert matches("**", ".".join(parts))


@settings(max_examples=50)
@given(name_parts)
def test_single_star_matches_exactly_one_component(parts: list[str]) -> None:
    assert matches("*", ".".join(parts)) is (len(parts) == 1)
    assert matches(".".join("*" * len(parts)), ".".join(parts))


@settings(max_examples=50)
@given(name_parts, st.data())
def test_a_component_that_only_contains_the_pattern_component_never_matches(
    parts: list[str], data
) -> None:
    """``wo`` vs ``word_embeddings``: extending one component of the name breaks the match."""
    i = data.draw(st.integers(0, len(parts) - 1))
    prefix = data.draw(st.sampled_from(["", "x", "_"]))
    suffix = data.draw(st.sampled_from(["x", "rd_embeddings", "_proj", "0"]))
    longer = [*parts[:i], prefix + parts[i] + suffix, *parts[i + 1 :]]
    pattern, name = ".".join(parts), ".".join(longer)
    assert not matches(pattern, name)
    assert not matches("**." + parts[i], ".".join(longer[: i + 1]))
    # nor does a pattern with the longer component match the original name
    assert not matches(name, pattern)


@settings(max_examples=50)
@given(name_parts, name_parts)
def test_a_literal_pattern_matches_only_the_identical_name(pat: list[str], parts: list[str]):
    assert matches(".".join(pat), ".".join(parts)) is (pat == parts)


@settings(max_examples=100)
@given(small_pattern, small_parts)
def test_matches_agrees_with_the_reference_matcher(pattern: str, parts: list[str]) -> None:
    name = ".".join(parts)
    assert matches(pattern, name) is reference_match(pattern, name)


@settings(max_examples=100)
@given(small_pattern, small_parts)
def test_self_or_ancestor_is_matching_some_leading_prefix(pattern: str, parts: list[str]):
    expected = any(reference_match(pattern, ".".join(parts[:i])) for i in range(1, len(parts) + 1))
    assert matches_self_or_ancestor(pattern, ".".join(parts)) is expected


@settings(max_examples=50)
@given(small_pattern, small_parts, small_parts)
def test_a_match_covers_every_descendant(pattern: str, parts: list[str], below: list[str]):
    if matches(pattern, ".".join(parts)):
        assert matches_self_or_ancestor(pattern, ".".join(parts + below))


def _torch_like(names: list[str]) -> bool:
    """No tensor name is also a module holding other tensors (torch forbids the clash)."""
    return not any(b.startswith(a + ".") for a in names for b in names)


@settings(max_examples=50)
@given(st.lists(name_parts.map(".".join), min_size=1, max_size=12).filter(_torch_like))
def test_units_are_owning_prefixes_and_never_nest(tensor_names: list[str]) -> None:
    got = units(tensor_names)
    assert set(got) == set(tensor_names)
    for tensor, unit in got.items():
        # a tensor follows its own module or is a unit of its own
        assert unit in (tensor, module_of(tensor))
        assert unit != ""
    # No unit is a strict ancestor of another: keeping one unit fp32 never drags another
    # tensor's unit along (the reason containers and the root are split up).
    distinct = set(got.values())
    for a in distinct:
        for b in distinct:
            assert not b.startswith(a + "."), (a, b)
