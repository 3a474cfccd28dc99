"""Rank programs of the tests in tests/shm (run by torch_thunderbolt.testing.ranks)."""
