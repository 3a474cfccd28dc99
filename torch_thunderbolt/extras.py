"""Optional dependencies of the tools (the `plot` extra): checked before a command does any work.

A command asked for a picture it cannot draw must say so before it writes other files, runs a benchmark
or changes a machine's network settings, not after.
"""
from __future__ import annotations

from .errors import ConfigError

# matplotlib is all the `plot` extra holds. torch-thunderbolt is installed from its checkout, so the hint
# names the package itself, and the extra the way a checkout installs it.
PLOT_HINT = "pip install matplotlib (or, in the torch-thunderbolt checkout: pip install -e '.[plot]')"


def require_matplotlib(option: str, alternative: str = "") -> None:
    """A ConfigError naming `option` unless matplotlib imports (a broken install counts as missing)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError(f"{option} needs matplotlib: {PLOT_HINT}{alternative}") from None
