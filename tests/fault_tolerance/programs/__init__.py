"""Rank programs of the tests in tests/fault_tolerance (run by torch_thunderbolt.testing.ranks)."""
