"""Folding repeated structure: module names grouped by the layer template they instantiate.

A 7B Llama has ~290 weighted modules and an SDXL UNet over a thousand, but only a few dozen
*roles*: ``model.layers.{0..31}.self_attn.q_proj`` is one role played 32 times. Every numeric
name component is a slot, nested ones included (``down_blocks.{0..3}.resnets.{0,1}.norm1``),
so reports can show one row per role and still say exactly which instances differ.

A role's instances need not fill a grid (a UNet's last down block has no downsampler, only
some resnets have a ``conv_shortcut``), so :attr:`Role.blocks` splits them into exact
products of index sets: folding never claims an instance that does not exist.

Names only, no torch: used by ``inspect``, ``model``'s summary, the certificate printout, the
model card and the activation heatmap alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

#: An index tuple's product decomposition: one set of values per slot.
Block = tuple[tuple[int, ...], ...]


def split(name: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """``("model.layers.{}.mlp", (3,))`` for ``model.layers.3.mlp``: the template's parts (a
    numeric component becomes ``{}``) and the indices that fill its slots."""
    parts = name.split(".")
    template = tuple("{}" if p.isdigit() else p for p in parts)
    return template, tuple(int(p) for p in parts if p.isdigit())


def ranges(values: Iterable[int]) -> str:
    """Compact rendering of integers: ``0,2,5..7`` (runs of three or more become ``a..b``)."""
    ordered = sorted(set(values))
    out: list[str] = []
    start = 0
    for i in range(1, len(ordered) + 1):
        if i == len(ordered) or ordered[i] != ordered[i - 1] + 1:
            run = ordered[start:i]
            out.append(f"{run[0]}..{run[-1]}" if len(run) >= 3 else ",".join(map(str, run)))
            start = i
    return ",".join(out)


def blocks(indices: Iterable[tuple[int, ...]]) -> list[Block]:
    """Split index tuples into exact products of per-slot value sets.

    Outer values whose inner tuples are the same set share a block, recursively; blocks come
    in order of their smallest outer value. ``{(0,0),(0,1),(1,0),(1,1),(2,0)}`` gives
    ``[((0,1),(0,1)), ((2,),(0,))]``.
    """
    unique = sorted(set(indices))
    if not unique or not unique[0]:
        return [()] if unique else []
    inner: dict[int, set[tuple[int, ...]]] = {}
    for t in unique:
        inner.setdefault(t[0], set()).add(t[1:])
    shared: dict[frozenset[tuple[int, ...]], list[int]] = {}
    for outer, rest in inner.items():
        shared.setdefault(frozenset(rest), []).append(outer)
    out: list[Block] = []
    for inners, outers in sorted(shared.items(), key=lambda item: item[1][0]):
        out += [(tuple(outers), *tail) for tail in blocks(inners)]
    return out


def fill(template: Sequence[str], block: Block) -> str:
    """The template with each slot written as its values: ``{0..31}``, or a lone value bare."""
    values = iter(block)
    out = []
    for part in template:
        if part != "{}":
            out.append(part)
            continue
        slot = next(values)
        out.append(str(slot[0]) if len(slot) == 1 else "{" + ranges(slot) + "}")
    return ".".join(out)


@dataclass(frozen=True)
class Role:
    """One layer template and its instances (module names), in the order they were given."""

    template: tuple[str, ...]
    members: tuple[str, ...]
    indices: tuple[tuple[int, ...], ...]  # per member

    @classmethod
    def of(cls, name: str) -> Role:
        """``name`` as a role of its own (for listings that fold nothing)."""
        template, indices = split(name)
        return cls(template, (name,), (indices,))

    @property
    def repeated(self) -> bool:
        return len(self.members) > 1

    @property
    def blocks(self) -> list[Block]:
        return blocks(self.indices)

    @property
    def varying(self) -> tuple[int, ...]:
        """Positions (in each index tuple) of the slots that take more than one value: the
        role's layer indices, as opposed to ``transformer_blocks.0`` written into its name."""
        slots = len(self.indices[0])
        return tuple(k for k in range(slots) if len({i[k] for i in self.indices}) > 1)

    @property
    def label(self) -> str:
        """The folded name, ``down_blocks.{0..3}.resnets.{0,1}.norm1`` (several products are
        joined by `` | ``: ``down_blocks.{1,2}.resnets.0.conv_shortcut | up_blocks...``)."""
        if not self.repeated:
            return self.members[0]
        return " | ".join(fill(self.template, b) for b in self.blocks)

    def describe(self, subset: Iterable[str]) -> str:
        """Which of this role's instances ``subset`` holds: ``all``, or their indices over the
        :attr:`varying` slots (``0,79`` for one, ``(1,2; 0)`` products for several); "" for
        none."""
        chosen = set(subset)
        varying = self.varying
        picked = [
            tuple(i[k] for k in varying)
            for m, i in zip(self.members, self.indices, strict=True)
            if m in chosen
        ]
        if not picked:
            return ""
        if len(picked) == len(self.members):
            return "all"
        if len(varying) == 1:
            return ranges(i[0] for i in picked)
        return " ".join("(" + "; ".join(ranges(s) for s in b) + ")" for b in blocks(picked))


def fold(names: Iterable[str]) -> list[Role]:
    """Group ``names`` by template, roles in order of their first member."""
    found: dict[tuple[str, ...], tuple[list[str], list[tuple[int, ...]]]] = {}
    for name in names:
        template, indices = split(name)
        members, slots = found.setdefault(template, ([], []))
        members.append(name)
        slots.append(indices)
    return [Role(t, tuple(m), tuple(i)) for t, (m, i) in found.items()]
