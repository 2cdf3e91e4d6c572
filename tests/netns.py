"""Several "hosts" on one machine: network namespaces joined by veth pairs on a bridge.

``Hosts(n)`` makes ``n`` namespaces ``dlr-<hex>-h0`` .. (the hosts, each with one interface
``eth0`` at ``<subnet>.<i+1>/24`` and loopback up) and a fifth one ``dlr-<hex>-sw`` (the
switch: a bridge ``br0`` with one port ``p<i>`` per host). Nothing is added to the root
namespace's interfaces, and traffic only goes to addresses inside these namespaces.
What namespaces do not separate: the filesystem (``/dev/shm`` too: a shared filesystem, on
purpose), the hostname and the pid space (pids are global; ``ip netns pids NS`` lists a
host's processes).

``hosts.popen(i, argv)`` runs ``argv`` on host ``i`` (``ip netns exec``); ``hosts.cut(i)``
and ``hosts.heal(i)`` pull and plug its cable (the switch's port down/up: both ends lose
carrier, as with a real cable); ``hosts.crash(i)`` SIGKILLs every process on it and cuts
it; ``hosts.close()`` kills what is left in every namespace and deletes them (always: the
``hosts`` fixture of tests/test_multihost.py calls it in a finalizer).

``unavailable()`` says why this machine cannot do it (not root, no ``ip``, ``ip netns add``
refused), or ``""``.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["Hosts", "free_subnet", "unavailable"]

#: The /24 the hosts get when the root namespace has no address in it (else the next free one).
DEFAULT_SUBNET = "10.77.0"


def _ip(*args: str, check: bool = True, timeout_s: float = 10) -> subprocess.CompletedProcess:
    p = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout_s)
    if check and p.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({p.returncode}): {p.stderr.strip()}")
    return p


def unavailable() -> str:
    """Why network namespaces cannot be made here ("" when they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); run as root, as .ci/run does"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed; .ci/run installs it"
    probe = f"dlr-{secrets.token_hex(3)}-probe"
    try:
        p = _ip("netns", "add", probe, check=False)
        if p.returncode != 0:
            return f"ip netns add failed: {p.stderr.strip() or p.returncode}"
        p = _ip("-n", probe, "link", "add", "a0", "type", "veth", "peer", "name", "b0", check=False)
        if p.returncode != 0:
            return f"veth pairs cannot be made in a network namespace: {p.stderr.strip() or p.returncode}"
        p = _ip("-n", probe, "link", "add", "br0", "type", "bridge", check=False)
        if p.returncode != 0:
            return f"bridges cannot be made in a network namespace: {p.stderr.strip() or p.returncode}"
        return ""
    finally:
        _ip("netns", "del", probe, check=False)


def free_subnet(preferred: str = DEFAULT_SUBNET) -> str:
    """``preferred`` (``A.B.C``) unless the root namespace has an address in it; then the
    next ``10.77.x`` it has none in."""
    used = set(re.findall(r"\b(\d+\.\d+\.\d+)\.\d+/", _ip("-br", "addr").stdout))
    if preferred not in used:
        return preferred
    for x in range(1, 255):
        if f"10.77.{x}" not in used:
            return f"10.77.{x}"
    raise RuntimeError("no free 10.77.x/24 in the root namespace")


