"""``search_islands`` against synthetic oracles instead of real models.

The real oracle converts a model with some modules kept fp32 and compares it with the fp32
baseline; here ``passes(extra)`` is a pure function of the set, so the search's contract can be
checked exactly: with "passes iff extra ⊇ needed" it must return exactly ``needed`` (in
candidate order) in about k·log2(n) evaluations, and for any upward-closed oracle a set that
passes and from which no module can be dropped.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from precision_convert.conversion.analysis.activations import SearchResult, search_islands


class Oracle:
    """Wraps a predicate, recording every set it was asked about."""

    def __init__(self, predicate: Callable[[frozenset[str]], bool]) -> None:
        self.predicate = predicate
        self.calls: list[frozenset[str]] = []

    def __call__(self, extra: frozenset[str]) -> bool:
        assert isinstance(extra, frozenset)
        self.calls.append(extra)
        return self.predicate(extra)


def superset_of(needed: set[str]) -> Oracle:
    return Oracle(lambda extra: needed <= extra)


def names(n: int) -> list[str]:
    return [f"blocks.{i}.mlp" for i in range(n)]


def bound(n: int, k: int) -> int:
    """Documented cost: per kept module one bisection (≤ ⌈log2 n⌉) and one check, plus the two
    initial checks (nothing kept; everything kept)."""
    return 2 + k * (math.ceil(math.log2(max(n, 2))) + 1)


def run(candidates: Sequence[str], oracle: Oracle) -> SearchResult:
    result = search_islands(candidates, oracle)
    assert result.evaluations == len(oracle.calls)  # it reports what it really spent
    allowed = set(candidates)
    assert all(call <= allowed for call in oracle.calls)  # only ever keeps candidates
    return result


# --- examples -------------------------------------------------------------------------------


def test_finds_exactly_the_needed_modules_in_execution_order() -> None:
    candidates = names(16)
    needed = {candidates[11], candidates[3]}
    result = run(candidates, superset_of(needed))
    assert result.passed
    assert result.added == (candidates[3], candidates[11])
    assert result.evaluations <= bound(16, 2)


def test_one_needed_module_among_many_costs_logarithmically() -> None:
    candidates = names(1024)
    oracle = superset_of({candidates[700]})
    result = run(candidates, oracle)
    assert result == SearchResult((candidates[700],), result.evaluations, True)
    assert result.evaluations <= 14  # 2 + 10 bisection steps + 1 confirmation; not 1024
    assert oracle.calls[-1] == frozenset({candidates[700]})  # the answer itself was checked


def test_needing_every_module() -> None:
    candidates = names(8)
    result = run(candidates, superset_of(set(candidates)))
    assert result.passed
    assert result.added == tuple(candidates)
    assert result.evaluations <= bound(8, 8)


def test_plan_that_already_passes_costs_one_evaluation() -> None:
    oracle = Oracle(lambda extra: True)
    result = run(names(50), oracle)
    assert result == SearchResult((), 1, True)
    assert oracle.calls == [frozenset()]


def test_plan_that_never_passes_gives_up_after_trying_everything() -> None:
    candidates = names(50)
    oracle = Oracle(lambda extra: False)
    result = run(candidates, oracle)
    assert result == SearchResult((), 2, False)
    assert oracle.calls == [frozenset(), frozenset(candidates)]


def test_needed_module_outside_the_candidates_is_impossible() -> None:
    candidates = names(10)
    result = run(candidates, superset_of({candidates[2], "not.a.candidate"}))
    assert result == SearchResult((), 2, False)


def test_no_candidates() -> None:
    assert run([], Oracle(lambda extra: False)) == SearchResult((), 1, False)
    assert run([], Oracle(lambda extra: True)) == SearchResult((), 1, True)


def test_single_candidate() -> None:
    assert run(["a"], superset_of({"a"})) == SearchResult(("a",), 2, True)


# --- properties -----------------------------------------------------------------------------


@st.composite
def hidden_sets(draw) -> tuple[list[str], set[str]]:
    n = draw(st.integers(1, 200))
    candidates = names(n)
    indices = draw(st.sets(st.integers(0, n - 1), max_size=min(n, 8)))
    return candidates, {candidates[i] for i in indices}


@settings(max_examples=100)
@given(hidden_sets())
def test_finds_exactly_the_hidden_set_within_the_documented_cost(case) -> None:
    candidates, needed = case
    result = run(candidates, superset_of(needed))
    assert result.passed
    assert result.added == tuple(c for c in candidates if c in needed)
    assert result.evaluations <= bound(len(candidates), len(needed))


@settings(max_examples=50)
@given(hidden_sets(), st.randoms(use_true_random=False))
def test_result_does_not_depend_on_where_needed_modules_sit(case, rnd: random.Random) -> None:
    candidates, needed = case
    shuffled = list(candidates)
    rnd.shuffle(shuffled)
    result = run(shuffled, superset_of(needed))
    assert set(result.added) == needed
    assert list(result.added) == [c for c in shuffled if c in needed]  # execution order


@st.composite
def upward_closed(draw) -> tuple[list[str], list[set[str]]]:
    """An oracle that passes when ``extra`` contains any one of several alternative sets:
    monotone, but with more than one minimal answer."""
    n = draw(st.integers(1, 40))
    candidates = names(n)
    alternatives = draw(
        st.lists(st.sets(st.sampled_from(candidates), min_size=1, max_size=5), max_size=4)
    )
    return candidates, alternatives


@settings(max_examples=100)
@given(upward_closed())
def test_any_monotone_oracle_gets_a_passing_irreducible_set(case) -> None:
    candidates, alternatives = case

    def predicate(extra: frozenset[str]) -> bool:
        return any(alt <= extra for alt in alternatives)

    result = run(candidates, Oracle(predicate))
    assert result.passed is bool(alternatives)
    if not result.passed:
        assert result.added == ()
        return
    kept = frozenset(result.added)
    assert predicate(kept)
    # Each kept module is one the plan cannot do without: dropping any one of them fails.
    for module in kept:
        assert not predicate(kept - {module}), module
    assert result.evaluations <= bound(len(candidates), len(kept))


@settings(max_examples=100)
@given(st.integers(0, 60), st.integers(0, 2**32 - 1))
def test_arbitrary_oracle_terminates_and_only_claims_what_it_checked(n: int, seed: int) -> None:
    """A noisy, non-monotone oracle (a fixed random answer per set, as a flaky parity check
    may give): the search still ends, and reports success only for a set that really passed."""
    candidates = names(n)
    answers: dict[frozenset[str], bool] = {}

    def predicate(extra: frozenset[str]) -> bool:
        if extra not in answers:
            answers[extra] = random.Random(f"{seed}:{sorted(extra)}").random() < 0.5
        return answers[extra]

    oracle = Oracle(predicate)
    result = run(candidates, oracle)
    assert len(set(result.added)) == len(result.added)
    assert list(result.added) == [c for c in candidates if c in set(result.added)]
    if result.passed:
        assert frozenset(result.added) in oracle.calls
        assert predicate(frozenset(result.added))
    else:
        assert result.added == ()
    # every round removes at least one candidate from consideration
    assert result.evaluations <= bound(n, n)
