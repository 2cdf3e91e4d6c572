"""Which CPUs a worker is bound to under ``Nodes(numa_binding=...)`` (``dlrover run
--numa-binding``): torchrun's NUMA binding, computed from sysfs without torch.

The modes and their rules are torch's (``torch/numa/binding.py``, ``AffinityMode``, torch
2.13), for the worker whose local rank is ``device`` (it uses that device, as torch assumes):

``node``
    every CPU of the device's NUMA node;
``socket``
    every CPU of every NUMA node of the device's socket (its first CPU's
    ``physical_package_id``);
``exclusive``
    the node's physical cores (hyper-thread siblings together) split evenly among the
    devices on that node, in device order; the lowest devices get one more core when they do
    not divide evenly; fewer cores than devices is an error;
``core-complex``
    one group of cores sharing the node's largest cache (the L3 of an AMD CCX), the largest
    groups first, the ``i``-th device of the node getting group ``i`` modulo their number.

In every mode only the CPUs this process may run on count (``os.sched_getaffinity(0)``, as
torch: a cpuset or ``taskset`` narrows them), and an empty set is an error. A device's NUMA
node is its PCI device's ``numa_node`` in sysfs, ``-1`` (one node) read as 0, as torch reads
it. Differences from torch: the accelerator plugin says where each device is
(:meth:`~dlrover_core.accelerators.base.Accelerator.numa_nodes`; torch asks CUDA), the binding
is applied with ``sched_setaffinity`` to the worker's process (numactl is not needed; torch
wraps the command in ``numactl --physcpubind``, which does the same), and a NUMA node with no
CPU allowed here is left out of ``socket`` (torch fails on it).

Sources: the kernel's sysfs ABI, ``Documentation/ABI/stable/sysfs-devices-node`` (``cpulist``,
``possible``), ``Documentation/ABI/testing/sysfs-devices-system-cpu`` (``topology/
thread_siblings_list``, ``physical_package_id``, ``cache/index*/{level,type,shared_cpu_list}``)
and ``Documentation/ABI/testing/sysfs-bus-pci`` (``numa_node``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from dlrover_core.errors import DeviceError
from dlrover_core.spec import NUMA_MODES

__all__ = ["NUMA_MODES", "cpu_ranges", "cpus_to_bind", "parse_cpu_ranges", "pci_numa_node"]

_OPTION = "--numa-binding (nodes.numa_binding)"


def parse_cpu_ranges(text: str) -> set[int]:
    """``"0-2,4,6-7"`` (a sysfs CPU list) → ``{0, 1, 2, 4, 6, 7}``."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def cpu_ranges(cpus: Iterable[int]) -> str:
    """``{0, 1, 2, 4, 6, 7}`` → ``"0-2,4,6-7"`` (the form of sysfs and ``numactl --physcpubind``)."""
    ordered = sorted(set(cpus))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def pci_numa_node(pci_bus_id: str, *, sysfs: str | Path = "/sys") -> int:
    """The NUMA node of a PCI device (``"00000000:18:00.0"`` as nvidia-smi gives it, or
    ``"0000:18:00.0"``): ``<sysfs>/bus/pci/devices/<address>/numa_node``; ``-1`` (a machine with
    one node) reads as 0, as torch reads it.

    Raises:
        DeviceError: the file is missing or unreadable (names the device and the option).
    """
    domain, _, rest = pci_bus_id.strip().lower().partition(":")  # domain, "bus:device.function"
    if len(domain) > 4:  # nvidia-smi writes an 8-digit domain; sysfs names have 4
        domain = domain[-4:]
    path = Path(sysfs) / "bus" / "pci" / "devices" / f"{domain}:{rest}" / "numa_node"
    try:
        return max(int(path.read_text().strip()), 0)
    except (OSError, ValueError) as exc:
        raise DeviceError(f"{_OPTION}: cannot read the NUMA node of PCI device {pci_bus_id} ({path}: {exc})") from None


