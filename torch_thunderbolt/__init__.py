"""torch-thunderbolt: a torch.distributed backend for Apple-silicon Macs cabled with Thunderbolt.

    import torch_thunderbolt  # registers backend "thunderbolt" and the thunderbolt:// init method
    torch.distributed.init_process_group(backend="thunderbolt")
"""
from __future__ import annotations

__version__ = "0.1.0"

from .errors import (  # noqa: E402
    BackendClosedError,
    CollectiveTimeout,
    ConfigError,
    HandshakeError,
    MismatchError,
    PeerLostError,
    ProtocolError,
    ThunderboltError,
)


def _register() -> None:
    import sys

    torch_mod = sys.modules.get("torch")
    if torch_mod is not None and getattr(getattr(torch_mod, "__spec__", None), "_initializing", False):
        return  # torch's autoload is importing us: _autoload.autoload() registers, and never raises
    from .backend.registration import register

    register()


_register()

__all__ = [
    "BackendClosedError",
    "CollectiveTimeout",
    "ConfigError",
    "HandshakeError",
    "MismatchError",
    "PeerLostError",
    "ProtocolError",
    "ThunderboltError",
    "__version__",
]
