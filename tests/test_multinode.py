"""Two nodes with addresses of their own (two network namespaces joined by a veth pair), as project issue 42 ran
them: the launcher finds the network the ranks talk through, and a node that fails ends the other.

    sudo python -m pytest -q -p no:cacheprovider tests/test_multinode.py

Each node's /etc/hosts (``ip netns exec`` mounts /etc/netns/NAME/hosts over it) maps the host name to 127.0.1.1,
as Debian's does: gloo left to itself advertised that loopback address to the other node. The namespace tests need
root and ``ip netns``; without them they are skipped.
"""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ADDRESSES = ("10.201.0.1", "10.201.0.2")
# A tiny GPT, TP=2 across the two nodes, one CPU process each.
JOB = ["--task", "pretraining", "--nproc-per-node", "1", "--tensor-model-parallel-size", "2", "--num-layers", "2",
       "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "32",
       "--micro-batch-size", "1", "--global-batch-size", "1", "--mock-data", "--tokenizer-type", "NullTokenizer",
       "--vocab-size", "100", "--log-interval", "1", "--distributed-timeout-minutes", "0.25"]


def _ip(*args) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def two_hosts():
    """Two namespaces, 10.201.0.1/24 and 10.201.0.2/24 on either end of a veth pair, each with the Debian
    /etc/hosts trap; removed afterwards with every process still in them."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("needs root and iproute2's ip (network namespaces)")
    tag = f"{os.getpid() % 100000}"
    names = [f"mp{tag}n{node}" for node in (0, 1)]
    made = []
    try:
        for name in names:
            _ip("netns", "add", name)
            made.append(name)
    except (subprocess.CalledProcessError, OSError) as error:
        for name in made:
            _ip("netns", "del", name)
        pytest.skip(f"ip netns add failed: {getattr(error, 'stderr', error)}")
    try:
        _ip("link", "add", f"mp{tag}v0", "type", "veth", "peer", "name", f"mp{tag}v1")
        for node, (name, address) in enumerate(zip(names, ADDRESSES)):
            _ip("link", "set", f"mp{tag}v{node}", "netns", name)
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", f"mp{tag}v{node}")
            _ip("-n", name, "link", "set", f"mp{tag}v{node}", "up")
            _ip("-n", name, "link", "set", "lo", "up")
            os.makedirs(f"/etc/netns/{name}", exist_ok=True)
            with open(f"/etc/netns/{name}/hosts", "w") as f:
                f.write(f"127.0.0.1 localhost\n127.0.1.1 {socket.gethostname()}\n")
        yield names
    finally:
        for name in names:
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)


def _start_nodes(names, tmp_path, port, *flags, env_of=None):
    """Both nodes' launchers (`megatron-patch train`), each in its namespace, output to tmp_path/nodeN.log;
    ``env_of`` adds to one node's environment: ``(node, {name: value})``."""
    environment = {k: v for k, v in os.environ.items() if not k.endswith("_SOCKET_IFNAME")}
    environment.update(PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
                       CUDA_VISIBLE_DEVICES="", NNODES="2", MASTER_ADDR=ADDRESSES[0], MASTER_PORT=str(port))
    nodes = []
    for rank, name in enumerate(names):
        with open(tmp_path / f"node{rank}.log", "w") as log:  # the launcher writes to its own copy
            nodes.append(subprocess.Popen(
                ["ip", "netns", "exec", name, sys.executable, "-m", "megatron_patch.cli", "train", *JOB, *flags],
                env={**environment, "NODE_RANK": str(rank), **(env_of[1] if env_of and env_of[0] == rank else {})},
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    return nodes


def _wait(node, timeout):
    try:
        return node.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def test_two_hosts_train_through_the_interface_found(two_hosts, tmp_path):
    """Failed before: node 1's rank failed at once ("Gloo connectFullMesh failed ... remote=[127.0.1.1]") and node 0
    waited for it. Now each launcher sets GLOO_SOCKET_IFNAME to its veth end, says so, and TP=2 trains."""
    nodes = _start_nodes(two_hosts, tmp_path, 29542, "--train-iters", "3")
    statuses = [_wait(node, 240) for node in nodes]
    logs = [(tmp_path / f"node{rank}.log").read_text() for rank in (0, 1)]
    assert statuses == [0, 0], logs
    tag = two_hosts[0][2:-2]
    for rank, log in enumerate(logs):
        [line] = [line for line in log.splitlines() if line.startswith(f"rapidformer: node {rank} of 2 ")]
        assert (f"reaches MASTER_ADDR={ADDRESSES[0]} through mp{tag}v{rank} ({ADDRESSES[rank]}): "
                f"GLOO_SOCKET_IFNAME=mp{tag}v{rank} NCCL_SOCKET_IFNAME=mp{tag}v{rank}") in line, log
        assert log.index(line) < log.index("+ "), log  # among the first lines, before torchrun's command
    assert "iteration        3/       3" in logs[1] or " 3/" in logs[1], logs[1]


def test_a_killed_node_ends_the_other(two_hosts, tmp_path):
    """Failed before: with node 1's launcher killed, node 0's agent never learnt of it and its rank waited (6.5
    minutes in the issue). Now node 0 exits 1 within the silence limit plus a few seconds, naming node 1, and
    nothing of the job is left on either node."""
    from megatron_patch.training.nodes import SILENCE_SECONDS

    nodes = _start_nodes(two_hosts, tmp_path, 29543, "--train-iters", "100000")
    try:
        deadline = time.monotonic() + 180
        while "+ " not in (tmp_path / "node1.log").read_text() or " iteration " not in (
                tmp_path / "node0.log").read_text() + (tmp_path / "node1.log").read_text():
            assert all(node.poll() is None for node in nodes), [
                (tmp_path / f"node{r}.log").read_text() for r in (0, 1)]
            assert time.monotonic() < deadline, "the job did not start training"
            time.sleep(0.2)
        job = [p for node in nodes for p in [psutil.Process(node.pid), *psutil.Process(node.pid).children(True)]]
        killed = time.monotonic()
        os.kill(nodes[1].pid, signal.SIGKILL)
        status = _wait(nodes[0], SILENCE_SECONDS + 20)
        took = time.monotonic() - killed
        log = (tmp_path / "node0.log").read_text()
        assert status == 1, log[-3000:]
        assert took < SILENCE_SECONDS + 20, took
        [line] = [line for line in log.splitlines() if line.startswith("rapidformer: the job failed: ")]
        assert line.startswith("rapidformer: the job failed: node 1 failed first: "), log[-3000:]
        _, alive = psutil.wait_procs(job, timeout=10)
        assert not alive, [(p.pid, p.cmdline()) for p in alive if p.is_running()]
    finally:
        for node in nodes:
            node.kill()


@pytest.mark.parametrize("failing", [1, 0])
def test_a_node_that_fails_at_start_ends_the_other(two_hosts, tmp_path, failing):
    """The failing node's GLOO_SOCKET_IFNAME names no interface (a user's setting wins over the one found), so its
    rank fails at start. Failed before: the other node's rank waited for it until the distributed timeout, and its
    launcher named only its own rank. Now it ends within seconds, naming the failing node's rank; node 0, which
    serves the store, stays until node 1 has read who failed."""
    nodes = _start_nodes(two_hosts, tmp_path, 29544 + failing, "--train-iters", "3",
                         env_of=(failing, {"GLOO_SOCKET_IFNAME": "nosuch0"}))
    try:
        statuses = {failing: _wait(nodes[failing], 120)}
        first = time.monotonic()
        statuses[1 - failing] = _wait(nodes[1 - failing], 60)
        took = time.monotonic() - first
        logs = [(tmp_path / f"node{rank}.log").read_text() for rank in (0, 1)]
        assert statuses == {0: 1, 1: 1}, logs
        assert "(yours kept: GLOO_SOCKET_IFNAME=nosuch0)" in logs[failing], logs[failing]
        for log in logs:
            [line] = [line for line in log.splitlines() if line.startswith("rapidformer: the job failed: ")]
            assert line == (f"rapidformer: the job failed: node {failing} failed first: rank {failing} exited with "
                            f"status 1"), log[-3000:]
        assert took < 10, took  # the distributed timeout is 15 s
    finally:
        for node in nodes:
            node.kill()


def test_a_node_without_a_route_to_master_addr_is_told_at_once(two_hosts, tmp_path):
    """Failed before: torchrun's agent retried node 0's store until the rendezvous timeout (15 minutes)."""
    started = time.monotonic()
    result = subprocess.run(
        ["ip", "netns", "exec", two_hosts[1], sys.executable, "-m", "megatron_patch.cli", "train", *JOB,
         "--train-iters", "1"], capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": ROOT, "CUDA_VISIBLE_DEVICES": "", "NNODES": "2", "NODE_RANK": "1",
             "MASTER_ADDR": "10.9.9.9", "MASTER_PORT": "29546"})
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.splitlines() == [
        "rapidformer: error: MASTER_ADDR=10.9.9.9 cannot be reached from this host (Network is unreachable): set it "
        "to node 0's address on a network every node shares"], result.stderr
    assert time.monotonic() - started < 60


def test_the_interface_found_and_the_users_setting():
    """No root needed: MASTER_ADDR 127.0.0.1 is reached through lo; a variable the user set is kept."""
    from megatron_patch.training.nodes import choose_socket_interfaces

    environ = {}
    assert choose_socket_interfaces("127.0.0.1", environ) == (
        "reaches MASTER_ADDR=127.0.0.1 through lo (127.0.0.1): GLOO_SOCKET_IFNAME=lo NCCL_SOCKET_IFNAME=lo")
    assert environ == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    environ = {"NCCL_SOCKET_IFNAME": "ib0"}
    assert choose_socket_interfaces("127.0.0.1", environ).endswith(
        ": GLOO_SOCKET_IFNAME=lo (yours kept: NCCL_SOCKET_IFNAME=ib0)")
    assert environ == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "ib0"}


