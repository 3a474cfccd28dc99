"""`torch-thunderbolt torchrun`: torchrun whose agents do not wait for a node that failed, so a job that
shrinks past a lost rank ends when its last rank does.

torchrun (torch.distributed.run) runs one elastic agent per node. When its workers have all succeeded, an
agent waits in an exit barrier (`_exit_barrier`, through the rendezvous store) until every agent of the
job has arrived, for up to `exit_barrier_timeout` seconds (300; no torchrun option or variable sets it).
An agent whose workers failed leaves without arriving. So when one node's rank is lost and the ranks of the
other nodes shrink past it (`dist.shrink_group`) and finish, their agents wait the whole 300 s for it, then
log the timeout and exit 0.

Here the agent whose workers failed, before it exits, counts itself as arrived at the exit barrier (the
barrier's own non-blocking check-in, keys and count unchanged); the other agents then leave the barrier as
soon as their own workers are done. The agent of a node lost whole (powered off, asleep, cables pulled)
cannot check in: for that case `exit_barrier_timeout` bounds the wait. Nothing else differs from torchrun:
the same arguments, rendezvous, restarts and exit codes; with `--max-restarts` above 0 an agent checks in
only once its restarts are used up (a job that shrinks runs with 0, torchrun's default).

torchrun's agent still stops every worker of its node when one of them fails (by design: a worker group
succeeds or fails as one), so a job that shrinks runs one worker per torchrun node (`--nproc-per-node 1`).
"""
from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any, Iterator, Sequence

from ..errors import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_EXIT_BARRIER_TIMEOUT = 300.0  # torch's own default
CHECK_IN_TIMEOUT = 10.0  # seconds a failed agent spends at most reaching the store on its way out


def agent_class(exit_barrier_timeout: float) -> type:
    """A LocalElasticAgent whose failed run checks in at the exit barrier, and whose barrier waits at most
    `exit_barrier_timeout` seconds."""
    from torch.distributed.elastic.agent.server import api
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.utils import store as store_util

    class ShrinkingJobAgent(LocalElasticAgent):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("exit_barrier_timeout", exit_barrier_timeout)
            super().__init__(*args, **kwargs)

        def _invoke_run(self, role: str = api.DEFAULT_ROLE) -> Any:
            result = super()._invoke_run(role)
            if result.is_failed():
                self._check_in_as_ended()
            return result

        def _check_in_as_ended(self) -> None:
            """Arrive at the exit barrier without waiting there: this node's workers have failed, and the
            agents whose workers finished must not wait for it."""
            group = self._worker_group
            try:
                with store_util.store_timeout(self._store, CHECK_IN_TIMEOUT):
                    store_util._barrier_nonblocking(store=self._store, world_size=group.group_world_size,
                                                    key_prefix=api._TERMINAL_STATE_SYNC_ID)
            except Exception as exc:  # noqa: BLE001 - the store's node may be the one gone: nobody waits then
                logger.warning("torch-thunderbolt torchrun: node %s's workers failed and it could not tell the "
                               "other agents (%s: %s); they wait for it up to %.0f s", group.group_rank,
                               type(exc).__name__, exc, self._exit_barrier_timeout)
                return
            logger.warning("torch-thunderbolt torchrun: node %s's workers failed; counted as arrived at the exit "
                           "barrier, so the other nodes' agents do not wait for it", group.group_rank)

    return ShrinkingJobAgent


def check_torch() -> None:
    """A clear error when this torch's elastic agent lacks what `agent_class` builds on."""
    import torch
    from torch.distributed.elastic.agent.server import api
    from torch.distributed.elastic.utils import store as store_util
    from torch.distributed.launcher import api as launcher_api

    missing = [name for module, name in ((api, "_TERMINAL_STATE_SYNC_ID"), (store_util, "_barrier_nonblocking"),
                                         (store_util, "store_timeout"), (launcher_api, "LocalElasticAgent"),
                                         (api.SimpleElasticAgent, "_invoke_run"))
               if not hasattr(module, name)]
    if missing:
        raise ConfigError(f"torch {torch.__version__}'s torchrun lacks {', '.join(missing)}: use torchrun itself "
                          "(its agents wait up to 300 s for a node that failed)")


@contextlib.contextmanager
def agents_of(cls: type) -> Iterator[None]:
    """torchrun's launcher builds its agents from `cls` inside the block (it names the class at call time)."""
    from torch.distributed.launcher import api as launcher_api

    saved = launcher_api.LocalElasticAgent
    launcher_api.LocalElasticAgent = cls
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = saved


def run_torchrun(argv: Sequence[str], exit_barrier_timeout: float = DEFAULT_EXIT_BARRIER_TIMEOUT) -> int:
    """torchrun with `argv` (its own arguments, the program and the program's); -> its exit code."""
    if not exit_barrier_timeout > 0:
        raise ConfigError(f"--exit-barrier-timeout must be > 0 seconds, got {exit_barrier_timeout}")
    if not argv:
        raise ConfigError("expected torchrun's arguments: torch-thunderbolt torchrun --nnodes 3 --nproc-per-node 1 "
                          "... train.py")
    check_torch()
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    with agents_of(agent_class(exit_barrier_timeout)):
        try:
            torchrun.main(list(argv))
        except ChildFailedError as exc:  # this node's workers failed: torchrun's report of which and how
            print(f"torch-thunderbolt torchrun: {exc}", file=sys.stderr, flush=True)
            return 1
        except SystemExit as exc:  # torchrun's own exits (bad arguments, --help)
            return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0
