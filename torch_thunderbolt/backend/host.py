"""What the op mixins (reductions.py, data_movement.py, p2p_ops.py) use of the ThunderboltProcessGroup
they are mixed into: declared once here, provided by process_group.py."""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..algorithms.collectives import Communicator
from ..config import Config
from ..transport.engine import Transport
from .work import Work


class GroupHost:
    _rank: int
    _size: int
    _cfg: Config
    _timeout: float
    _transport: Transport
    _submit: Callable[..., Work]
    _with_timeout: Callable[[Any], Communicator]
    _check_list: Callable[[list[torch.Tensor], str], None]
