"""Helpers that tests and scripts share (not imported by the backend itself)."""
