"""Rank programs of the tests in tests/reliability (run by torch_thunderbolt.testing.ranks)."""
