"""Where a worker runs: ``dlrover run --numa-binding`` (``Nodes.numa_binding``) binds it to the
CPUs near its device, ``--virtual-local-rank`` (``Nodes.virtual_local_rank``) shows it
``LOCAL_RANK=0`` and only its own device, both with torchrun's meaning.

The CPU sets follow torch's rules (``torch/numa/binding.py``): checked against torch's own code
on made-up machines (a sysfs tree of the test's), and on real workers by their observable
effect (their CPU affinity, ``os.sched_getaffinity``) through an accelerator plugin whose
devices sit on this machine's NUMA node 0 (this machine has no GPU).
"""

from __future__ import annotations

import builtins
import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers import install_dist, job_processes

from dlrover_core import DeviceError, Job, JobSpecError, Nodes
from dlrover_core.accelerators.cpu import CpuAccelerator
from dlrover_core.accelerators.numa import cpu_ranges, cpus_to_bind, parse_cpu_ranges, pci_numa_node
from dlrover_core.agent.launch import placement_env
from dlrover_core.cli import main

# ----- a made-up machine ---------------------------------------------------------------------


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def machine(root: Path, *, nodes: dict[int, set[int]], sockets: dict[int, int], siblings: list[set[int]],
            l3: list[set[int]]) -> Path:
    """A sysfs tree: NUMA ``nodes`` (node -> CPUs), the socket of each node's CPUs, hyper-thread
    ``siblings`` (one set per physical core) and ``l3`` groups (CPUs sharing a last-level cache)."""
    _write(root / "devices/system/node/possible", cpu_ranges(nodes))
    for node, cpus in nodes.items():
        _write(root / f"devices/system/node/node{node}/cpulist", cpu_ranges(cpus))
        for cpu in cpus:
            base = root / f"devices/system/cpu/cpu{cpu}"
            _write(base / "topology/physical_package_id", str(sockets[node]))
            _write(base / "topology/thread_siblings_list", cpu_ranges(next(s for s in siblings if cpu in s)))
            for index, (level, kind, shared) in enumerate([(1, "Data", {cpu}), (1, "Instruction", {cpu}),
                                                           (2, "Unified", next(s for s in siblings if cpu in s)),
                                                           (3, "Unified", next(g for g in l3 if cpu in g))]):
                _write(base / f"cache/index{index}/level", str(level))
                _write(base / f"cache/index{index}/type", kind)
                _write(base / f"cache/index{index}/shared_cpu_list", cpu_ranges(shared))
    return root


def two_socket_machine(root: Path) -> Path:
    """2 sockets x 2 NUMA nodes; node n has 5 physical cores with 2 threads each (CPU c and
    c + 20); the L3 of each node is split 3 cores + 2 cores."""
    nodes, siblings, l3 = {}, [], []
    for node in range(4):
        cores = range(node * 5, node * 5 + 5)
        nodes[node] = {c for c in cores} | {c + 20 for c in cores}
        siblings += [{c, c + 20} for c in cores]
        l3 += [{c for c in cores[:3]} | {c + 20 for c in cores[:3]}, {c for c in cores[3:]} | {c + 20 for c in cores[3:]}]
    return machine(root, nodes=nodes, sockets={0: 0, 1: 0, 2: 1, 3: 1}, siblings=siblings, l3=l3)


def _torch_binding(root: Path, device_nodes: tuple[int, ...], allowed: set[int], monkeypatch):
    """torch's own ``_get_logical_cpus_to_bind_to``, reading the made-up machine's sysfs, with
    ``device_nodes`` for the GPUs' NUMA nodes and ``allowed`` for this thread's CPUs."""
    binding = pytest.importorskip("torch.numa.binding")

    def _open(path, *args, **kwargs):
        return builtins.open(str(root) + str(path).removeprefix("/sys"), *args, **kwargs)

    fake_os = types.SimpleNamespace(listdir=lambda p: os.listdir(str(root) + str(p).removeprefix("/sys")),
                                    path=os.path)
    monkeypatch.setattr(binding, "open", _open, raising=False)
    monkeypatch.setattr(binding, "os", fake_os)
    monkeypatch.setattr(binding, "_get_numa_node_index_for_gpu_index", lambda *, gpu_index: device_nodes[gpu_index])
    monkeypatch.setattr(binding, "_get_gpu_count", lambda: len(device_nodes))
    monkeypatch.setattr(binding, "_get_allowed_cpu_indices_for_current_thread", lambda: set(allowed))

    def cpus(mode: str, device: int) -> set[int]:
        return binding._get_logical_cpus_to_bind_to(
            gpu_index=device, numa_options=binding.NumaOptions(affinity_mode=binding.AffinityMode(mode)))

    return cpus


