"""torch-thunderbolt: a torch.distributed backend for Apple-silicon Macs cabled with Thunderbolt.

    import torch_thunderbolt  # registers backend "thunderbolt" and the thunderbolt:// init method
    torch.distributed.init_process_group(backend="thunderbolt")
"""
from __future__ import annotations

from .version import __version__

from .errors import (
    BackendClosedError,
    CollectiveTimeout,
    ConfigError,
    HandshakeError,
    MismatchError,
    PeerLostError,
    ProtocolError,
    ThunderboltError,
)


def _started_as_cli() -> bool:
    """Whether this interpreter is the `torch-thunderbolt` command: the console script (its top-level shim
    module is being imported) or `python -m torch_thunderbolt` (read from the interpreter's own command
    line: while the package is imported for -m, nothing else tells which module is about to run).

    The command imports torch only for the subcommands that need it, and those register the backend
    themselves: `--help`, `topo`, `launch` and `lab` must not pay ~2 s for `import torch`."""
    import sys

    if "torch_thunderbolt_cli" in sys.modules:
        return True
    argv = list(getattr(sys, "orig_argv", ()))[1:]
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "-m":
            return argv[i + 1:i + 2] == ["torch_thunderbolt"]
        if arg in ("-W", "-X"):  # the interpreter options that take a separate value
            i += 2
        elif arg.startswith("-") and arg != "-" and not arg.startswith("-c"):
            i += 1
        else:
            return False  # a script, `-c CODE` or stdin runs: a program that may rely on the registration
    return False


def _register() -> None:
    import sys

    torch_mod = sys.modules.get("torch")
    if torch_mod is not None and getattr(getattr(torch_mod, "__spec__", None), "_initializing", False):
        return  # torch's autoload is importing us: _autoload.autoload() registers, and never raises
    if torch_mod is None and _started_as_cli():
        return  # the subcommands that use the backend (bench, demo, doctor) call register() themselves
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
