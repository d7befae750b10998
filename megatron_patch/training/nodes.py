"""A job on several nodes: the network each node's ranks talk through is found, not typed, and the nodes share one
fate.

Example::

    NNODES=2 NODE_RANK=1 MASTER_ADDR=10.201.0.1 MASTER_PORT=6010 megatron-patch train --task pretraining ...
    # rapidformer: node 1 of 2 reaches MASTER_ADDR=10.201.0.1 through veth1 (10.201.0.2): GLOO_SOCKET_IFNAME=veth1
    #  NCCL_SOCKET_IFNAME=veth1
    # ... and when node 0's ranks fail, on every node:
    # rapidformer: node 0 failed first: rank 0 exited with status 1

Without ``GLOO_SOCKET_IFNAME`` gloo binds to the address the host name resolves to, which Debian's /etc/hosts maps to
127.0.1.1: the other nodes were sent a loopback address and were refused ("Gloo connectFullMesh failed ...
remote=[127.0.0.1]"). NCCL's own guess (``NCCL_SOCKET_IFNAME``) can pick a docker or VPN interface the same way.
``socket_interface`` asks the kernel which interface routes to MASTER_ADDR instead.

torchrun's agents meet through a static rendezvous (elastic/rendezvous/static_tcp_rendezvous.py): an agent never
learns that another node's ranks failed, so the healthy nodes' ranks waited in a collective for the distributed
timeout, or forever for a node lost before its ranks joined. ``JobFate`` is a thread in each node's launcher that
beats in node 0's rendezvous store and watches for a failure recorded there or a node whose beat stopped.
"""

from __future__ import annotations

import datetime
import errno
import os
import re
import socket
import threading
import time

from megatron_patch.errors import UserError

SOCKET_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
# Whether node 0 answers at all: a few seconds, so that a wrong MASTER_ADDR or a firewall is said at once; a node 0
# that starts later is waited for by torchrun's rendezvous as before.
PROBE_SECONDS = 5.0
BEAT_SECONDS = 1.0
# A launcher that did not beat for this long is gone (SIGKILL, a lost host); long next to BEAT_SECONDS so that a
# loaded host's late beats are not taken for a death.
SILENCE_SECONDS = 10.0
# How long node 0, which hosts the store, stays after a failure so that the other nodes read who failed first.
LINGER_SECONDS = 5.0

_KEY = "megatron_patch/fate/"
_BEAT = _KEY + "beat/{}"
_FAILURES = _KEY + "failures"
_FAILURE = _KEY + "failure/{}"
_VERDICT = _KEY + "verdict"
_READ = _KEY + "read"


def socket_interface(address: str) -> tuple[str, str]:
    """The network interface this host reaches ``address`` through, and its own address on it.

    Example::

        socket_interface("10.201.0.1")     # ('veth1', '10.201.0.2'); ('lo', '127.0.0.1') for 127.0.0.1

    A UDP ``connect`` sends nothing: the kernel only picks the route and the source address, which is then looked
    up among the interfaces' addresses. An address of this host is reached through the interface that holds it,
    not through ``lo`` as ``ip route get`` says: that is the interface the other nodes reach it on.
    """
    import psutil

    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(address, None, type=socket.SOCK_DGRAM)[0]
    except socket.gaierror as error:
        raise UserError(f"MASTER_ADDR={address} does not resolve ({error.strerror}): set it to node 0's address")
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((sockaddr[0], 9))
        except OSError as error:
            raise UserError(f"MASTER_ADDR={address} cannot be reached from this host ({error.strerror}): set it to "
                            f"node 0's address on a network every node shares") from None
        local = probe.getsockname()[0]
    for name, addresses in psutil.net_if_addrs().items():
        if any(entry.address.split("%")[0] == local for entry in addresses):
            return name, local
    raise UserError(f"no network interface holds {local}, this host's address towards MASTER_ADDR={address}: set "
                    f"GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME) to the interface the nodes share")


