"""Rank programs of the tests in tests/lab_cluster (one rank per emulated Mac; testing.lab.lab_setup)."""
