"""`torch-thunderbolt bench`: thin shell over torch_thunderbolt.bench."""
from __future__ import annotations

import argparse


def configure(parser: argparse.ArgumentParser) -> None:
    from ..bench.config import add_arguments

    add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from ..bench import app
    from ..bench.config import from_args

    return app.main(from_args(args))