ALL_CPUS = set(range(40))


@pytest.mark.parametrize("mode", ["node", "socket", "exclusive", "core-complex"])
@pytest.mark.parametrize("device_nodes, allowed", [
    ((0, 0, 1, 1, 2, 2, 3, 3), ALL_CPUS),      # 8 GPUs, 2 per NUMA node
    ((0, 0, 0, 1), ALL_CPUS),                  # 3 on one node: 5 cores split 2+2+1, L3 groups shared round robin
    ((1, 3), set(range(20))),                  # a cpuset without the hyper-threads
], ids=["8-gpus", "3-on-a-node", "cpuset"])
def test_every_mode_binds_each_device_to_the_cpus_torch_binds_it_to(tmp_path, monkeypatch, mode, device_nodes, allowed):
    root = two_socket_machine(tmp_path / "sys")
    torch_cpus = _torch_binding(root, device_nodes, allowed, monkeypatch)
    for device in range(len(device_nodes)):
        ours = cpus_to_bind(mode, device=device, device_nodes=device_nodes, sysfs=root, allowed=allowed)
        assert ours == torch_cpus(mode, device), (mode, device)


def test_socket_leaves_out_a_node_with_no_cpu_allowed_where_torch_fails(tmp_path, monkeypatch):
    root = two_socket_machine(tmp_path / "sys")
    allowed = set(range(5, 10))  # node 1's physical cores only: node 0, on the same socket, has none
    assert cpus_to_bind("socket", device=0, device_nodes=(1,), sysfs=root, allowed=allowed) == allowed
    with pytest.raises(ValueError, match="empty"):
        _torch_binding(root, (1,), allowed, monkeypatch)("socket", 0)


def test_exclusive_gives_the_lowest_devices_the_extra_cores_and_never_shares_one(tmp_path):
    root = two_socket_machine(tmp_path / "sys")
    sets = [cpus_to_bind("exclusive", device=d, device_nodes=(0, 0, 0), sysfs=root, allowed=ALL_CPUS)
            for d in range(3)]
    assert [cpu_ranges(s) for s in sets] == ["0-1,20-21", "2-3,22-23", "4,24"]
    with pytest.raises(DeviceError, match=r"--numa-binding.*exclusive.*5 physical core\(s\).*6 devices"):
        cpus_to_bind("exclusive", device=0, device_nodes=(0,) * 6, sysfs=root, allowed=ALL_CPUS)


def test_a_binding_that_cannot_apply_names_the_option_and_why(tmp_path):
    root = two_socket_machine(tmp_path / "sys")
    with pytest.raises(DeviceError, match=r"--numa-binding.*local rank 2 has no device"):
        cpus_to_bind("node", device=2, device_nodes=(0, 1), sysfs=root, allowed=ALL_CPUS)
    with pytest.raises(DeviceError, match=r"--numa-binding.*node.*no CPU this process may use"):
        cpus_to_bind("node", device=0, device_nodes=(0,), sysfs=root, allowed={10, 11})
    with pytest.raises(DeviceError, match=r"--numa-binding.*no CPU list for NUMA node 7"):
        cpus_to_bind("node", device=0, device_nodes=(7,), sysfs=root, allowed=ALL_CPUS)
    with pytest.raises(DeviceError, match=r"--numa-binding.*cpu accelerator has no device with a NUMA node"):
        CpuAccelerator().numa_nodes()


def test_a_pci_devices_numa_node_is_read_as_torch_reads_it(tmp_path):
    _write(tmp_path / "bus/pci/devices/0000:18:00.0/numa_node", "1")
    _write(tmp_path / "bus/pci/devices/0000:3b:00.0/numa_node", "-1")  # a machine with one node
    assert pci_numa_node("00000000:18:00.0", sysfs=tmp_path) == 1  # nvidia-smi's 8-digit domain
    assert pci_numa_node("0000:3B:00.0", sysfs=tmp_path) == 0
    with pytest.raises(DeviceError, match="--numa-binding.*PCI device 0000:99:00.0"):
        pci_numa_node("0000:99:00.0", sysfs=tmp_path)
    assert parse_cpu_ranges("0-2,4,6-7\n") == {0, 1, 2, 4, 6, 7} and cpu_ranges({7, 6, 4, 0, 1, 2}) == "0-2,4,6-7"


