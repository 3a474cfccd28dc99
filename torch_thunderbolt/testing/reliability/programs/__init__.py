"""The rank programs of the reliability scenarios (run with `python -m` by testing.ranks)."""
