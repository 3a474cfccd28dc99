"""Fault scenarios shared by tests/reliability and scripts/reliability (the ≥100-trial runs): kill -9 of a
rank, frozen peers and cut cables, a long stream of checked random collectives, protocol fuzz targets.
Each driver starts its ranks with testing.ranks; the rank programs are in `programs/`."""
