"""A DCP merge in link mode, planned: no item is copied. Each data file of a source that
holds a chosen item is hard-linked into the output under a name of its own, and the
output's `.metadata` places every item where it already lies, in the linked file, at its
own offset: a merge of any size in the time it takes to read and write metadata.

A DCP item is found through the metadata alone (file, offset, length), so a data file may
hold items nobody reads: the linked files also hold the sources' superseded items, which
take no new space (a hard link shares its source's blocks) and which `dcp.load` never
reads. Nothing linked is lost when a source is deleted: the file system counts a hard
link's references, and the composite keeps its blocks alive. Pure: no I/O.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from mpitailor.formats.dcp import DcpMetadata
from mpitailor.planning.dcp_plan import DcpPlan


@dataclass(frozen=True, slots=True)
class Link:
    source: str   # the recipe's source name
    file: str     # its data file
    name: str     # the link's name in the output


@dataclass(frozen=True, slots=True)
class LinkPlan:
    links: tuple[Link, ...]
    output: DcpMetadata


def link_name(index: int, file: str) -> str:
    """The output's name of a source's data file: the source's place in the recipe, then
    the file's own name (`s1__0_0.distcp`): every name distinct, still DCP's suffix."""
    return f"s{index}{file}"


def plan_links(plan: DcpPlan) -> LinkPlan:
    index = {name: i for i, (name, _) in enumerate(plan.sources)}
    links: dict[tuple[str, str], Link] = {}
    items = {}
    for c in plan.copies:
        key = (c.source, c.item.file)
        if key not in links:
            links[key] = Link(c.source, c.item.file, link_name(index[c.source], c.item.file))
        i = c.item
        # (replace, not a new Item: its safetensors mark kept, which export's link-mode
        # plan of a save dir reads chunks by)
        items[(c.fqn, c.offsets)] = replace(i, file=links[key].name)
    out = plan.output
    return LinkPlan(tuple(sorted(links.values(), key=lambda link: link.name)),
                    DcpMetadata(out.tensors, out.bytes_entries, items, out.version, out.save_id,
                                out.planner_data))
