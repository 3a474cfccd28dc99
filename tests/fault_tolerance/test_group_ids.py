"""Group ids over one set of links: reused once every member is done with a group (no cap over a process's
life), and a group's identity in every signature, so two groups that share an id are a MismatchError, never
each other's data. Ranks are threads over TCP on loopback and the in-memory kind."""
from __future__ import annotations

import time

import pytest
import torch

from torch_thunderbolt.algorithms.collectives import Communicator
from torch_thunderbolt.config import Config
from torch_thunderbolt.errors import CollectiveTimeout, MismatchError
from torch_thunderbolt.testing.worlds import memory_world, on_threads, tcp_world
from torch_thunderbolt.transport.engine import Transport

pytestmark = pytest.mark.timeout(300)


def _sum_on(t: Transport) -> float:
    """An all_reduce of each rank's rank + 1 over group `t`, as every member sees it."""
    comm = Communicator(t, Config(), timeout=20.0)
    x = torch.full((16,), float(t.rank + 1))
    comm.all_reduce(x)
    return float(x[0])


def test_three_hundred_groups_made_and_closed_over_one_set_of_links() -> None:
    """More than the 128 ids a frame can name, made and closed one after another (each checked exact)."""
    with tcp_world(2) as ts:
        def body(r: int) -> list[int]:
            gids = []
            for _ in range(300):
                g = ts[r].split([0, 1], time.monotonic() + 20.0)
                assert _sum_on(g) == 3.0
                gids.append(g.gid)
                g.close()
            return gids
        run = on_threads(2, body, 240.0)
        assert not run.hung and run.first_error_by_rank() is None
        assert run.results[0] == run.results[1] and len(set(run.results[0])) < 128


def test_a_frame_of_another_group_of_the_same_id_is_a_mismatch_not_data() -> None:
    """Two ranks that each hold a group of id 5 made from different views (what a diverging agreement would
    leave): the collective between them fails with MismatchError on both, nothing is combined."""
    def fn(comm: Communicator) -> str:
        t = comm.t
        engine = t.engine
        with engine._lock:
            sub = engine.add_group(engine.agreement.add(5, (0, 1), (1, 1 + t.rank)))
        try:
            _sum_on(sub)
        except (MismatchError, CollectiveTimeout) as exc:
            return type(exc).__name__
        return "combined"
    try:
        got = memory_world(2, fn, timeout=60.0)
    except MismatchError:
        got = ["MismatchError"]
    assert set(got) == {"MismatchError"}, got


def test_a_retry_waits_for_a_stopped_member_and_names_it_instead_of_a_mismatch() -> None:
    """Rank 0 proposes a group of ranks [0, 1, 2] and stops (it pumps nothing more: SIGSTOP). Rank 1's first
    call, for [0, 1], meets that proposal during the call: a MismatchError after the grace, as for a live
    rank that calls with other ranks. Its retry holds the same proposal from before it began: it waits until
    its deadline and names rank 0 as a member that did not join (which a caller then excludes), never a
    mismatch again and again, which names nobody to exclude."""
    with tcp_world(3) as ts:
        def body(r: int) -> list[str]:
            t = ts[r]
            if r == 0:
                with t.engine._lock:
                    t.engine._say(t.engine.agreement.begin([0, 1, 2]))
                time.sleep(6.0)
                with t.engine._lock:
                    t.engine.agreement.abandon()
                return []
            if r == 2:
                time.sleep(6.0)
                return []
            time.sleep(0.3)
            seen = []
            for budget in (2.0, 2.0):
                t0 = time.monotonic()
                try:
                    t.split([0, 1], t0 + budget)
                    seen.append("made")
                except (MismatchError, CollectiveTimeout) as exc:
                    ranks = getattr(exc, "ranks", None)
                    seen.append(f"{type(exc).__name__} {ranks} {time.monotonic() - t0:.1f} {exc}")
            return seen
        run = on_threads(3, body, 60.0)
        assert not run.hung and run.first_error_by_rank() is None
        first, retry = run.results[1]
        assert first.startswith("MismatchError"), first
        assert retry.startswith("CollectiveTimeout [0]"), retry
        assert "proposed nothing during this call" in retry and "[0, 1, 2]" in retry, retry
