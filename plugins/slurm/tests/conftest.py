"""Fixtures of the slurm plugin's tests: a fresh plugin host per test, and a real Slurm cluster.

``slurm_cluster`` (session scope) starts, in a private temporary directory, a munged on its own
socket, a slurmctld and two slurmd (nodes ``n1`` and ``n2``, both on this machine, each on its
own port), points ``SLURM_CONF`` at the private configuration, waits until both nodes are idle,
and at the end cancels every job, stops every daemon (by the pids in their pid files) and
every process still running under that configuration, and removes the directory. Slurm needs
root for slurmd; without root or without the binaries the tests that use the fixture skip.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from dlrover_core.plugins import reset_host

#: Debian/Ubuntu packages that provide what the fixture starts.
SLURM_PACKAGES = "slurm-wlm slurmctld slurmd slurm-client munge"
NODES = ("n1", "n2")
#: Seconds of silence after which slurmctld marks a node DOWN (low, for node-loss tests).
SLURMD_TIMEOUT_S = 10
#: Seconds between SIGTERM and SIGKILL when Slurm ends a job (agents save at breakpoint then).
KILL_WAIT_S = 10
_TOOLS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scancel", "sacct", "sinfo",
          "scontrol")


@pytest.fixture(autouse=True)
def _fresh_plugins(monkeypatch):
    """Each test sees a freshly loaded plugin host (plugins registered by a test vanish)."""
    monkeypatch.delenv("DLROVER_PLUGINS", raising=False)
    monkeypatch.delenv("DLROVER_DISABLE_PLUGINS", raising=False)
    reset_host()
    yield
    reset_host()


def _tool(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin")


def _free_ports(count: int) -> list[int]:
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _unavailable() -> str | None:
    """Why a Slurm cluster cannot be started here, or ``None``."""
    if os.name != "posix" or os.geteuid() != 0:
        return "a Slurm cluster needs root (slurmd runs jobs as their user); run the tests as root, as CI does"
    missing = [t for t in _TOOLS if _tool(t) is None]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} missing): "
                f"apt-get install -y --no-install-recommends {SLURM_PACKAGES}")
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return "there is no 'munge' user for munged (install the munge package)"
    return None


class SlurmCluster:
    """A private Slurm cluster on this machine: a controller and one slurmd per node name."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.hostname = socket.gethostname()
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.started: list[Path] = []  # pid files of the daemons we started

    # ----- commands ----------------------------------------------------------------------

    def run(self, *argv: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        """Run a Slurm command against this cluster."""
        return subprocess.run([_tool(argv[0]) or argv[0], *argv[1:]], env=self.env, capture_output=True, text=True,
                              check=check, timeout=timeout)

    def node_states(self) -> dict[str, str]:
        out = self.run("sinfo", "--noheader", "--Node", "--format=%N|%T", check=False).stdout
        return dict(line.split("|", 1) for line in out.split() if "|" in line)

    def wait_idle(self, timeout_s: float = 60) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            states = self.node_states()
            if all(states.get(n) == "idle" for n in NODES):
                return True
            time.sleep(0.3)
        return False

    def job_ids(self) -> list[str]:
        out = self.run("squeue", "--noheader", "--format=%i", check=False).stdout
        return out.split()

    def log_tails(self) -> str:
        parts = []
        for path in sorted(self.root.glob("*.log")) + sorted(self.root.glob("munge/*.log")):
            parts.append(f"--- {path.name}\n" + path.read_text(errors="replace")[-1500:])
        return "\n".join(parts)

    # ----- lifecycle ---------------------------------------------------------------------

    def _daemon(self, pidfile: Path, argv: list[str], *, user: str | None = None) -> None:
        if user:
            argv = ["runuser", "-u", user, "--", *argv]
        proc = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
        deadline = time.monotonic() + 15
        while not pidfile.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not pidfile.exists():
            raise RuntimeError(f"{argv[0]} wrote no pid file {pidfile}")
        self.started.append(pidfile)

    def start(self) -> None:
        root = self.root
        munge = root / "munge"
        munge.mkdir()
        for sub in ("state", "spool"):
            (root / sub).mkdir()
        key = munge / "munge.key"
        subprocess.run([_tool("mungekey"), "--create", f"--keyfile={key}"], check=True, capture_output=True)
        shutil.chown(munge, "munge", "munge")
        shutil.chown(key, "munge", "munge")
        key.chmod(0o600)
        munge.chmod(0o755)  # munged wants the socket's directory reachable by everyone
        sock = munge / "munge.socket"
        self._daemon(munge / "munged.pid", [_tool("munged"), f"--socket={sock}", f"--key-file={key}",
                                            f"--pid-file={munge / 'munged.pid'}", f"--log-file={munge / 'munged.log'}",
                                            f"--seed-file={munge / 'munged.seed'}"], user="munge")
        ctl_port, *node_ports = _free_ports(1 + len(NODES))
        host = self.hostname
        lines = [
            "ClusterName=dlrovertest",
            f"SlurmctldHost={host}(127.0.0.1)",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={sock}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"SlurmctldPort={ctl_port}",
            f"StateSaveLocation={root / 'state'}",
            f"SlurmdSpoolDir={root / 'spool'}/%n",
            f"SlurmctldPidFile={root / 'slurmctld.pid'}",
            f"SlurmdPidFile={root / 'slurmd.%n.pid'}",
            f"SlurmctldLogFile={root / 'slurmctld.log'}",
            f"SlurmdLogFile={root / 'slurmd.%n.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SwitchType=switch/none",
            "MpiDefault=none",
            "SchedulerType=sched/backfill",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "ReturnToService=2",
            f"SlurmdTimeout={SLURMD_TIMEOUT_S}",
            "InactiveLimit=0",
            f"KillWait={KILL_WAIT_S}",
            "MinJobAge=600",
            "JobCompType=jobcomp/filetxt",
            f"JobCompLoc={root / 'jobcomp.txt'}",
            "JobAcctGatherType=jobacct_gather/linux",
            "AccountingStorageType=accounting_storage/none",
            *(f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={p} CPUs=2 RealMemory=2000 State=UNKNOWN"
              for n, p in zip(NODES, node_ports, strict=True)),
            f"PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")
        self._daemon(root / "slurmctld.pid", [_tool("slurmctld")])
        for node in NODES:
            self._daemon(root / f"slurmd.{node}.pid", [_tool("slurmd"), "-N", node])
        if not self.wait_idle(60):
            raise RuntimeError(f"nodes did not become idle: {self.node_states()}")

    def _our_processes(self) -> list[psutil.Process]:
        """Processes started under this cluster's configuration (slurmstepd, job processes)."""
        found = []
        for p in psutil.process_iter():
            try:
                if p.pid != os.getpid() and p.environ().get("SLURM_CONF") == str(self.conf):
                    found.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return found

    def stop(self) -> None:
        if self.conf.exists() and (self.root / "slurmctld.pid") in self.started:
            ids = self.job_ids()
            if ids:
                self.run("scancel", *ids, check=False)
                deadline = time.monotonic() + 3 * KILL_WAIT_S
                while self.job_ids() and time.monotonic() < deadline:
                    time.sleep(0.5)
        procs = []
        for pidfile in reversed(self.started):
            try:
                procs.append(psutil.Process(int(pidfile.read_text().split()[0])))
            except (OSError, ValueError, psutil.NoSuchProcess):
                continue
        procs += self._our_processes()
        for p in procs:
            try:
                p.send_signal(signal.SIGTERM)
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(procs, timeout=10)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=5)
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="session")
def slurm_cluster():
    """A running two-node Slurm cluster, ``SLURM_CONF`` pointing at it (skips without Slurm/root)."""
    reason = _unavailable()
    if reason:
        pytest.skip(reason)
    root = Path(tempfile.mkdtemp(prefix="dlrover-slurm-"))
    root.chmod(0o755)
    cluster = SlurmCluster(root)
    try:
        try:
            cluster.start()
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            tails = cluster.log_tails()
            pytest.skip(f"the Slurm cluster could not be started here: {exc}\n{tails}")
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("SLURM_CONF", str(cluster.conf))
            yield cluster
    finally:
        cluster.stop()
