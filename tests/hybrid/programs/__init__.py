"""Rank programs of the tests in tests/hybrid (run by torch_thunderbolt.testing.ranks)."""
