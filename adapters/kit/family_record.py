"""One record per family of towers: what every family's record says, whichever view serves it.

A family is one frozen record in its plugin's module: a
:class:`~layergraph_adapters.kit.tower_specs.TowerSpec` for a fixed-resolution family, a
:class:`~layergraph_adapters.kit.packed_tower.PackedFamily` for a native-resolution one, a
:class:`FrameworkFamily` for another library's towers (timm's, open_clip's), all
:class:`FamilyRecord`. Everything else about families is read from the records: the release
table and CI's floors (:func:`~layergraph_adapters.kit.versions.support_table`,
:func:`~layergraph_adapters.kit.versions.floors`),
which speed options a family's layers rule out and why (:meth:`FamilyRecord.ruled_out`,
given to :class:`~layergraph_adapters.kit.automatic.SpeedChoices` so that ``"auto"`` is off
with the reason and ``True`` is refused with it, without a trial build), and the packed
families' own files. :func:`family_records` finds every record the plugins of the
entry-point group ``layergraph`` hold.

What a record does not do: decide an option for one tower. A plan still checks what the
record cannot know (a tower's MLP activation, its patch embedding's stride) when it takes an
option.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from layergraph_adapters.kit.fused_norm import LayerForm

__all__ = ["FamilyRecord", "FrameworkFamily", "Support", "family_records", "records_in"]


@dataclass(frozen=True)
class Support:
    """What one family of transformers towers is served with: the releases, the functions of
    layergraph that follow transformers' code for it, what is read from the release at run time
    rather than from its version, and the tests that check it (which CI runs with the oldest
    release of the range, and the newest)."""

    name: str
    """The family's name in the docs and the release table."""
    checked: str
    """The transformers releases served, as a version specifier."""
    copies: tuple[str, ...]
    """The functions that compute what transformers' own code computes for this family
    (``module:qualified name``): each is compared with transformers' forward by its tests."""
    probes: tuple[str, ...]
    """What the family's plan reads from the installed release's behaviour or declarations
    rather than its version."""
    tests: tuple[str, ...]
    """The test files that check the family against transformers' own forward."""

    @property
    def floor(self) -> str:
        """The oldest release of :attr:`checked` (its ``>=`` bound)."""
        found = re.search(r">=\s*([0-9][0-9.]*)", self.checked)
        if found is None:
            raise ValueError(f"{self.checked!r} names no oldest release")
        return found.group(1)


@dataclass(frozen=True, kw_only=True)
class FamilyRecord:
    """What every family's record says, besides how its view finds and calls the tower."""

    layer_form: LayerForm | None = field(default=None, compare=False)
    """How the family's layers compute, for ``fuse_norm``
    (:class:`~layergraph_adapters.kit.fused_norm.LayerForm`); ``None``: ``fuse_norm`` does not
    serve them."""
    support: Support | None = field(default=None, compare=False)
    """What the family is served with (releases, the functions that copy transformers' code,
    the tests that check them); ``None`` for a family that follows no library's code."""

    @property
    def title(self) -> str:
        """The family's name in messages."""
        raise NotImplementedError(f"{type(self).__name__} names no title")

    def ruled_out(self) -> dict[str, str]:
        """The speed options this family's layers never take, each with why (a sentence
        naming the option and the family)."""
        if self.layer_form is None:
            return {
                "fuse_norm": f"fuse_norm is not available for {self.title}: its record declares "
                "no layer form to fuse"
            }
        return {}


@dataclass(frozen=True)
class FrameworkFamily(FamilyRecord):
    """The record of a family of towers of a library other than transformers (timm's ViTs,
    open_clip's towers), found and called by its adapter's own plan: its name, and what every
    record says."""

    name: str
    """The family's name in messages and the docs."""

    @property
    def title(self) -> str:
        return self.name


def records_in(plugin: object) -> Iterator[FamilyRecord]:
    """The family records a plugin module holds: its module-level records, those in its
    module-level tuples (``TOWERS``), and those of its adapter classes (their ``families``)."""
    for value in vars(plugin).values():
        if isinstance(value, FamilyRecord):
            yield value
        elif isinstance(value, tuple):
            yield from (item for item in value if isinstance(item, FamilyRecord))
        elif isinstance(value, type):
            families = getattr(value, "families", ())
            yield from (item for item in families if isinstance(item, FamilyRecord))


def family_records() -> list[FamilyRecord]:
    """Every family record of the plugins of the entry-point group ``layergraph``, once each,
    in the plugins' order (each imported; one that fails to import is left out)."""
    found: dict[int, FamilyRecord] = {}
    for point in entry_points(group="layergraph"):
        try:
            plugin = point.load()
        except Exception:  # a broken plugin holds no record here
            continue
        for record in records_in(plugin):
            found.setdefault(id(record), record)
    return list(found.values())