# ----- the worker's environment --------------------------------------------------------------


class _Gpus(CpuAccelerator):
    name = "gpus"
    visible_devices_env = "GPUS_VISIBLE_DEVICES"


def test_a_virtual_local_rank_is_0_with_only_the_workers_own_device_visible():
    job = Job(name="v", entrypoint="t.py", nodes=Nodes(nproc_per_node=2, virtual_local_rank=True))
    assert placement_env(job, 1, _Gpus(), environ={}) == {
        "LOCAL_RANK": "0", "GPUS_VISIBLE_DEVICES": "1", "DLROVER_LOCAL_RANK": "1"}
    assert placement_env(job, 1, _Gpus(), environ={"GPUS_VISIBLE_DEVICES": "4, 6"})["GPUS_VISIBLE_DEVICES"] == "6"
    with pytest.raises(DeviceError, match=r"--virtual-local-rank.*local rank 1 has no device.*lists 1"):
        placement_env(job, 1, _Gpus(), environ={"GPUS_VISIBLE_DEVICES": "4"})
    # cpu has no visibility variable: only LOCAL_RANK changes (torchrun sets CUDA_VISIBLE_DEVICES anyway)
    assert placement_env(job, 1, CpuAccelerator(), environ={}) == {"LOCAL_RANK": "0", "DLROVER_LOCAL_RANK": "1"}
    plain = Job(name="v", entrypoint="t.py", nodes=Nodes(nproc_per_node=2))
    assert placement_env(plain, 1, _Gpus(), environ={}) == {"DLROVER_LOCAL_RANK": "1"}


def test_the_spec_refuses_what_cannot_work_naming_the_field_and_the_fix():
    with pytest.raises(JobSpecError, match=r"nodes.numa_binding='nodes'.*'node', 'socket', 'exclusive', 'core-complex'"):
        Nodes(numa_binding="nodes")


def test_numa_binding_without_devices_is_refused_before_anything_starts(tmp_path, monkeypatch):
    """As torchrun, which fails where there is no GPU: one line naming --numa-binding, exit 1,
    no run directory; Job.run() on this machine's devices is refused the same way."""
    monkeypatch.chdir(tmp_path)
    Path("train.py").write_text("print('never runs')\n")
    result = CliRunner().invoke(main, ["run", "--accelerator", "cpu", "--numa-binding", "node", "--log-dir", "runs",
                                       "--rdzv-id", "nonuma", "train.py"])
    assert result.exit_code == 1, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "--numa-binding" in errors[0] and "no device with a NUMA node" in errors[0], result.output
    assert not (tmp_path / "runs" / "nonuma").exists()
    job = Job(name="nonuma", entrypoint="train.py", accelerator="cpu", nodes=Nodes(numa_binding="socket"),
              log_dir=str(tmp_path / "runs"))
    with pytest.raises(DeviceError, match="--numa-binding"):
        job.submit()
    assert list((tmp_path / "runs").iterdir()) == []  # (the log directory itself: made by dlrover run)
    bad = CliRunner().invoke(main, ["run", "--numa-binding", "nodes", "train.py"])
    assert bad.exit_code == 2 and "'nodes' is not one of 'node', 'socket', 'exclusive', 'core-complex'" in bad.output


# ----- real workers ----------------------------------------------------------------------------

#: An accelerator plugin whose devices (as many as NEARGPU_COUNT, default 2) all sit on NUMA
#: node 0 of this machine: the binding is real, only the devices are made up.
NEAR_GPU_PLUGIN = """
    import os

    from dlrover_core import hookimpl
    from dlrover_core.backend import DeviceReport
    from dlrover_core.accelerators.cpu import CpuAccelerator

    class NearGpu(CpuAccelerator):
        name = "neargpu"
        priority = -1
        visible_devices_env = "NEARGPU_VISIBLE_DEVICES"

        def _count(self):
            return int(os.environ.get("NEARGPU_COUNT", "2"))

        def probe(self):
            return DeviceReport(accelerator=self.name, present=True, count=self._count(), healthy=(True,) * self._count())

        def numa_nodes(self):
            return (0,) * self._count()

    @hookimpl
    def dlrover_register_accelerators(register):
        register(NearGpu)
"""

