"""`torch-thunderbolt launch`: start a job's ranks on every host with a torchrun-compatible environment.

`hostfile` reads the host list, `ranks` builds each rank's env and command line (pure), `supervise` runs
them with prefixed output and stops them all when one fails (or, for a job that shrinks, lets the others
go on). `torchrun` is `torch-thunderbolt torchrun`: torchrun whose agents do not wait for a failed node.
"""
from .hostfile import Host, local_hosts, parse_hostfile, read_hostfile
from .ranks import RankSpec, build_rank_specs, master_address, rank_env, remote_script
from .supervise import supervise

__all__ = ["Host", "RankSpec", "build_rank_specs", "local_hosts", "master_address", "parse_hostfile",
           "rank_env", "read_hostfile", "remote_script", "supervise"]
