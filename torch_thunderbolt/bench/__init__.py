"""`torch-thunderbolt bench`: an nccl-tests-style benchmark of torch.distributed backends, side by side.

Modules: sizes (parsing sizes and lists), spec (ops, dtypes, bus-bandwidth factors), check (known
inputs and exact expected outputs), metrics (statistics, result rows), table (text output), config
(flags, environment), runner (the timed loop), link (raw TCP limit), memcpy (the shared-memory
yardstick), bounds (what a row could reach at best: cables, raw link, memcpy), null (the do-nothing
process group of --floor), report (JSON, plot), spawn (local ranks), app (one run).
"""
