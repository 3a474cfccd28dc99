"""Entry point of the `torch-thunderbolt` console script, a top-level module like torch_thunderbolt_autoload.

Its presence in `sys.modules` tells `torch_thunderbolt/__init__.py` that this process is the command line,
which imports torch only for the subcommands that need it (`--help`, `topo`, `launch`, `lab` do not).
"""


def main() -> int:
    from torch_thunderbolt.cli.main import main as run

    return run()
