"""How a large message is cut into parts, one per stream."""
from __future__ import annotations

ALIGN = 4096


def split_aligned(nbytes: int, parts: int) -> list[tuple[int, int]]:
    """`parts` (offset, length) pieces covering [0, nbytes); boundaries on ALIGN bytes when possible."""
    if parts <= 1 or nbytes < parts * ALIGN:
        return [(0, nbytes)]
    per = (nbytes // parts) // ALIGN * ALIGN
    out = [(i * per, per) for i in range(parts - 1)]
    out.append(((parts - 1) * per, nbytes - (parts - 1) * per))
    return out
