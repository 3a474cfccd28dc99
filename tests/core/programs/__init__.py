"""Rank programs of the tests in tests/core (run by torch_thunderbolt.testing.ranks)."""
