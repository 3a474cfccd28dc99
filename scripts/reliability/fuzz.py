"""Fuzz the frame decoder and the handshake: only ProtocolError/HandshakeError may escape.

    python scripts/reliability/fuzz.py --count 1000000 --seed 1          # structure-aware generator
    python scripts/reliability/fuzz.py --atheris --count 1000000         # coverage-guided (pip install atheris)
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# Run from a checkout without installing (under `sudo`, `python` may be another interpreter): the package
# is this checkout's.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _bare_package() -> None:
    """Make `torch_thunderbolt.*` importable without running its __init__ (which imports torch)."""
    import types

    pkg = types.ModuleType("torch_thunderbolt")
    pkg.__path__ = [str(Path(__file__).resolve().parents[2] / "torch_thunderbolt")]
    sys.modules["torch_thunderbolt"] = pkg


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=1_000_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--atheris", action="store_true", help="drive the targets with atheris (libFuzzer)")
    args, rest = ap.parse_known_args()
    t0 = time.monotonic()
    if args.atheris:
        import atheris

        _bare_package()  # instrument only our protocol code, not all of torch
        with atheris.instrument_imports(include=["torch_thunderbolt"]):
            import torch_thunderbolt.protocol.framing  # noqa: F401
            import torch_thunderbolt.protocol.handshake  # noqa: F401
        from torch_thunderbolt.testing.reliability.fuzzing import dispatch

        atheris.Setup([sys.argv[0], f"-runs={args.count}", f"-seed={args.seed}", *rest], dispatch)
        atheris.Fuzz()  # exits the process; a crash prints the input and exits non-zero
        return 0
    from torch_thunderbolt.testing.reliability.fuzzing import run

    counts = run(args.count, args.seed)
    print(json.dumps({"inputs": args.count, "per_target": counts, "escapes": 0,
                      "seconds": round(time.monotonic() - t0, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
