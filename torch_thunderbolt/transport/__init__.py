"""Transports: move byte buffers between the ranks of a group (tcp, shm, in-memory)."""
from .base import ANY_SOURCE, Request, Transport
from .memory import MemoryHub, MemoryTransport

__all__ = ["ANY_SOURCE", "Request", "Transport", "MemoryHub", "MemoryTransport"]
