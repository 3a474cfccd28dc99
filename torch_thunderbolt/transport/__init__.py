"""Transports: move byte buffers between the ranks of a group. One engine (engine.Transport) drives links of
several kinds: TCP streams (tcp.py), shared-memory rings (shm.py) and in-process delivery (memory.py)."""
from .base import ANY_SOURCE, Request
from .engine import Transport
from .memory import MemoryHub

__all__ = ["ANY_SOURCE", "Request", "Transport", "MemoryHub"]
