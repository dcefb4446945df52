"""Network emulation: MPI jobs on a throttled private link, and the bytes the kernel sent.

:func:`launch` runs ``mpirun -n N CMD...`` inside a private network namespace
(``unshare(CLONE_NEWNET)``) whose only interface is its own loopback ``lo``.
Open MPI is restricted to its TCP transport (``OMPI_MCA_btl=self,tcp``: no
shared memory), so every byte one rank sends another crosses ``lo`` once, as
a TCP/IPv4 packet, through the root queueing discipline (qdisc) installed on
``lo``:

==========================  ==================================================
settings                    root qdisc on ``lo``
==========================  ==================================================
bandwidth and latency unset ``pfifo`` (counts, never delays)
bandwidth ``R``             ``tbf rate R burst B limit Q`` (token bucket)
latency ``L``               ``netem delay L`` (needs the kernel's ``sch_netem``)
both                        ``netem delay L`` with a ``tbf`` child
==========================  ==================================================

All ranks share that one qdisc: the emulated network is a **shared link** of
``R`` bit/s in total (not ``R`` per rank). A packet waits ``L`` once, so a TCP
round trip (data, then its ACK) takes at least ``2 L``.

The qdisc's counters are the kernel's count of what was sent:
:func:`link_counters` (``tc -s -j qdisc show dev lo``) can be read from inside
an MPI rank, and :func:`launch` reports the job's total. A payload of ``P``
bytes sent from one rank to another costs ``P`` bytes of TCP payload plus, per
IPv4 packet, ``14 + 20 + 32 = 66`` bytes of Ethernet, IPv4 and TCP headers
(with the timestamp option) -- :data:`HEADER_BYTES` -- plus Open MPI's own
fragment headers and the receivers' ACK packets (66 bytes each).

**A cluster of nodes** (``launch(n, command, devices_per_process=K)``, ``jaxcomm launch --jax``):
``n`` processes of ``command`` under ``jax.distributed`` (gloo collectives over TCP), ``K`` CPU
devices each, one per emulated *node*. Each node is a network namespace of its own (and a UTS
namespace whose host name is the node's address, the address gloo binds to):

* traffic between two devices of one node (one process) goes through that node's own loopback:
  in memory, neither shaped nor counted;
* traffic between nodes leaves through the node's ``eth0``, one end of a virtual Ethernet pair
  whose other end is a port of a bridge (the switch) in the launcher's private namespace. The
  root qdisc of every node's ``eth0`` is the table's, so every node sends into the switch at
  ``R`` bit/s (a full-duplex link per node to a non-blocking switch: the ``"switched"``
  topology of :mod:`jaxcomm.cost_model`), and its counters are the node's bytes sent.

The nodes' addresses are ``192.0.2.1`` to ``192.0.2.n`` (TEST-NET-1 of RFC 5737, which no real
network uses), on interfaces that exist only inside the job's namespaces; the coordinator of
``jax.distributed`` listens on node 0, port 8476. Each process
finds in its environment ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``,
``XLA_FLAGS`` with ``--xla_force_host_platform_device_count=K``, ``JAX_PLATFORMS=cpu`` and
``JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo``; :func:`initialize_distributed` starts
``jax.distributed`` from them, and :func:`measure` (without ``world``) counts what a function
sends between the nodes. :func:`launch` reports the sum of the nodes' counters.

The namespaces exist only as long as the processes in them: :func:`launch`
ends every one of them on every exit path (normal exit, timeout, ``Ctrl-C``).
Only the namespaces' own interfaces are ever configured or used.

Needs: root, or the ``CAP_SYS_ADMIN`` and ``CAP_NET_ADMIN`` capabilities, and
the ``tc`` and ``ip`` tools of iproute2 (:func:`missing_requirements`).
"""

from __future__ import annotations

from ._cluster import initialize_distributed
from ._counters import cluster_window, link_counters, measure, measure_window
from ._launcher import RING_COLLECTIVES as RING_COLLECTIVES  # not public: the studies read netem.<name>
from ._launcher import launch, unavailable
from ._launcher import missing_requirements as missing_requirements  # not public: launch looks it up here
from ._link import NetemError, NetemUnavailable
from ._link import parse_rate as parse_rate  # not public: the studies read netem.<name>

__all__ = [
    # launching a job on the emulated network
    "launch",
    "unavailable",
    "NetemError",
    "NetemUnavailable",
    # what the link carried
    "link_counters",
    "measure_window",
    "measure",
    # a jax.distributed job's processes
    "cluster_window",
    "initialize_distributed",
]
