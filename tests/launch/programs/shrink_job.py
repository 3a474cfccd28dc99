"""Rank program of the shrinking-job tests under torchrun: examples/shrink_job.py as it is, after telling the
runner this worker's pid (testing.program.register_pid). torchrun starts each worker in a session of its
own, so the test kills the registered pids itself, whatever happened."""
import runpy
import sys
from pathlib import Path

from torch_thunderbolt.testing.program import register_pid

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "shrink_job.py"

if __name__ == "__main__":
    register_pid()
    sys.argv = [str(EXAMPLE), *sys.argv[1:]]
    runpy.run_path(str(EXAMPLE), run_name="__main__")