def choose_socket_interfaces(master_addr: str, environ=os.environ) -> str:
    """Set ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` in ``environ`` (the ranks inherit it) to the interface
    that routes to ``master_addr``, where the user has not; returns the line that says what was chosen.

    Example::

        choose_socket_interfaces("10.201.0.1")
        # 'reaches MASTER_ADDR=10.201.0.1 through veth1 (10.201.0.2): GLOO_SOCKET_IFNAME=veth1 NCCL_SOCKET_IFNAME=veth1'
    """
    name, local = socket_interface(master_addr)
    chosen = [variable for variable in SOCKET_VARIABLES if not environ.get(variable)]
    for variable in chosen:
        environ[variable] = name
    line = f"reaches MASTER_ADDR={master_addr} through {name} ({local})"
    if chosen:
        line += ": " + " ".join(f"{variable}={name}" for variable in chosen)
    kept = [f"{variable}={environ[variable]}" for variable in SOCKET_VARIABLES if variable not in chosen]
    if kept:
        line += f" (yours kept: {' '.join(kept)})"
    return line


def probe_master(address: str, port: int, seconds: float = PROBE_SECONDS) -> str | None:
    """None when node 0's rendezvous at ``address:port`` accepts a connection within ``seconds``, else a line that
    says so (torchrun then waits for it, as for a node 0 that starts later). A network that cannot reach it at all
    is an error.

    Example::

        probe_master("10.201.0.1", 6010)    # None, or 'node 0 does not answer at 10.201.0.1:6010 yet (...)'
    """
    deadline = time.monotonic() + seconds
    while True:
        try:
            socket.create_connection((address, port), timeout=max(0.1, deadline - time.monotonic())).close()
            return None
        except OSError as error:
            if error.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH):
                raise UserError(f"MASTER_ADDR={address} cannot be reached from this host ({error.strerror}): set it "
                                f"to node 0's address on a network every node shares") from None
            reason = error.strerror or "no answer"
        if time.monotonic() >= deadline:
            return (f"node 0 does not answer at MASTER_ADDR={address} MASTER_PORT={port} after {seconds:.0f} s "
                    f"({reason}); waiting for it: check both on every node if node 0 has started")
        time.sleep(0.2)


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list, its compressed form expanded (``scontrol show hostnames`` without
    Slurm's tools: the launcher may run where they are not installed).

    Example::

        >>> first_host("node[01-03,7],gpu[2-3]")
        'node01'
        >>> first_host("rack[4-5]-n[10-11]")
        'rack4-n10'
    """
    first, depth = [], 0
    for character in nodelist.strip():
        depth += (character == "[") - (character == "]")
        if character == "," and depth == 0:
            break
        first.append(character)
    # Each bracket's first range starts the first host; its zero padding is the host name's ("01-03" -> "01").
    return re.sub(r"\[([^],-]+)[^]]*\]", r"\1", "".join(first))


def slurm_launch(environ=os.environ) -> str | None:
    """Under ``srun`` (one launcher per node), NNODES, NODE_RANK, MASTER_ADDR and MASTER_PORT set in ``environ``
    from Slurm's variables where unset; returns the line that says so, or None outside an srun step.

    Example::

        srun --nodes 2 --ntasks-per-node 1 megatron-patch train ...   # on each node:
        slurm_launch()   # 'srun step of 2 nodes: NNODES=2 NODE_RANK=1 MASTER_ADDR=node01 MASTER_PORT=21234'

    srun sets SLURM_STEP_* for its tasks alone: a batch script that ran the recipe itself, on its first node only,
    must not wait for nodes it never started. MASTER_PORT comes from the job id, the same on every node.
    """
    if "SLURM_STEP_NUM_NODES" not in environ or "NNODES" in environ:
        return None
    nnodes, ntasks = int(environ["SLURM_STEP_NUM_NODES"]), int(environ["SLURM_STEP_NUM_TASKS"])
    if ntasks != nnodes:
        raise UserError(f"srun started {ntasks} tasks on {nnodes} nodes (SLURM_STEP_NUM_TASKS): start one launcher "
                        f"per node, srun --ntasks-per-node=1; it starts --nproc-per-node ranks itself")
    # With one task per node, a task's rank is its node's place in the step (SLURM_NODEID counts the job's nodes).
    environ["NNODES"], environ["NODE_RANK"] = str(nnodes), environ["SLURM_PROCID"]
    environ.setdefault("MASTER_ADDR", first_host(environ["SLURM_STEP_NODELIST"]))
    environ.setdefault("MASTER_PORT", str(20000 + int(environ["SLURM_JOB_ID"]) % 20000))
    return (f"srun step of {nnodes} nodes: " +
            " ".join(f"{name}={environ[name]}" for name in ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")))


class JobFate:
    """One fate for the nodes of a job: a failure on one node ends the ranks on every node, each naming the node
    that failed first.

    Example::

        fate = JobFate(node_rank=1, nnodes=2, master_addr="10.201.0.1", master_port=6010)
        try:
            torch.distributed.run.run(args)           # torchrun's agent, in this process
        except ChildFailedError as error:
            print(f"rapidformer: {fate.failed('rank 1 exited with status 1')}")
        finally:
            fate.stop()

    Every node's launcher beats in node 0's rendezvous store (node 0's launcher serves it: torchrun's agent in the
    same process shares the server, ``multi_tenant`` in static_tcp_rendezvous.py) and watches it. A node whose ranks
    failed records that (``failed``) and, once every other launcher has beaten since or one went silent, the store
    keeps the first failure as the verdict. A launcher that reads a verdict, sees another node silent for
    SILENCE_SECONDS, or loses node 0's store while its ranks run, kills its ranks (they could only wait for the
    lost ones) and the agent ends; ``failed`` then returns the verdict.
    """

    def __init__(self, node_rank: int, nnodes: int, master_addr: str, master_port: int):
        import torch.distributed

        self.node_rank, self.nnodes = node_rank, nnodes
        self.master_addr, self.master_port = master_addr, master_port
        self.verdict: str | None = None
        self._others = [node for node in range(nnodes) if node != node_rank]
        self._heard: dict[int, tuple[int, float]] = {}  # node -> (its beat count, when this node saw it change)
        self._began = time.monotonic()  # a node never heard from has been silent since then
        self._lost: set[int] = set()  # nodes found silent: node 0 does not wait for them to read the verdict
        self._lock = threading.Lock()  # the store client is used by the watching thread and by failed()
        self._stopped = threading.Event()
        self._store = None
        if node_rank == 0:
            self._store = torch.distributed.TCPStore(master_addr, master_port, is_master=True, multi_tenant=True,
                                                     wait_for_workers=False)
        self._thread = threading.Thread(target=self._watch, name="rapidformer-job-fate", daemon=True)
        self._thread.start()

    def failed(self, description: str) -> str:
        """This node's job failed as ``description`` says; returns the line naming the node that failed first."""
        if self.verdict:
            return self.verdict
        try:
            with self._lock:
                if self._store is None:
                    return f"node {self.node_rank} failed first: {description}"
                order = self._store.add(_FAILURES, 1)
                self._store.set(_FAILURE.format(order), f"node {self.node_rank} failed first: {description}")
                since = {node: self._store.add(_BEAT.format(node), 0) for node in self._others}
            # Silence is counted from a node's last beat this node saw, or from the start for one never heard (its
            # launcher killed before its first beat): such a node's ranks fail this node's only at the distributed
            # timeout, and waiting a further SILENCE_SECONDS from that failure outran the job's bound (issue 42).
            failed_at = time.monotonic()
            while not self.verdict:
                with self._lock:
                    beats = {node: self._store.add(_BEAT.format(node), 0) for node in self._others}
                silent = [node for node in self._others if beats[node] == since[node]]
                if not silent:  # every other launcher lives: the first failure recorded is the first
                    with self._lock:
                        self._store.compare_set(_VERDICT, "", self._store.get(_FAILURE.format(1)))
                    break
                lost = [node for node in silent
                        if time.monotonic() - self._last_heard(node, beats[node], failed_at) > SILENCE_SECONDS]
                if lost:  # a lost node made this one's ranks fail
                    self._decide(self._lose(lost))
                    break
                time.sleep(BEAT_SECONDS / 4)
            self._read_verdict()
        except (RuntimeError, OSError):  # node 0's store is gone: it failed as well, or first
            self.verdict = self.verdict or f"node {self.node_rank} failed first: {description}"
        return self.verdict

    def _last_heard(self, node: int, beats: int, failed_at: float) -> float:
        """When ``node``'s beat (``beats`` in the store now) last changed as this node saw it: the watch's record,
        the start for a node that never beat, ``failed_at`` for one whose first beats the watch has not seen yet."""
        if node in self._heard:
            return self._heard[node][1]
        return self._began if beats == 0 else failed_at

    def stop(self, failed: bool = False) -> None:
        """Stop watching; after a failure node 0 first waits (up to LINGER_SECONDS) until the others read the
        verdict from its store."""
        deadline = time.monotonic() + LINGER_SECONDS
        while failed and self.node_rank == 0 and time.monotonic() < deadline:
            with self._lock:
                if self._store.add(_READ, 0) >= len(self._others) - len(self._lost):
                    break
            time.sleep(0.1)
        self._stopped.set()
        self._thread.join()

    def _connect(self):
        import torch.distributed

        while not self._stopped.is_set():
            try:
                return torch.distributed.TCPStore(self.master_addr, self.master_port, is_master=False,
                                                  wait_for_workers=False, timeout=datetime.timedelta(seconds=5))
            except (RuntimeError, torch.distributed.DistError):  # node 0 has not started yet
                time.sleep(BEAT_SECONDS)
        return None

    def _watch(self) -> None:
        if self._store is None:
            store = self._connect()
            with self._lock:
                self._store = store
            if store is None:
                return
        # The first beat at once: a node killed just after its agent joined the rendezvous is then one whose beat
        # stopped, not one that never joined, whose ranks node 0's would wait for until the distributed timeout.
        interval = 0.0
        while not self._stopped.wait(interval):
            interval = BEAT_SECONDS
            try:
                with self._lock:
                    self._store.add(_BEAT.format(self.node_rank), 1)
                    beats = {node: self._store.add(_BEAT.format(node), 0) for node in self._others}
                if self._read_verdict():
                    break
            except (RuntimeError, OSError):
                if self._ranks():  # node 0 left while this node's ranks still need it
                    self._end(f"node 0 failed first: its launcher at MASTER_ADDR={self.master_addr} is gone "
                              f"(killed, or its host is down)")
                break
            now = time.monotonic()
            for node, count in beats.items():
                if count and self._heard.get(node, (None,))[0] != count:
                    self._heard[node] = (count, now)
            silent = [node for node in self._heard if now - self._heard[node][1] > SILENCE_SECONDS]
            if silent:
                self._decide(self._lose(silent))
                self._read_verdict()
                break
        while self.verdict and not self._stopped.wait(BEAT_SECONDS / 2):  # ranks the agent was still starting
            self._kill_ranks()

    def _lose(self, silent: list[int]) -> str:
        """The verdict naming the first of the ``silent`` nodes, all of them now lost to this one."""
        self._lost.update(silent)
        node = silent[0]
        if node not in self._heard:
            return f"node {node} failed first: it never joined (no launcher beat in {SILENCE_SECONDS:.0f} s)"
        return (f"node {node} failed first: its launcher stopped answering {SILENCE_SECONDS:.0f} s ago (killed, or "
                f"its host is down)")

    def _decide(self, verdict: str) -> None:
        with self._lock:
            self._store.compare_set(_VERDICT, "", verdict)

    def _read_verdict(self) -> bool:
        with self._lock:
            if not self._store.check([_VERDICT]):
                return False
            verdict = self._store.get(_VERDICT).decode()
            if self.node_rank:  # node 0 counts the others' reads (stop)
                self._store.add(_READ, 1)
        self._end(verdict)
        return True

    def _end(self, verdict: str) -> None:
        if self.verdict:
            return
        self.verdict = verdict
        self._kill_ranks()

    @staticmethod
    def _ranks() -> list:
        import psutil

        return psutil.Process().children()

    def _kill_ranks(self) -> None:
        import psutil

        # SIGKILL, not the SIGTERM a preemption sends: with --exit-signal-handler a rank would try to save at the end
        # of an iteration its lost peers never finish. A rank's own helpers die with it (compat.die_with_parent).
        for rank in self._ranks():
            try:
                rank.kill()
            except psutil.NoSuchProcess:  # it ended meanwhile
                pass
