"""Public helpers for testing code that uses torch-thunderbolt, shared by the test suite and the scripts.

A tool beside the library: the backend never imports it. The one place that starts test ranks:

- `testing.ranks`: real rank processes on this host or a lab (`run_ranks`, `start_ranks`, `RankResult`,
  and the `Setup` of a family of runs: `LOOPBACK`, `SHM`, `HYBRID`, `reliability_setup()`).
- `testing.program`: what a rank program imports (`result`, `outcome`, `emit`, `main`, `shm_rank` ...).
- `testing.worlds`: ranks as threads of one process (`memory_world`, `tcp_world`, `exchange_world`,
  `SetUpOnThreads`).
- `testing.lab`: emulated clusters (`lab_session`, `lab_setup`, `skip_unless_lab`).
- `testing.leftovers`: what a run may leave behind (processes, sockets, namespaces, segments).
- `testing.reliability`: the fault scenarios shared by tests/reliability and scripts/reliability.
- `testing.fake_device`: a fake accelerator standing in for `mps` on Linux.
- `testing.apple_gpu`: that accelerator timed as an Apple-silicon GPU (presets per chip, asynchronous).
- `testing.darwin_runtime`: macOS's runtime modelled on Linux: the GIL around a ctypes call, XNU's
  yield on a contended core (`XnuCore`), IOKit's power assertions (`FakeIOKit`).
- `testing.models`: the Llama-style decoder and the ViT that the examples run and `bench --workload` times.
- `testing.darwin`: a model of macOS's socket layer (XNU's answers, option inheritance, the drop timer).

This package imports nothing at import time, so that `import torch_thunderbolt.testing.X` costs only X.
"""
