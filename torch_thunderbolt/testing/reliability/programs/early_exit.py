"""A rank of the early-exit trials (scripts/reliability/early_exit.py): it starts the default group and
exits at once, as a job whose ranks finish right after set-up does. On a busy machine rank 0, which serves
the rendezvous store, may be gone before a peer has read the last keys it needs from the store.

Environment: TB_BACKEND (thunderbolt, or gloo to compare), TB_TIMEOUT (seconds, the group's timeout),
TB_EXIT: "normal" (the interpreter's exit, whose hooks shut the group down) or "now" (os._exit right after
set-up: the store goes at once, as when a rank crashes or is killed then).
"""
from __future__ import annotations

import datetime
import os

import torch.distributed as dist

import torch_thunderbolt  # noqa: F401 - registers the backend
from torch_thunderbolt.testing.program import Exit, main, register_pid


def init_and_exit() -> Exit | None:
    register_pid()  # (shared-memory segments are counted per rank: SegmentCheck.OF_RANKS)
    dist.init_process_group(os.environ.get("TB_BACKEND", "thunderbolt"),
                            timeout=datetime.timedelta(seconds=float(os.environ.get("TB_TIMEOUT", "60"))))
    # and nothing else
    return Exit(0, hard=True) if os.environ.get("TB_EXIT") == "now" else None


if __name__ == "__main__":
    main({"init_and_exit": init_and_exit})