def test_a_master_that_does_not_answer_is_said_in_one_line():
    from megatron_patch.distributed import free_port
    from megatron_patch.training.nodes import probe_master

    port = free_port()
    started = time.monotonic()
    line = probe_master("127.0.0.1", port, seconds=1)
    assert time.monotonic() - started < 5
    assert line.startswith(f"node 0 does not answer at MASTER_ADDR=127.0.0.1 MASTER_PORT={port} after 1 s "
                           "(Connection refused); waiting for it"), line
    with socket.create_server(("127.0.0.1", 0)) as server:
        assert probe_master("127.0.0.1", server.getsockname()[1]) is None


SRUN = dict(SLURM_JOB_ID="4321", SLURM_STEP_NUM_NODES="3", SLURM_STEP_NUM_TASKS="3", SLURM_PROCID="2",
            SLURM_STEP_NODELIST="gpu[07-09,12],cpu1")


@pytest.mark.parametrize("nodelist, first", [("gpu[07-09,12],cpu1", "gpu07"), ("rack[4-5]-n[10-11]", "rack4-n10"),
                                             ("a1,b[2-3]", "a1"), ("n[7]", "n7"), ("login", "login")])
def test_the_first_host_of_a_slurm_host_list(nodelist, first):
    from megatron_patch.training.nodes import first_host

    assert first_host(nodelist) == first


