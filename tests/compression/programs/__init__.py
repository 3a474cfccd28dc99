"""Rank programs of the tests in tests/compression (run by torch_thunderbolt.testing.ranks)."""
