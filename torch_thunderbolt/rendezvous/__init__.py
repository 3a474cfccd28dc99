"""Set-up, apart from the transport: host identity, TCP and shared-memory connection set-up through the
rendezvous store, and `connect(store, rank, world, cfg, timeout)`, which gives the backend a connected
transport and what it needs to derive the cluster shape (every rank's networks and host)."""
