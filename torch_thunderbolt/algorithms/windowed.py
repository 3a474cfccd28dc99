"""Collectives for ranks that share memory, run on a shared window (`window.Window`) instead of send/recv.

The window's members are numbered 0..n-1 here (positions; `Window.members` maps them to group ranks):
a group all on one host runs these over every rank, a multi-host job over each host's ranks.

all_reduce goes through the tensor in rounds of up to world x cap elements (cap: one buffer / world), and
rank r owns slice r of each round:
  1. every rank copies the other slices of its input into its own buffer (slot p for rank p), posts;
  2. rank r reduces slice r by reading its input and every peer's slot r directly, writes the result
     once (into its own slot r), posts;
  3. every rank copies the other slices' results out of their owners' buffers, posts.
Per element a rank does one copy in, one read of each peer's share, one result write and one copy out,
where a ring over slot queues does a copy in and a copy out per step. A round (1 MB by default) stays in
the shared L3 cache, so peers read each other's writes from cache. Four buffers per rank let a rank run
rounds ahead of the slowest peer; counters never reset, a step is `round * STEPS + phase`.

Small all_reduces (up to THUNDERBOLT_SMALL and one buffer; the Communicator chooses) are one-shot
instead (`OneShotAllReduce`): every rank copies its whole input into its buffer and reduces all buffers
itself, in rank order (so every rank gets the same bits): one wait instead of three.

all_gather: in rounds of one buffer, every rank copies the round's part of its block into its buffer and
posts, then copies every peer's part out of the peer's buffer: one copy in and (n-1) copies out per byte
of a block, where a ring over slot queues copies every block in and out at each of its n-1 steps.

broadcast: the root copies a round into its buffer and posts; the others copy it out. The root does not
wait for them at the end: it checks their op words when its next windowed op starts (`settle`).

reduce and gather (to a root: the first per-host phase of a multi-host op): every other rank copies a
buffer's worth into its buffer and posts; the root posts its op word, then combines (or copies) theirs
straight out of the peers' buffers into its own tensor. The other ranks return without waiting for the
root: they read nothing of it, and the root checks their op words.

reduce_scatter: like all_reduce's first two steps, with each rank's block (uneven blocks allowed) in
place of its slice, and the result written straight into the output: nothing to copy out.

Every post carries an op word (op, dtype, root, element count): a peer doing something else is a
MismatchError naming both ranks, never a silently wrong result.
"""
from __future__ import annotations

import torch

from ..errors import MismatchError
from ..protocol.signature import describe_sig
from .window import BUFFERS, STEPS, Window
from .segments import offsets
from .reduce_ops import Combiner
from .small import SmallOperands

ARRIVED, REDUCED, DONE = 1, 2, 3
Slices = list[tuple[int, int]]  # (start, length) of each rank's slice in one round


def op_word(sig: int, variant: int = 0) -> int:
    """The 64-bit word a rank posts with its data: the op's signature (which already covers the count, root,
    reduce op and block layout: protocol.signature), with `variant` XORed into its digest half for forms of
    one op that must never pair (one-shot against sliced). A digest is not linear, so two different ops'
    words cannot be made equal by the XOR of a constant except by a one-in-2**32 accident. No hashing here:
    this runs on every small op."""
    return sig ^ variant


def describe_word(word: int) -> str:
    return f"{describe_sig(word)} (checksum {word & 0xFFFFFFFF:08x})"


