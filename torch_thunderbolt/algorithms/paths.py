"""How a collective runs: the choice between the ways the Communicator can run an op, in one place. Pure.

The paths, from the most specialised:

| path       | what runs                                                                          | ops        |
|------------|------------------------------------------------------------------------------------|------------|
| `one_shot` | one copy in, one wait, the reduction in rank order, on the shared window            | all_reduce |
| `window`   | the op's windowed protocol (windowed.py) on the memory the whole group shares       | WINDOW_OPS |
| `hier`     | a hierarchical plan: per-host phases on this host's window, the cable phase on links | WINDOW_OPS |
| `direct`   | the direct plan's messages as straight code, without a plan walk (small.py)        | all_reduce |
| `plan`     | the plan `select` chose, walked over the links (plan.run_plan)                     | every op   |

The window paths are taken only where the group (`window`, `one_shot`) or this host's share of it
(`hier`) has window memory and no algorithm is forced (THUNDERBOLT_ALGO); the others follow the plan
`select` chose for the op's size, world and shape.
"""
from __future__ import annotations

from dataclasses import dataclass

WINDOW_OPS = frozenset({"all_reduce", "broadcast", "all_gather", "reduce_scatter"})
PATHS = ("one_shot", "window", "hier", "direct", "plan")


@dataclass(frozen=True)
class Group:
    """What the choice knows of the group, fixed when its Communicator is made."""

    world: int
    flat: bool = False  # the whole group shares one window (and no algorithm is forced)
    per_host: bool = False  # the group spans hosts, and this host's ranks share a window
    one_shot_bytes: int = -1  # all_reduce up to this many bytes is one-shot on the window (-1: never)


def choose(op: str, nbytes: int, group: Group, algo: str, packed: bool = False) -> str:
    """The path of collective `op` on `nbytes` bytes. `algo`: the algorithm of the plan `select` chose for it
    ("" where the group runs the op on its window: no plan is made there). `packed`: the op's buffer packs
    several tensors (a coalesced call): its layout is part of the signature, which the small paths, kept
    per element count, do not carry."""
    if group.flat and op in WINDOW_OPS:
        small = op == "all_reduce" and nbytes <= group.one_shot_bytes and not packed
        return "one_shot" if small else "window"
    if group.per_host and algo == "hier" and op in WINDOW_OPS:
        return "hier"
    if op == "all_reduce" and algo == "direct" and group.world > 1 and not packed:
        return "direct"
    return "plan"
