"""Pure helpers to cut a flat buffer into segments and pipeline chunks."""
from __future__ import annotations


def split_even(count: int, parts: int) -> list[tuple[int, int]]:
    """`parts` contiguous (offset, length) pieces covering [0, count), the first ones one longer."""
    base, extra = divmod(count, parts)
    out, off = [], 0
    for i in range(parts):
        n = base + (1 if i < extra else 0)
        out.append((off, n))
        off += n
    return out


def chunks(off: int, n: int, chunk: int) -> list[tuple[int, int]]:
    """Pipeline pieces of at most `chunk` elements (at least one piece, even when n == 0)."""
    if n <= chunk or chunk <= 0:
        return [(off, n)]
    k = -(-n // chunk)
    return [(off + o, m) for o, m in split_even(n, k)]


def ring_neighbours(order: list[int], rank: int) -> tuple[int, int, int]:
    """(position, left, right) of `rank` in the ring `order`."""
    p = order.index(rank)
    w = len(order)
    return p, order[(p - 1) % w], order[(p + 1) % w]


def offsets(counts: list[int]) -> list[int]:
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return out
