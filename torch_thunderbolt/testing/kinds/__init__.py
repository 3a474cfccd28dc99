"""Kinds of link only tests use, each added the way every kind is: a transport file, a set-up file, and one
row of the table (`rendezvous.kinds.KINDS` for the runtime's; `ROWS` here, which tests add to it).

- `sock`: Unix stream sockets between the ranks of a host (sock_link.py, sock_setup.py): the smallest kind
  over a wire, and a model for a new one.
"""
from __future__ import annotations

from ...rendezvous.setup import KindRow
from . import sock_setup

ROWS: tuple[KindRow, ...] = (
    KindRow("sock", "Unix sockets", same_host=True, networks=False, offer=sock_setup.offer,
            connect=sock_setup.connect_sock_links),
)
