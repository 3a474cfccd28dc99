"""torch.distributed glue: the ProcessGroup, work objects, registration."""
from .registration import register

__all__ = ["register"]
