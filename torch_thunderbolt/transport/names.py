"""How errors name the ranks of a subgroup. A transport numbers its peers by their rank in the group, so in
`new_group([1, 2])` "rank 0" is global rank 1; an error that said only "rank 0" would send the reader to the
wrong process. `RankNames` rewrites an error's text once, where the transport fails (and for a timeout):
"rank 0 (global rank 1) of process group 3: lost the connection to rank 1 (global rank 2) ...". The
default group, and any group whose ranks are the global ones, keep their messages as they are."""
from __future__ import annotations

import re
from typing import Sequence

_RANK = re.compile(r"(?<!global )(?<!local )\brank (\d+)\b(?! \(global)")
_RANKS = re.compile(r"(?<!global )(?<!local )(\branks\b[^\[\]\n]{0,40}?\[)([\d, ]*)\](?! \(global)")
_DONE = re.compile(r"rank \d+ \(global rank \d+\) of process group ")


class RankNames:
    """The global rank of every group rank, and the group's name: built once per transport."""

    def __init__(self, global_ranks: Sequence[int], group: str) -> None:
        self.global_ranks = list(global_ranks)
        self.group = group
        self.names = [f"rank {r} (global rank {g})" for r, g in enumerate(self.global_ranks)]

    @classmethod
    def for_group(cls, global_ranks: Sequence[int] | None, size: int, group: str) -> "RankNames | None":
        """None when group ranks are global ranks already (the default group: torch passes no ranks)."""
        ranks = list(global_ranks or [])
        if len(ranks) != size or ranks == list(range(size)):
            return None
        return cls(ranks, group)

    def rewrite(self, text: str) -> str:
        """`text` with every "rank N" / "ranks [..]" of this group also given in global ranks (idempotent)."""
        first = [True]

        def one(m: re.Match) -> str:
            r = int(m.group(1))
            if not 0 <= r < len(self.names):
                return m.group(0)
            name = self.names[r]
            if first[0]:  # the reporting rank, which starts every message: say which group too
                first[0] = False
                return f"{name} of process group {self.group}"
            return name

        def many(m: re.Match) -> str:
            try:
                ranks = [int(x) for x in m.group(2).replace(" ", "").split(",") if x]
            except ValueError:
                return m.group(0)
            if not all(0 <= r < len(self.global_ranks) for r in ranks):
                return m.group(0)
            return f"{m.group(1)}{m.group(2)}] (global ranks {[self.global_ranks[r] for r in ranks]})"

        if _DONE.match(text):
            first[0] = False
        return _RANKS.sub(many, _RANK.sub(one, text))

    def apply(self, exc: BaseException) -> BaseException:
        """Rewrite `exc`'s message in place (the same object is raised on every waiting thread)."""
        if exc.args and isinstance(exc.args[0], str):
            new = self.rewrite(exc.args[0])
            if new != exc.args[0]:
                exc.args = (new, *exc.args[1:])
        return exc