def all_reduce_rounds(count: int, world: int, cap: int) -> list[Slices]:
    """The slices of every round; at least one round, so even an empty op is checked against its peers."""
    rounds: list[Slices] = []
    lo = 0
    while True:
        m = min(world * cap, count - lo)
        size = -(-m // world)
        rounds.append([(lo + min(m, i * size), max(0, min(size, m - i * size))) for i in range(world)])
        lo += m
        if lo >= count:
            return rounds


def free_step(g: int) -> int:
    """The step every peer must have reached before this rank rewrites the buffer of round g: the round
    that used it last (g - BUFFERS) is done."""
    return STEPS * (g - BUFFERS) + DONE


def _slice_cap(win: Window, x: torch.Tensor) -> int:
    """Elements of `x` one rank's slot of a buffer holds (a buffer has one slot per rank)."""
    cap = win.nbytes // (win.world * x.element_size())
    if cap == 0:
        raise ValueError(f"the shared window ({win.nbytes} bytes) is too small for {win.world} ranks of {x.dtype}")
    return cap


def _view(win: Window, owner: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """`owner`'s buffer k as a 1-D tensor of `dtype`, kept across ops (made once per buffer and dtype)."""
    key = (owner, k, dtype)
    view = win.cache.get(key)
    if view is None:
        raw = win.cache.get((owner, k))
        if raw is None:
            raw = win.cache[(owner, k)] = torch.frombuffer(win.buffer(owner, k), dtype=torch.uint8)
        es = torch.empty(0, dtype=dtype).element_size()
        view = win.cache[key] = raw[: win.nbytes // es * es].view(dtype)
    return view


def _check_words(win: Window, peers: list[int], k: int, word: int) -> None:
    for p in peers:
        theirs = win.word(p, k)
        if theirs != word:
            me, peer = win.members[win.rank], win.members[p]
            raise MismatchError(
                f"rank {me}: mismatched operation with rank {peer} (shared-memory collective): rank {peer} "
                f"is in {describe_word(theirs)}, but rank {me} expected {describe_word(word)}")


def settle(win: Window, deadline: float, what: object) -> None:
    """Finish the check a broadcast root left open: every peer ran that broadcast's last round (two ranks
    that both believed they were the root would otherwise both have returned, silently)."""
    if win.unchecked is None:
        return
    g, word = win.unchecked
    others = win.others
    win.wait(STEPS * g + ARRIVED, others, deadline, what)
    _check_words(win, others, g % BUFFERS, word)
    win.post(STEPS * g + DONE)  # no peer rewrites that buffer's word before this post


ONE_SHOT = 0x5A5A0001  # XORed into the op word: a one-shot rank must never pair with a sliced one


def all_reduce(win: Window, x: torch.Tensor, combine: Combiner, sig: int, deadline: float, what: object) -> None:
    """Reduce the 1-D contiguous `x` in place over every rank of the window with `combine` (the reduce op's
    kernel, reduce_ops.make_combiner), in rounds of slices (small ones run `OneShotAllReduce` instead)."""
    n, r = win.world, win.rank
    if n == 1:
        return
    settle(win, deadline, what)
    cap = _slice_cap(win, x)
    word = op_word(sig)
    others = win.others
    rounds = all_reduce_rounds(x.numel(), n, cap)
    base = win.rounds
    for t, slices in enumerate(rounds):
        g = base + t
        k = g % BUFFERS
        win.wait(free_step(g), others, deadline, what)
        mine = _view(win, r, k, x.dtype)
        for p in others:
            s, m = slices[p]
            mine[p * cap : p * cap + m].copy_(x[s : s + m])
        win.post(STEPS * g + ARRIVED, k, word)
        win.wait(STEPS * g + ARRIVED, others, deadline, what)
        _check_words(win, others, k, word)
        s, m = slices[r]
        result, acc = mine[r * cap : r * cap + m], x[s : s + m]
        for p in others:
            combine(result, acc, _view(win, p, k, x.dtype)[r * cap : r * cap + m])
            acc = result
        win.post(STEPS * g + REDUCED)
        x[s : s + m].copy_(result)
        win.wait(STEPS * g + REDUCED, others, deadline, what)
        for p in others:
            s, m = slices[p]
            x[s : s + m].copy_(_view(win, p, k, x.dtype)[p * cap : p * cap + m])
        win.post(STEPS * g + DONE)


class OneShotAllReduce:
    """The one-shot all_reduce of one element count, dtype and reduce op on a window, everything it needs
    made once (`operands[k]`: the members' buffers k, viewed for the kernel; the op word): a small all_reduce
    is latency-bound, and making or looking up three views per op cost it as much as its copy and reduction.
    `what` names the op in errors (the Communicator numbers it)."""

    __slots__ = ("win", "operands", "sig", "word", "what")
    engine = False  # its steps are window posts: nothing of it goes through the engine

    def __init__(self, win: Window, count: int, dtype: torch.dtype, op: str, combine: Combiner, sig: int,
                 what: object) -> None:
        self.win = win
        self.operands = [SmallOperands(win.rank, [_view(win, p, k, dtype)[:count] for p in range(win.world)], op,
                                       combine, filled=True) for k in range(BUFFERS)]
        self.sig, self.word, self.what = sig, op_word(sig, ONE_SHOT), what

    def run(self, x: torch.Tensor, tag: int, deadline: float) -> None:
        """x := x_0 ⊕ ... ⊕ x_{n-1} (positions in order, so every member gets the same bits). `tag`, the
        op's number, is not needed: window steps are ordered by the counters."""
        win = self.win
        if win.world == 1:
            return
        memory, word, what = win.memory, self.word, self.what
        done = memory.counter(win.rank)
        if done % STEPS:  # a broadcast root's last round is still to be checked (see settle)
            settle(win, deadline, what)
            done = memory.counter(win.rank)
        g = -(-done // STEPS)
        k = g % BUFFERS
        others, operands = win.others, self.operands[k]
        own = operands.take(x)
        # The window's post and wait, their common case inline (a small op pays for every call): the group
        # is checked once, before this op's first post (a group that breaks later fails the waits, and the
        # last post, after every read, cannot mislead a peer); a wait whose peers are there already is a
        # look at their counters.
        win.engine.check_usable()
        step = free_step(g)
        if not memory.reached(others, step, 1):
            win.wait(step, others, deadline, what)
        operands.slot_bytes[win.rank][:] = own
        step = STEPS * g + ARRIVED
        memory.publish(step, k, word)
        if not memory.reached(others, step, 1):
            win.wait(step, others, deadline, what)
        for p in others:
            if memory.word(p, k) != word:
                _check_words(win, others, k, word)  # raises, naming the peer and both ops
        operands.reduce()
        memory.publish(STEPS * g + DONE, None, 0)


def broadcast(win: Window, x: torch.Tensor, root: int, sig: int, deadline: float, what: object) -> None:
    """Copy the root's bytes (`x`: 1-D contiguous uint8) to every rank of the window."""
    n, r = win.world, win.rank
    if n == 1:
        return
    settle(win, deadline, what)
    total, cap = x.numel(), win.nbytes
    rounds = block_rounds([total], cap)
    word = op_word(sig)
    others = win.others
    base = win.rounds
    for t in range(rounds):
        g = base + t
        k = g % BUFFERS
        lo = t * cap
        m = max(0, min(cap, total - lo))
        if r == root:
            win.wait(free_step(g), others, deadline, what)
            _view(win, r, k, torch.uint8)[:m].copy_(x[lo : lo + m])
            win.post(STEPS * g + ARRIVED, k, word)
        else:
            win.wait(STEPS * g + ARRIVED, [root], deadline, what)
            _check_words(win, [root], k, word)
            x[lo : lo + m].copy_(_view(win, root, k, torch.uint8)[:m])
            win.post(STEPS * g + DONE, k, word)  # the word lets the root check that we ran the same op
    # The root's last round stays at ARRIVED (not DONE) until `settle` has checked the peers' words (the
    # window reads that off the root's counter: `Window.unchecked`): no rank writes that buffer's word
    # again before our DONE (a rank writes a buffer's word only after the step that frees it, or after
    # its root's post).


def all_gather(win: Window, out: torch.Tensor, blocks: list[tuple[int, int]], sig: int, deadline: float,
               what: object) -> None:
    """Every member's block of `out` (1-D contiguous uint8; `blocks[p]`: member p's (byte offset, length),
    its own already in place) to every member: in rounds of one buffer, each member copies the round's
    part of its block into its buffer and posts, then copies every peer's part out of theirs."""
    n, r = win.world, win.rank
    if n == 1:
        return
    settle(win, deadline, what)
    cap = win.nbytes
    rounds = block_rounds([ln for _, ln in blocks], cap)
    word = op_word(sig)
    others = win.others
    base = win.rounds
    for t in range(rounds):
        g = base + t
        k = g % BUFFERS
        lo = t * cap
        win.wait(free_step(g), others, deadline, what)
        _block_in(win, out, blocks[r], k, lo)
        win.post(STEPS * g + ARRIVED, k, word)
        win.wait(STEPS * g + ARRIVED, others, deadline, what)
        _check_words(win, others, k, word)
        _blocks_out(win, out, blocks, others, k, lo)
        win.post(STEPS * g + DONE)


def _block_in(win: Window, x: torch.Tensor, block: tuple[int, int], k: int, lo: int) -> None:
    """This member's part of `block` ((start, length) in bytes of `x`) in the round starting at byte `lo`
    of every block, into its buffer k."""
    start, length = block
    m = max(0, min(win.nbytes, length - lo))
    if m:
        _view(win, win.rank, k, torch.uint8)[:m].copy_(x[start + lo : start + lo + m])


def _blocks_out(win: Window, x: torch.Tensor, blocks: list[tuple[int, int]], peers: list[int], k: int,
                lo: int) -> None:
    """Each of `peers`' parts of its block (`blocks[p]`, in bytes of `x`) in the round starting at byte
    `lo`, out of its buffer k into `x`."""
    for p in peers:
        start, length = blocks[p]
        m = max(0, min(win.nbytes, length - lo))
        if m:
            x[start + lo : start + lo + m].copy_(_view(win, p, k, torch.uint8)[:m])


def reduce(win: Window, x: torch.Tensor, root: int, combine: Combiner, sig: int, deadline: float,
           what: object) -> None:
    """The root's 1-D contiguous `x` = the reduction (`combine`) of every member's `x`, in rank order so
    the bits are what a reduce over the members in any other form gives; the others' `x` are untouched."""
    n, r = win.world, win.rank
    if n == 1:
        return
    settle(win, deadline, what)
    cap = win.nbytes // x.element_size()
    if cap == 0:
        raise ValueError(f"the shared window ({win.nbytes} bytes) is too small for {x.dtype}")
    total = x.numel()
    rounds = block_rounds([total], cap)
    word = op_word(sig)
    others = win.others
    base = win.rounds
    for t in range(rounds):
        g = base + t
        k = g % BUFFERS
        lo = t * cap
        m = max(0, min(cap, total - lo))
        if r != root:
            # Every peer, not only the root, must be done with the buffer's last round: a broadcast root of
            # an earlier op may still have to check this buffer's word (see `settle`).
            win.wait(free_step(g), others, deadline, what)
            _view(win, r, k, x.dtype)[:m].copy_(x[lo : lo + m])
            win.post(STEPS * g + DONE, k, word)  # reads nothing of anyone's: done with the round at once
            continue
        win.wait(free_step(g), others, deadline, what)
        mine = x[lo : lo + m]
        if root >= 2:  # the sum of positions 0..root-1 lands in x before x's own turn: keep a copy of it
            mine = _view(win, r, k, x.dtype)[:m]
            mine.copy_(x[lo : lo + m])
        # The root announces the op too: a peer that waits for it in another op finds the mismatch then.
        win.post(STEPS * g + ARRIVED, k, word)
        win.wait(STEPS * g + ARRIVED, others, deadline, what)
        _check_words(win, others, k, word)
        dest = x[lo : lo + m]
        acc = mine if root == 0 else _view(win, 0, k, x.dtype)[:m]
        for p in range(1, n):
            combine(dest, acc, mine if p == root else _view(win, p, k, x.dtype)[:m])
            acc = dest
        win.post(STEPS * g + DONE)


def gather(win: Window, x: torch.Tensor, blocks: list[tuple[int, int]], root: int, sig: int, deadline: float,
           what: object) -> None:
    """Every member's block of `x` (1-D contiguous uint8; `blocks[p]` = (start, length) in bytes, each
    member holding its own) into the root's `x`."""
    n, r = win.world, win.rank
    if n == 1:
        return
    settle(win, deadline, what)
    cap = win.nbytes
    rounds = block_rounds([m for _, m in blocks], cap)
    word = op_word(sig)
    others = win.others
    base = win.rounds
    for t in range(rounds):
        g = base + t
        k = g % BUFFERS
        lo = t * cap
        if r != root:
            win.wait(free_step(g), others, deadline, what)  # see reduce
            _block_in(win, x, blocks[r], k, lo)
            win.post(STEPS * g + DONE, k, word)
            continue
        win.wait(free_step(g), others, deadline, what)
        win.post(STEPS * g + ARRIVED, k, word)  # announced, as in reduce
        win.wait(STEPS * g + ARRIVED, others, deadline, what)
        _check_words(win, others, k, word)
        _blocks_out(win, x, blocks, others, k, lo)
        win.post(STEPS * g + DONE)


def block_rounds(counts: list[int], cap: int) -> int:
    """Rounds of a windowed op: the largest block, `cap` at a time (at least one round, so even an empty op
    is checked against its peers)."""
    return max(1, -(-max(counts, default=0) // cap))


def reduce_scatter(win: Window, out: torch.Tensor, x: torch.Tensor, counts: list[int], combine: Combiner,
                   sig: int, deadline: float, what: object) -> None:
    """`out` = this rank's block of the reduction (`combine`) of every rank's `x` (blocks of `counts`)."""
    n, r = win.world, win.rank
    starts = offsets(counts)
    if n == 1:
        out.copy_(x[: counts[0]])
        return
    cap = _slice_cap(win, x)
    settle(win, deadline, what)
    # Uneven blocks that differ but add up the same must not pair: the caller's signature covers the layout.
    word = op_word(sig)
    others = win.others
    rounds = block_rounds(counts, cap)
    base = win.rounds
    for t in range(rounds):
        g = base + t
        k = g % BUFFERS
        lo = t * cap
        win.wait(free_step(g), others, deadline, what)
        mine = _view(win, r, k, x.dtype)
        for p in others:
            m = max(0, min(cap, counts[p] - lo))
            mine[p * cap : p * cap + m].copy_(x[starts[p] + lo : starts[p] + lo + m])
        win.post(STEPS * g + ARRIVED, k, word)
        win.wait(STEPS * g + ARRIVED, others, deadline, what)
        _check_words(win, others, k, word)
        m = max(0, min(cap, counts[r] - lo))
        dest, acc = out[lo : lo + m], x[starts[r] + lo : starts[r] + lo + m]
        for p in others:
            combine(dest, acc, _view(win, p, k, x.dtype)[r * cap : r * cap + m])
            acc = dest
        win.post(STEPS * g + DONE)

