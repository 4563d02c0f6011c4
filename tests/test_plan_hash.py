"""``ModelPlan.sha256``: the digest a certificate records to prove which plan made the files.

It must be stable (same inputs, same digest, whatever order the islands were found in) and
sensitive (any change to what is stored, or why an island exists, changes it). docs/format.md:
"digest of the full tensor plan (name, source dtype, stored dtype, shape)"; the islands and
their reasons are in it too, the free-text rule that produced an island is not.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from precision_convert.conversion.plan import Island, ModelPlan, PlanRecord, build_plan
from precision_convert.core.dtypes import BY_CODE, DType
from precision_convert.recipes import ISLAND_REASONS, Fp32Rule, Recipe

F32, F16, BF16, I64 = BY_CODE["F32"], BY_CODE["F16"], BY_CODE["BF16"], BY_CODE["I64"]


@dataclass(frozen=True)
class FakeTensor:
    """The LazyTensor protocol without data: planning never reads a tensor."""

    name: str
    dtype: DType
    shape: tuple[int, ...]

    def chunks(self) -> Iterator[object]:
        raise AssertionError("build_plan must not read tensor data")


BASE_TENSORS = (
    FakeTensor("embed.weight", F32, (10, 4)),
    FakeTensor("layers.0.norm.weight", F32, (4,)),
    FakeTensor("layers.0.mlp.wo.weight", F32, (4, 4)),
    FakeTensor("layers.0.mlp.wo.bias", F32, (4,)),
    FakeTensor("position_ids", I64, (1, 10)),
    FakeTensor("head.weight", F32, (10, 4)),
)
TOY = Recipe(
    name="toy",
    description="",
    library="any",
    fp32=(Fp32Rule(("**.wo",), ("fp16-safe",), "range", "overflows"),),
)
PLAIN = Recipe(name="plain", description="", library="any", keep_normalization=False)
#: Digest of ``plan()`` below. If this changes, every certificate written before no longer
#: matches a re-run of the same conversion: change it only together with the format's version.
PINNED = "69b46703711ef284bd3b401e9d2d62af5b8ceae60667d34cc97aec475587b047"


def plan(tensors=BASE_TENSORS, target="fp16-safe", recipe=TOY, **kwargs) -> ModelPlan:
    kwargs.setdefault("normalization", {"layers.0.norm"})
    return build_plan(list(tensors), target=target, recipe=recipe, **kwargs)


def test_pinned_digest_of_a_small_plan() -> None:
    base = plan()
    assert [(i.name, i.reason) for i in base.islands] == [
        ("layers.0.mlp.wo", "range"),
        ("layers.0.norm", "precision"),
    ]
    assert base.sha256 == PINNED


def test_digest_is_sha256_of_the_documented_payload() -> None:
    """Recomputed from the documented fields only: nothing else may leak into it."""
    base = plan()
    stored = {"layers.0.norm.weight": "F32", "layers.0.mlp.wo.weight": "F32"}
    stored |= {"layers.0.mlp.wo.bias": "F32", "position_ids": "I64"}
    payload = {
        "target": "fp16-safe",
        "tensors": [
            [t.name, t.dtype.code, stored.get(t.name, "F16"), list(t.shape)] for t in BASE_TENSORS
        ],
        "islands": [["layers.0.mlp.wo", "range"], ["layers.0.norm", "precision"]],
    }
    data = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    assert base.sha256 == hashlib.sha256(data).hexdigest()
    assert base.record("0.1.0").plan_sha256 == base.sha256


def test_record_is_the_documented_object_and_reads_back_as_written() -> None:
    """The record's JSON keeps the documented fields in order; read back and written again
    (a re-save) it is the same object, fields of another version and absent ones included."""
    written = plan().record("0.1.0").to_dict()
    assert list(written) == [
        "version", "target", "compute_dtype", "fp32_modules", "islands", "recipe", "plan_sha256"
    ]  # fmt: skip
    assert written["target"] == "fp16-safe" and written["compute_dtype"] == "float16"
    assert PlanRecord.from_dict(written).to_dict() == written
    other = {"version": "9.0", "fp32_modules": ["a"], "islands": {"a": "range"}, "new": [1]}
    assert PlanRecord.from_dict(other).to_dict() == other
    assert PlanRecord.from_dict(other).compute is None
    for broken in ([], {"fp32_modules": "a"}, {"islands": ["a"]}):
        with pytest.raises(ValueError):
            PlanRecord.from_dict(broken)


def test_same_inputs_give_the_same_digest() -> None:
    first = plan()
    assert first.sha256 == first.sha256
    assert plan().sha256 == first.sha256
    # equal but distinct objects: nothing identity-based (id(), object order) leaks in
    rebuilt = tuple(FakeTensor(t.name, t.dtype, tuple(t.shape)) for t in BASE_TENSORS)
    assert plan(rebuilt).sha256 == first.sha256


def test_digest_ignores_the_order_islands_are_found_in() -> None:
    extra = [
        Island("head", "search", "search"),
        Island("embed", "search", "search"),
        Island("layers.0.norm", "range", "activations"),
    ]
    digests = {
        plan(extra_islands=extra).sha256,
        plan(extra_islands=list(reversed(extra))).sha256,
        plan(extra_islands=[extra[1], extra[2], extra[0]]).sha256,
    }
    assert len(digests) == 1
    kept = ["head", "embed"]
    assert plan(keep_fp32=kept).sha256 == plan(keep_fp32=kept[::-1]).sha256
    norms = ["layers.0.norm", "embed"]
    assert plan(normalization=norms).sha256 == plan(normalization=norms[::-1]).sha256


def test_digest_ignores_the_free_text_rule_of_an_island() -> None:
    a = plan(extra_islands=[Island("head", "search", "one wording")])
    b = plan(extra_islands=[Island("head", "search", "another wording")])
    assert a.islands != b.islands
    assert a.sha256 == b.sha256


def test_an_island_without_floating_tensors_changes_nothing() -> None:
    """position_ids is integer: keeping it "fp32" stores nothing differently, records nothing."""
    kept = plan(keep_fp32=["position_ids"])
    assert "position_ids" not in kept.fp32_modules
    assert kept.sha256 == PINNED


def _variants() -> dict[str, ModelPlan]:
    def with_tensor(i: int, **change) -> tuple[FakeTensor, ...]:
        old = BASE_TENSORS[i]
        new = FakeTensor(**{"name": old.name, "dtype": old.dtype, "shape": old.shape, **change})
        return (*BASE_TENSORS[:i], new, *BASE_TENSORS[i + 1 :])

    return {
        "base": plan(),
        "target bf16-safe": plan(target="bf16-safe"),
        "target fp16": plan(target="fp16"),
        "target bf16": plan(target="bf16"),
        "island added": plan(extra_islands=[Island("head", "search", "s")]),
        "island added by user": plan(keep_fp32=["head"]),
        "island reason only": plan(extra_islands=[Island("layers.0.norm", "user", "u")]),
        "island removed": plan(normalization=()),
        "source dtype": plan(with_tensor(0, dtype=F16)),  # stored F16 either way
        "source dtype bf16": plan(with_tensor(0, dtype=BF16)),
        "shape": plan(with_tensor(0, shape=(4, 10))),
        "shape rank": plan(with_tensor(5, shape=(40,))),
        "int shape": plan(with_tensor(4, shape=(10, 1))),
        "int dtype": plan(with_tensor(4, dtype=BY_CODE["I32"])),
        "name": plan(with_tensor(5, name="lm_head.weight")),
        "tensor added": plan((*BASE_TENSORS, FakeTensor("extra", F32, (1,)))),
        "tensor removed": plan(BASE_TENSORS[:-1]),
    }


def test_every_change_to_the_plan_changes_the_digest() -> None:
    variants = _variants()
    by_digest: dict[str, str] = {}
    for label, variant in variants.items():
        assert variant.sha256 not in by_digest, f"{label!r} == {by_digest.get(variant.sha256)!r}"
        by_digest[variant.sha256] = label


def test_target_alone_changes_the_digest() -> None:
    """bf16 and bf16-safe with nothing to keep store the same bytes, yet are different plans."""
    safe, plain = plan(target="bf16-safe", recipe=PLAIN), plan(target="bf16", recipe=PLAIN)
    assert safe.islands == plain.islands == ()
    assert [t.stored for t in safe.tensors] == [t.stored for t in plain.tensors]
    assert safe.sha256 != plain.sha256


# --- properties -----------------------------------------------------------------------------

UNITS = ["embed", "layers.0.norm", "layers.0.mlp.wo", "head", "position_ids"]
island_lists = st.lists(
    st.builds(Island, st.sampled_from(UNITS), st.sampled_from(ISLAND_REASONS), st.just("r")),
    max_size=6,
)


@settings(max_examples=60)
@given(island_lists, st.randoms(use_true_random=False))
def test_digest_is_independent_of_island_order(islands: list[Island], rnd) -> None:
    shuffled = list(islands)
    rnd.shuffle(shuffled)
    assert plan(extra_islands=islands).sha256 == plan(extra_islands=shuffled).sha256


def _content(p: ModelPlan) -> tuple:
    return (
        p.target,
        tuple((t.name, t.source, t.stored, t.shape) for t in p.tensors),
        tuple(sorted((i.name, i.reason) for i in p.islands)),
    )


@settings(max_examples=60)
@given(
    island_lists,
    island_lists,
    st.sampled_from(["fp16-safe", "bf16-safe", "fp16"]),
    st.sampled_from(["fp16-safe", "bf16-safe", "fp16"]),
)
def test_digests_agree_exactly_when_the_plans_agree(
    a: list[Island], b: list[Island], target_a: str, target_b: str
) -> None:
    pa = plan(target=target_a, extra_islands=a)
    pb = plan(target=target_b, extra_islands=b)
    assert len(pa.sha256) == 64 and int(pa.sha256, 16) >= 0
    assert (pa.sha256 == pb.sha256) is (_content(pa) == _content(pb))


def test_every_island_reason_gives_its_own_digest() -> None:
    digests = {
        plan(normalization=(), extra_islands=[Island("head", reason, "r")]).sha256
        for reason in ISLAND_REASONS
    }
    assert len(digests) == len(ISLAND_REASONS)
    assert PINNED not in digests