class _Sysfs:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def read(self, *parts: str) -> str:
        return (self.root.joinpath(*parts)).read_text()

    def node_cpus(self, node: int) -> set[int]:
        try:
            return parse_cpu_ranges(self.read("devices", "system", "node", f"node{node}", "cpulist"))
        except OSError as exc:
            raise DeviceError(f"{_OPTION}: no CPU list for NUMA node {node} ({exc}); this machine's kernel does "
                              "not describe its NUMA nodes in sysfs") from None

    def nodes(self) -> set[int]:
        return parse_cpu_ranges(self.read("devices", "system", "node", "possible"))

    def package(self, cpu: int) -> int:
        try:
            return int(self.read("devices", "system", "cpu", f"cpu{cpu}", "topology", "physical_package_id"))
        except (OSError, ValueError) as exc:
            raise DeviceError(f"{_OPTION}: no socket known for CPU {cpu} ({exc})") from None

    def core(self, cpu: int) -> int:
        """The physical core of ``cpu``, named by its lowest hyper-thread sibling."""
        try:
            return min(parse_cpu_ranges(self.read("devices", "system", "cpu", f"cpu{cpu}", "topology",
                                                  "thread_siblings_list")))
        except (OSError, ValueError) as exc:
            raise DeviceError(f"{_OPTION}: no core topology for CPU {cpu} ({exc})") from None

    def largest_cache(self, cpu: int) -> int:
        """The group of CPUs sharing ``cpu``'s highest-level data or unified cache, named by its
        lowest CPU (torch: ``_get_logical_cpus_sharing_same_max_level_cache_as``)."""
        best_level, shared = -1, {cpu}
        cache = Path("devices", "system", "cpu", f"cpu{cpu}", "cache")
        try:
            entries = sorted(p.name for p in (self.root / cache).iterdir())
        except OSError as exc:
            raise DeviceError(f"{_OPTION}: no cache topology for CPU {cpu} ({exc})") from None
        for entry in entries:
            if not entry.startswith("index") or not entry[5:].isdecimal():
                continue
            try:
                if self.read(str(cache), entry, "type").strip() not in ("Unified", "Data"):
                    continue
                level = int(self.read(str(cache), entry, "level"))
                if level > best_level:
                    best_level = level
                    shared = parse_cpu_ranges(self.read(str(cache), entry, "shared_cpu_list"))
            except (OSError, ValueError):
                continue
        return min(shared)


def _group(cpus: Iterable[int], key: Callable[[int], int]) -> dict[int, set[int]]:
    groups: dict[int, set[int]] = {}
    for cpu in cpus:
        groups.setdefault(key(cpu), set()).add(cpu)
    return groups


def cpus_to_bind(mode: str, *, device: int, device_nodes: Sequence[int], sysfs: str | Path = "/sys",
                 allowed: set[int] | None = None) -> set[int]:
    """The CPUs the worker using device ``device`` (its local rank) is bound to under
    ``mode`` (see the module docstring).

    Args:
        mode: one of :data:`NUMA_MODES`.
        device: the device's index among ``device_nodes``.
        device_nodes: the NUMA node of each of this node's devices, in device order
            (``Accelerator.numa_nodes()``).
        sysfs: where sysfs is mounted (tests give a tree of their own).
        allowed: the CPUs this process may use (default: ``os.sched_getaffinity(0)``).

    Raises:
        DeviceError: an unknown mode, a device without one in ``device_nodes``, a topology
            sysfs does not give, or an empty result (each names the option and why).
    """
    if mode not in NUMA_MODES:
        raise DeviceError(f"{_OPTION}: unknown mode {mode!r}; one of {', '.join(NUMA_MODES)}")
    if not 0 <= device < len(device_nodes):
        raise DeviceError(f"{_OPTION}: the worker with local rank {device} has no device to bind near (this node "
                          f"has {len(device_nodes)}); use at most one worker per device with --numa-binding")
    fs = _Sysfs(sysfs)
    allowed = set(os.sched_getaffinity(0)) if allowed is None else set(allowed)
    node = device_nodes[device]
    on_node = sorted(d for d, n in enumerate(device_nodes) if n == node)
    node_cpus = fs.node_cpus(node) & allowed
    if mode == "node":
        cpus = node_cpus
    elif mode == "socket":
        if not node_cpus:
            raise DeviceError(f"{_OPTION}: NUMA node {node} (device {device}'s) has no CPU this process may use")
        socket = fs.package(min(node_cpus))
        cpus = set()
        for other in sorted(fs.nodes()):
            other_cpus = fs.node_cpus(other) & allowed
            if other_cpus and fs.package(min(other_cpus)) == socket:
                cpus |= other_cpus
    elif mode == "exclusive":
        cores = dict(sorted(_group(node_cpus, fs.core).items()))
        share, extra = divmod(len(cores), len(on_node))
        if share < 1:
            raise DeviceError(f"{_OPTION} exclusive: NUMA node {node} has {len(cores)} physical core(s) this process "
                              f"may use for its {len(on_node)} devices; use --numa-binding node (or socket) to share them")
        i = on_node.index(device)
        start = i * share + min(i, extra)
        end = start + share + (1 if i < extra else 0)
        cpus = {cpu for group in list(cores.values())[start:end] for cpu in group}
    else:  # core-complex
        caches = sorted(_group(node_cpus, fs.largest_cache).items(), key=lambda item: (-len(item[1]), item[0]))
        cpus = set(caches[on_node.index(device) % len(caches)][1]) if caches else set()
    if not cpus:
        raise DeviceError(f"{_OPTION} {mode}: no CPU this process may use near device {device} (NUMA node {node})")
    return cpus