#: What a worker writes: where it runs and what it sees.
WHERE_AM_I = """
    import json, os
    rank = os.environ["RANK"]
    with open(f"where_{rank}.json", "w") as f:
        json.dump({"cpus": sorted(os.sched_getaffinity(0)), "local_rank": os.environ["LOCAL_RANK"],
                   "dlrover_local_rank": os.environ["DLROVER_LOCAL_RANK"],
                   "visible": os.environ.get("NEARGPU_VISIBLE_DEVICES"),
                   "affinity": os.environ.get("DLROVER_CPU_AFFINITY")}, f)
"""


@pytest.mark.skipif(not Path("/sys/devices/system/node/node0/cpulist").exists() or not hasattr(os, "sched_getaffinity"),
                    reason="needs Linux with NUMA node 0 in sysfs")
@pytest.mark.timeout(120)
def test_each_real_worker_runs_on_the_cpus_near_its_device_and_sees_only_that_device(tmp_path):
    """Two workers on two (made-up) devices of NUMA node 0, ``--numa-binding exclusive
    --virtual-local-rank``: each worker's CPU affinity is its share of node 0's cores (the
    node's CPUs with ``node`` where it has one core only), both see ``LOCAL_RANK=0``, and each
    sees its own device in the accelerator's visibility variable."""
    site = tmp_path / "site"
    site.mkdir()
    install_dist(site, "dlrover-plugin-neargpu", "dlrover_plugin_neargpu", textwrap.dedent(NEAR_GPU_PLUGIN))
    (tmp_path / "where.py").write_text(textwrap.dedent(WHERE_AM_I))
    allowed = os.sched_getaffinity(0)
    try:
        mode, expected = "exclusive", [cpus_to_bind("exclusive", device=d, device_nodes=(0, 0), allowed=allowed)
                                       for d in range(2)]
    except DeviceError:  # node 0 has a single core here: both share it
        mode, expected = "node", [cpus_to_bind("node", device=d, device_nodes=(0, 0), allowed=allowed) for d in range(2)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
           "NEARGPU_VISIBLE_DEVICES": "5,7"}
    done = subprocess.run([sys.executable, "-m", "dlrover_core.cli", "run", "--accelerator", "neargpu",
                           "--nproc-per-node", "2", "--numa-binding", mode, "--virtual-local-rank", "--log-dir", "runs",
                           "--rdzv-id", "near", "where.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=100)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    seen = [json.loads((tmp_path / f"where_{rank}.json").read_text()) for rank in range(2)]
    assert [set(s["cpus"]) for s in seen] == expected
    assert [s["affinity"] for s in seen] == [cpu_ranges(cpus) for cpus in expected]
    if mode == "exclusive":
        assert not expected[0] & expected[1]
    assert [(s["local_rank"], s["dlrover_local_rank"], s["visible"]) for s in seen] == [("0", "0", "5"), ("0", "1", "7")]
    assert job_processes("near") == []


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs sched_setaffinity (Linux)")
@pytest.mark.timeout(60)
def test_a_warm_standby_binds_every_thread_when_it_becomes_the_worker():
    """A standby is already running when it is handed a worker's environment: it binds all
    its threads then (as torch binds a worker that is a function), not only the main one."""
    cpu = min(os.sched_getaffinity(0))
    code = textwrap.dedent(f"""
        import os, threading, time
        from dlrover_core.agent.standby import _bind_cpus
        started, stop = threading.Event(), threading.Event()
        t = threading.Thread(target=lambda: (started.set(), stop.wait()))
        t.start(); started.wait()
        os.environ["DLROVER_CPU_AFFINITY"] = "{cpu}"
        _bind_cpus()
        print(sorted(os.sched_getaffinity(0)), sorted(os.sched_getaffinity(t.native_id)))
        stop.set()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert out.stdout.split("\n")[0] == f"[{cpu}] [{cpu}]", out.stdout + out.stderr
