"""Collective communication for AllreduceStrategy jobs: a ring allreduce over plain TCP among the members of
a membership round (:mod:`edl_argo.master.rendezvous`), with a timeout on every wait.

* :mod:`~edl_argo.collective.ring` — the algorithm, independent of any transport;
* :mod:`~edl_argo.collective.transport` — the wire: framed pieces and state requests over TCP;
* :mod:`~edl_argo.collective.mailbox` — the receiving side: each worker's collective server and mailbox;
* :mod:`~edl_argo.collective.group` — one member's view of one round: rank, neighbours, allreduce, state pull.
"""

from edl_argo.collective.group import CollectiveAborted, CollectiveGroup
from edl_argo.collective.mailbox import CollectiveServer
from edl_argo.collective.ring import ring_allreduce

__all__ = ["CollectiveAborted", "CollectiveGroup", "CollectiveServer", "ring_allreduce"]