def test_an_srun_step_names_the_nodes():
    """srun's variables become the seed's: the node count, this task's rank, the first host, a port from the job
    id; what the user set wins; outside an srun step (a batch script's own shell) nothing is set."""
    from megatron_patch.errors import UserError
    from megatron_patch.training.nodes import slurm_launch

    environ = dict(SRUN)
    assert slurm_launch(environ) == "srun step of 3 nodes: NNODES=3 NODE_RANK=2 MASTER_ADDR=gpu07 MASTER_PORT=24321"
    environ = {**SRUN, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "6010"}
    assert slurm_launch(environ).endswith("MASTER_ADDR=10.0.0.1 MASTER_PORT=6010")
    environ = {**SRUN, "NNODES": "1"}
    assert slurm_launch(environ) is None and "NODE_RANK" not in environ
    assert slurm_launch({"SLURM_JOB_ID": "4321", "SLURM_PROCID": "0", "SLURM_NNODES": "2"}) is None
    with pytest.raises(UserError, match=r"srun started 24 tasks on 3 nodes \(SLURM_STEP_NUM_TASKS\): start one "
                                        r"launcher per node, srun --ntasks-per-node=1"):
        slurm_launch({**SRUN, "SLURM_STEP_NUM_TASKS": "24"})


def test_the_launcher_counts_the_nodes_of_an_srun_step():
    """The srun step's 3 nodes are in the world the layout is checked against: 3 x 1 processes leave DP 3."""
    environment = {k: v for k, v in os.environ.items() if k not in ("NNODES", "NODE_RANK", "MASTER_ADDR",
                                                                    "MASTER_PORT")}
    result = subprocess.run(
        [sys.executable, "-m", "megatron_patch.training.launcher", "--task", "pretraining", "--mock-data",
         "--train-iters", "1", "--nproc-per-node", "1", "--model-name", "tiny-gpt2", "--global-batch-size", "4"],
        env={**environment, **SRUN, "PYTHONPATH": ROOT, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True,
        timeout=60)
    assert result.returncode == 1 and result.stdout == "", result.stdout + result.stderr
    assert "--global-batch-size 4 is not divisible by --micro-batch-size 1 x data-parallel size 3" in result.stderr


def test_a_preempted_two_node_job_saves_and_exits_0(two_hosts, tmp_path):
    """A scheduler's SIGTERM to both launchers: the ranks save their last iteration and every node exits 0; the
    watch over the nodes takes no part (a node that ends well is no failure)."""
    save = tmp_path / "ckpt"
    nodes = _start_nodes(two_hosts, tmp_path, 29547, "--train-iters", "100000", "--save", str(save),
                         "--exit-signal-handler")
    try:
        deadline = time.monotonic() + 180
        while " iteration " not in (tmp_path / "node1.log").read_text():
            assert all(node.poll() is None for node in nodes), [
                (tmp_path / f"node{r}.log").read_text()[-3000:] for r in (0, 1)]
            assert time.monotonic() < deadline, "the job did not start training"
            time.sleep(0.2)
        for node in nodes:
            os.kill(node.pid, signal.SIGTERM)
        statuses = [_wait(node, 90) for node in nodes]
        logs = [(tmp_path / f"node{rank}.log").read_text() for rank in (0, 1)]
        assert statuses == [0, 0], [log[-3000:] for log in logs]
        assert "exiting on signal 15: saved iteration" in logs[0] + logs[1], logs
        assert (save / "latest_checkpointed_iteration.txt").exists()
        assert "the job failed" not in logs[0] + logs[1], logs
    finally:
        for node in nodes:
            node.kill()


@pytest.mark.parametrize("env, message", [
    (dict(NODE_RANK="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29548"),
     "NODE_RANK must be an integer from 0 to NNODES-1 (1), got '2'"),
    (dict(NODE_RANK="1", MASTER_ADDR="127.0.0.1"), "NNODES=2 needs MASTER_ADDR (node 0's address) and MASTER_PORT"),
])
def test_a_node_without_its_place_is_refused_in_one_line(env, message):
    """The old launcher started torchrun with a node rank past the last, or a port of its own choosing, and waited."""
    environment = {k: v for k, v in os.environ.items() if k not in ("NODE_RANK", "MASTER_ADDR", "MASTER_PORT")}
    result = subprocess.run(
        [sys.executable, "-m", "megatron_patch.training.launcher", "--task", "pretraining", "--mock-data",
         "--train-iters", "1", "--nproc-per-node", "1", "--model-name", "tiny-gpt2", "--global-batch-size", "2"],
        env={**environment, **env, "NNODES": "2", "PYTHONPATH": ROOT, "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stdout + result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith(f"rapidformer: error: {message}"), line
