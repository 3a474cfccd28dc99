"""Rank programs of the tests in tests/bench (run by torch_thunderbolt.testing.ranks)."""