class Hosts:
    """``n`` hosts on one switch (see the module docstring)."""

    def __init__(self, n: int = 3, *, subnet: str | None = None) -> None:
        tag = secrets.token_hex(3)
        self.switch = f"dlr-{tag}-sw"
        self.names = [f"dlr-{tag}-h{i}" for i in range(n)]
        self.subnet = subnet or free_subnet()
        self.addrs = [f"{self.subnet}.{i + 1}" for i in range(n)]
        self.interface = "eth0"
        self._made: list[str] = []
        self._procs: list[subprocess.Popen] = []
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    def _make(self) -> None:
        sw = self.switch
        _ip("netns", "add", sw)
        self._made.append(sw)
        _ip("-n", sw, "link", "set", "lo", "up")
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        for i, (ns, addr) in enumerate(zip(self.names, self.addrs, strict=True)):
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            # both ends are made inside the switch's namespace; the host's end moves to its own
            _ip("-n", sw, "link", "add", f"p{i}", "type", "veth", "peer", "name", self.interface, "netns", ns)
            _ip("-n", sw, "link", "set", f"p{i}", "master", "br0")
            _ip("-n", sw, "link", "set", f"p{i}", "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", self.interface)
            _ip("-n", ns, "link", "set", self.interface, "up")

    # ----- running things on a host ---------------------------------------------------------

    def argv(self, i: int, argv: Sequence[str | os.PathLike]) -> list[str]:
        """``argv`` as run on host ``i``."""
        return ["ip", "netns", "exec", self.names[i], *map(str, argv)]

    def run(self, i: int, argv: Sequence[str | os.PathLike], *, timeout_s: float = 30,
            **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(i, argv), capture_output=True, text=True, timeout=timeout_s, **kwargs)

    def popen(self, i: int, argv: Sequence[str | os.PathLike], *, output: Path, **kwargs) -> subprocess.Popen:
        """Start ``argv`` on host ``i`` in a session of its own, stdout and stderr to ``output``."""
        with open(output, "ab") as out:
            proc = subprocess.Popen(self.argv(i, argv), stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def pids(self, i: int) -> list[int]:
        """Every process on host ``i`` (its network namespace)."""
        out = _ip("netns", "pids", self.names[i], check=False).stdout
        return [int(p) for p in out.split()]

    def ping(self, i: int, j: int, *, timeout_s: float = 5) -> bool:
        """Whether host ``i`` reaches host ``j`` (TCP-free check: ping, or a connect attempt)."""
        if shutil.which("ping"):
            return self.run(i, ["ping", "-c", "1", "-W", "1", self.addrs[j]], timeout_s=timeout_s).returncode == 0
        code = ("import socket,sys\ns=socket.socket();s.settimeout(1)\n"
                f"sys.exit(0 if s.connect_ex(('{self.addrs[j]}', 9)) in (0, 111) else 1)")
        return self.run(i, ["python3", "-c", code], timeout_s=timeout_s).returncode == 0

    # ----- faults ---------------------------------------------------------------------------

    def cut(self, i: int) -> None:
        """Pull host ``i``'s cable: its port on the switch goes down (no packet in or out)."""
        _ip("-n", self.switch, "link", "set", f"p{i}", "down")

    def heal(self, i: int) -> None:
        """Plug it back."""
        _ip("-n", self.switch, "link", "set", f"p{i}", "up")

    def kill_all(self, i: int, sig: int = signal.SIGKILL) -> list[int]:
        """Send ``sig`` to every process on host ``i``, until none is left (for SIGKILL)."""
        killed: list[int] = []
        deadline = time.monotonic() + 10
        while True:
            pids = [p for p in self.pids(i) if p != os.getpid()]
            if not pids:
                return killed
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
                killed.append(pid)
            if sig != signal.SIGKILL or time.monotonic() > deadline:
                return killed
            time.sleep(0.05)

    def crash(self, i: int) -> list[int]:
        """Host ``i`` dies: every process on it SIGKILLed, its cable cut."""
        self.cut(i)
        return self.kill_all(i)

    # ----- cleanup --------------------------------------------------------------------------

    def close(self) -> None:
        """Kill every process left in the namespaces (and those started here), delete them."""
        for proc in self._procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        for ns in self._made:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                out = _ip("netns", "pids", ns, check=False).stdout.split()
                pids = [int(p) for p in out if int(p) != os.getpid()]
                if not pids:
                    break
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                time.sleep(0.05)
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)
        self._made = []

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
