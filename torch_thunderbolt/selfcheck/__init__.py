"""`torch-thunderbolt selfcheck`: every check a Mac owner can run in one go, with a report to attach.

model (torch-free: lines and options), local (start the ranks: two here, or through a hostfile), rank (one
rank's checks), ops and ddp (the checked collectives), report (the JSON and Markdown files).
"""
