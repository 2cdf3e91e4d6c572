"""``dlrover run`` on each host: one agent per host joins one job, as torchrun's agents do.

Run the same command on every host (``--nnodes``, ``--rdzv-endpoint``, ``--rdzv-id``, the
script); each host's launcher (this module, in the ``dlrover run`` process; it imports no
torch) starts one elastic agent for its host. The job master runs where the rendezvous
endpoint is: the launcher on the endpoint's host that binds its port first starts it there
(as torchrun's c10d backend hosts its store in the first agent that reaches the endpoint) and
passes it the bound socket, so two launchers never both host; every other launcher's agent
finds the master at the endpoint. ``dlrover master`` can also be started there by hand.

The launcher supervises what it started:

* its agent: when the agent process exits without being told to stop (killed, crashed),
  the launcher tells the master at once (a ``node_lost`` :class:`FailureReport`, so the
  other hosts go on without waiting ``Failure.heartbeat_timeout_s``) and starts it again
  (the same node id: :class:`AssignNode` is idempotent per launcher), up to
  ``MAX_AGENT_RESTARTS`` times;
* the master, on its host: a master process that dies before the job ends is started
  again on the same socket and resumes from its journal.

* a host cut off from the master: its agent stops its workers once no heartbeat got
  through for ``Failure.heartbeat_timeout_s`` (the master has declared the node lost by then,
  and the others went on); if the master answers again within as long, the launcher starts
  the agent again and the node rejoins the running job with the others' live state.

What it cannot survive: the loss of the host that runs the master (the master and the
round's store are there; there is no second master). The other hosts' launchers then exit
1 naming the unreachable endpoint, after twice ``Failure.heartbeat_timeout_s`` (the agent's
wait, then the launcher's); rerun the job (same ``--rdzv-id``, same checkpoint directory)
to resume from its last checkpoint.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import attrs
import psutil

from dlrover_core import env
from dlrover_core.agent import __main__ as agent_main
from dlrover_core.errors import DLRoverError, JobSpecError
from dlrover_core.fileio import write_atomic
from dlrover_core.logging import get_logger, json_mode, write_record
from dlrover_core.master import __main__ as master_main
from dlrover_core.plugins import get_host
from dlrover_core.protocol.client import MasterClient
from dlrover_core.protocol.messages import AssignNode, FailureReport, WorkerFailure
from dlrover_core.protocol.result import JobResult
from dlrover_core.retry import rpc_retrying
from dlrover_core.scheduler_backend import new_job_id
from dlrover_core.spec import JobSpec

__all__ = ["DEFAULT_RDZV_PORT", "MAX_AGENT_RESTARTS", "HostPlan", "is_local_address", "parse_endpoint", "run_host"]

log = get_logger()

#: torchrun's default port of ``--rdzv-endpoint`` (``torch.distributed.run``).
DEFAULT_RDZV_PORT = 29400
#: How often a launcher starts its host's agent again after it died (killed, crashed).
MAX_AGENT_RESTARTS = 3
#: How often the master's host restarts a master process that died before the job ended.
_MASTER_RESTARTS = 3
#: Exit codes of ``python -m dlrover_core.agent`` (see ``ElasticAgent.run``).
_AGENT_DONE, _AGENT_MASTER_GONE, _AGENT_FENCED = 0, 1, 3
#: Seconds the launcher waits for the master to write its result after the agent stopped.
_RESULT_WAIT_S = 30.0
#: Listen backlog of the endpoint's socket (agents of every host connect at once).
_BACKLOG = 4096


def parse_endpoint(endpoint: str, *, default_port: int = DEFAULT_RDZV_PORT) -> tuple[str, int]:
    """``host[:port]`` (``[v6]:port`` for IPv6) → ``(host, port)``, as torchrun reads
    ``--rdzv-endpoint``.

    Raises:
        JobSpecError: an empty host or a port that is not an integer in 0..65535.
    """
    text = endpoint.strip()
    host, port_text = text, ""
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_text = rest.removeprefix(":")
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
    try:
        port = int(port_text) if port_text else default_port
    except ValueError:
        port = -1
    if not host or not 0 <= port <= 65535:
        raise JobSpecError("--rdzv-endpoint", endpoint, "HOST or HOST:PORT (e.g. node0:29400), the address of "
                                                       "the host that runs the job master")
    return host, port


def _addresses(host: str) -> set[str]:
    try:
        return {info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except socket.gaierror:
        return set()


def is_local_address(host: str) -> bool:
    """Whether ``host`` (a name or an address) names this machine: a loopback address, or an
    address of one of its network interfaces (as torch's c10d rendezvous decides whether
    to host the store)."""
    local = {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs
             if a.family in (socket.AF_INET, socket.AF_INET6)}
    for address in _addresses(host):
        with contextlib.suppress(ValueError):
            if ipaddress.ip_address(address).is_loopback:
                return True
        if address in local:
            return True
    return False


def claim_endpoint(host: str, port: int) -> socket.socket | None:
    """Bind and listen on the endpoint if it is on this machine and free: the socket the
    master will serve on (``None``: another process has it, or it is not this machine's).
    A socket bound first wins: two launchers never both host the master."""
    if not is_local_address(host):
        return None
    addresses = sorted(_addresses(host))
    family = socket.AF_INET6 if addresses and ":" in addresses[0] else socket.AF_INET
    bind_host = "::" if family == socket.AF_INET6 else "0.0.0.0"  # reachable at every address, as torch's store
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((bind_host, port))
        sock.listen(_BACKLOG)
    except OSError as exc:
        sock.close()
        if exc.errno in (errno.EADDRINUSE, errno.EACCES):
            return None
        raise
    sock.set_inheritable(True)
    return sock


@attrs.frozen(kw_only=True)
class HostPlan:
    """What one host's ``dlrover run`` does.

    Attributes:
        job: the job as this host's flags describe it (its script, arguments and workers
            per node; ``nodes`` and the failure policy count where the master runs).
        endpoint: ``host:port`` of the job master (``--rdzv-endpoint``).
        rdzv_id: the job id every host gives (``--rdzv-id``; ``""``: the master names it).
        node_rank: this host's node id (``--node-rank``); ``None``: the master assigns one.
        standalone: the endpoint is this host's, on a free port (``--standalone``, or one
            node without an endpoint).
        log_dir: the directory under which the job's logs go (``<log_dir>/<job id>/``).
    """

    job: JobSpec
    endpoint: str
    rdzv_id: str = ""
    node_rank: int | None = None
    standalone: bool = False
    log_dir: str = "dlrover-runs"


def _set_process_name(name: str) -> None:
    """The process's short name (``ps -o comm``, ``psutil.Process.name()``; Linux only)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


class _Child:
    """One of the core's entry points (``main(argv)`` of the agent or the master) run in a
    forked child of this launcher, with ``subprocess.Popen``'s ``poll``/``wait``/``send_signal``.

    Forking a launcher that imported those modules and loaded the plugins already starts the
    child with no interpreter start, no import and no plugin discovery of its own (about a
    second of CPU per process on a small machine), which is most of what ``dlrover run``
    would add to torchrun's start. The launcher has no thread when it forks (checked)."""

    def __init__(self, name: str, main: Callable[[list[str]], int | None], argv: list[str], *,
                 environ: dict[str, str], output: Path | None = None, close: tuple[int, ...] = (),
                 signals: tuple[int, ...] = ()) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            code = 1
            try:
                os.setsid()
                _set_process_name(name)
                for signum in signals:  # the launcher's handlers are not the child's
                    signal.signal(signum, signal.SIG_DFL)
                for fd in close:
                    os.close(fd)
                null = os.open(os.devnull, os.O_RDONLY)
                os.dup2(null, 0)
                os.close(null)
                if output is not None:
                    out = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                    os.dup2(out, 1)
                    os.dup2(out, 2)
                    os.close(out)
                os.environ.clear()
                os.environ.update(environ)
                code = main(argv) or 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except BaseException:  # noqa: BLE001 - reported, then the child exits
                traceback.print_exc()
            finally:
                with contextlib.suppress(Exception):
                    sys.stdout.flush()
                    sys.stderr.flush()
                os._exit(code)
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            with contextlib.suppress(ChildProcessError):
                done, status = os.waitpid(self.pid, os.WNOHANG)
                if done:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Launcher:
    def __init__(self, plan: HostPlan, signals: tuple[int, ...], preflight: Callable[[], object] | None) -> None:
        self.plan = plan
        self.signals = signals
        self.preflight = preflight
        self.host, self.port = parse_endpoint(plan.endpoint)
        self.key = f"{socket.gethostname()}:{os.getpid()}"
        self.sock: socket.socket | None = None
        self.master: _Child | None = None
        self.master_restarts = 0
        self.agent: _Child | None = None
        self.agent_restarts = 0
        self.job_id = plan.rdzv_id
        self.run_dir: Path | None = None
        self._stop_signal: int | None = None
        self._scratch = tempfile.TemporaryDirectory(prefix="dlrover-run-")
        self.result_file = Path(self._scratch.name) / "result.json"

    # ----- processes -------------------------------------------------------------------

    def _base_env(self) -> dict[str, str]:
        variables = {**os.environ, "PYTHONUNBUFFERED": "1", env.WATCH_PID: str(os.getpid()),
                     env.JOB_SPEC: json.dumps(self.plan.job.to_dict(), separators=(",", ":")),
                     env.MASTER_ADDR: self.endpoint}
        variables.pop(env.MASTER_ADDR_FILE, None)
        return variables

    @property
    def endpoint(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def _start_master(self) -> None:
        assert self.sock is not None and self.run_dir is not None
        argv = ["--job-id", self.job_id, "--listen-fd", str(self.sock.fileno()), "--port", str(self.port),
                "--store-host", self.host, "--log-dir", str(self.run_dir), "--relaunch-by-launchers"]
        self.master = _Child("dlrover-master", master_main.main, argv, environ=self._base_env(),
                             output=self.run_dir / "master.log", signals=self.signals)
        log.debug("master_started_by_launcher", pid=self.master.pid, endpoint=self.endpoint)

    def _start_agent(self) -> None:
        argv = ["--master-addr", self.endpoint, "--log-root", self.plan.log_dir, "--result-file",
                str(self.result_file)]
        if self.plan.node_rank is not None:
            argv += ["--node-id", str(self.plan.node_rank)]
        else:
            argv += ["--node-key", self.key]
        if self.job_id:
            argv += ["--job-id", self.job_id]
        # the agent and its workers write to this terminal, as torchrun's do
        self.agent = _Child("dlrover-agent", agent_main.main, argv, environ=self._base_env(),
                            close=() if self.sock is None else (self.sock.fileno(),), signals=self.signals)

    # ----- the master's result ----------------------------------------------------------

    def _client(self) -> MasterClient:
        return MasterClient(self.endpoint, timeout_s=2.0, retrying=lambda: rpc_retrying(attempts=2), addr_file="")

    def _report_agent_lost(self, pid: int, code: int) -> None:
        """Tell the master this host's agent exited (evidence: no heartbeat timeout)."""
        client = self._client()
        try:
            assigned = (self.plan.node_rank if self.plan.node_rank is not None
                        else client.assign_node(AssignNode(key=self.key, rdzv_id=self.plan.rdzv_id)).node_id)
            if assigned is None or assigned < 0:
                return
            how = f"signal {-code}" if code < 0 else f"exit code {code}"
            client.failure(FailureReport(node_id=assigned, round=-1, failures=(WorkerFailure(
                kind="node_lost", detail=f"its agent process (pid {pid}) exited ({how}), seen by its host's launcher"),)))
            log.warning("agent_lost_reported", node_id=assigned, pid=pid, exit_code=code)
        except (DLRoverError, ValueError) as exc:
            log.warning("agent_lost_not_reported", pid=pid, error=str(exc))
        finally:
            client.close()

    def _job_over(self) -> bool | None:
        """Whether the master says the job ended (``None``: it does not answer)."""
        client = self._client()
        try:
            return client.status().state.is_terminal
        except (DLRoverError, ValueError):
            return None
        finally:
            client.close()

    def _result(self) -> JobResult | None:
        if self.master is not None and self.run_dir is not None:  # this host's master writes it at its end
            deadline = time.monotonic() + _RESULT_WAIT_S
            while self.master.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            path = self.run_dir / "result.json"
            if path.exists():
                with contextlib.suppress(ValueError, OSError):
                    return JobResult.from_dict(json.loads(path.read_text()))
            return None
        with contextlib.suppress(ValueError, OSError):  # what this host's agent kept at its end
            return JobResult.from_dict(json.loads(self.result_file.read_text()))
        return None

    # ----- the run --------------------------------------------------------------------------

    def _signal(self, signum: int, _frame: object) -> None:
        self._stop_signal = signum
        for proc in (self.agent, self.master):
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signum)

    def run(self) -> int:
        plan = self.plan
        # the plugins, loaded once before the agent and the master are forked (see _Child)
        get_host()
        if self.preflight is not None:
            self.preflight()
        if threading.active_count() > 1:  # pragma: no cover - a fork would copy a lock held by a thread
            raise DLRoverError("dlrover run cannot start its agent: a thread runs in the launcher")
        self.sock = claim_endpoint(self.host, self.port)
        if self.sock is not None:
            self.job_id = self.job_id or new_job_id(plan.job.name)
            self.run_dir = Path(plan.log_dir) / self.job_id
            self.run_dir.mkdir(parents=True, exist_ok=True)
            journal = self.run_dir / "master_journal.json"
            if journal.exists():  # a master of an earlier run with this id crashed: start afresh
                journal.rename(journal.with_suffix(f".{int(time.time())}.old"))
            self._start_master()
            self._write_handle()
            log.info("hosting_job_master", job_id=self.job_id, endpoint=self.endpoint)
        elif plan.standalone:
            raise DLRoverError(f"--standalone could not listen on {self.endpoint}")
        self._start_agent()
        for signum in self.signals:
            signal.signal(signum, self._signal)
        try:
            code = self._supervise()
        finally:
            for proc in (self.agent, self.master):
                if proc is not None and proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        proc.terminate()
                    try:
                        proc.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        proc.kill()
            if self.sock is not None:
                self.sock.close()
            self._scratch.cleanup()
        return code

    def _write_handle(self) -> None:
        """``job.json`` and ``handle.json`` in the run directory, so ``dlrover status|logs|cancel
        JOB_ID`` find this job (the local scheduler's format: the master and this host's agent)."""
        assert self.run_dir is not None and self.master is not None
        write_atomic(self.run_dir / "job.json", json.dumps({
            "scheduler": "local", "job_id": self.job_id, "log_dir": str(self.run_dir),
            "native_id": str(self.master.pid)}, indent=2))
        write_atomic(self.run_dir / "handle.json", json.dumps({
            "job_id": self.job_id, "master_addr": self.endpoint, "master_pid": self.master.pid, "agents": {},
            "processes": [], "launcher_pid": os.getpid()}, indent=2))

    def _supervise(self) -> int:
        assert self.agent is not None
        while True:
            time.sleep(0.05)
            if self.master is not None and self.master.poll() is not None and self.agent.poll() is None:
                self._master_died()
            code = self.agent.poll()
            if code is None:
                continue
            if self._stop_signal is not None:
                return 128 + self._stop_signal
            if code == _AGENT_DONE:
                return self._finish()
            if code == _AGENT_FENCED:
                log.error("agent_replaced", reason="the master replaced this host's agent (it was silent past "
                                                   "failure.heartbeat_timeout_s)")
                return 1
            if code == _AGENT_MASTER_GONE:
                if not self._master_answers_again():
                    log.error("job_master_unreachable", endpoint=self.endpoint,
                              reason="the job master did not answer for twice failure.heartbeat_timeout_s (its host "
                                     "is down, or this one cut off); rerun with the same --rdzv-id to resume from the "
                                     "last checkpoint")
                    return 1
            else:  # killed, crashed: tell the master now (it has heard nothing of it yet)
                self._report_agent_lost(self.agent.pid, code)
            if self.agent_restarts >= MAX_AGENT_RESTARTS or self._job_over() is not False:
                log.error("agent_died", exit_code=code, restarts=self.agent_restarts)
                return 1
            self.agent_restarts += 1
            log.warning("agent_restarting", exit_code=code, restart=self.agent_restarts, of=MAX_AGENT_RESTARTS)
            self._start_agent()

    def _master_answers_again(self) -> bool:
        """After this host's agent gave up on the master (``failure.heartbeat_timeout_s``
        without a heartbeat through): whether the master answers again within as long
        (this host was cut off and is back: its agent is started again and the node rejoins)."""
        deadline = time.monotonic() + self.plan.job.heartbeat_timeout_s
        while time.monotonic() < deadline and self._stop_signal is None:
            if self._job_over() is False:
                log.warning("job_master_back", endpoint=self.endpoint)
                return True
            time.sleep(0.5)
        return False

    def _master_died(self) -> None:
        assert self.master is not None and self.run_dir is not None
        if (self.run_dir / "result.json").exists():
            return  # it ended the job (its agents are stopping)
        if self.master_restarts >= _MASTER_RESTARTS:
            return
        self.master_restarts += 1
        log.warning("job_master_died", exit_code=self.master.returncode, restart=self.master_restarts,
                    of=_MASTER_RESTARTS)
        time.sleep(min(4.0, 0.5 * 2 ** self.master_restarts))
        self._start_master()
        self._write_handle()

    def _finish(self) -> int:
        result = self._result()
        if result is None:
            log.error("job_result_unknown", reason="the job master did not say how the job ended (see its log on "
                                                    f"the host of {self.endpoint})")
            return 1
        if json_mode():  # JSON Lines: the result is one object (every host has the whole of it)
            write_record(result.to_record())
        elif self.master is not None:
            print(result.summary(), flush=True)
        else:
            print(f"job {result.job_id}: {result.state.value}" + (f" ({result.reason})" if result.reason else "")
                  + f"; the summary is on the job master's host ({self.endpoint})", flush=True)
        return 0 if result.state.value == "SUCCEEDED" else 1


def run_host(plan: HostPlan, *, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT),
             preflight: Callable[[], object] | None = None) -> int:
    """Run this host's part of the job (see the module docstring); return the exit code:
    0 when the job succeeded, 1 when it failed or this host could not take part, 128+N
    after signal N.

    Args:
        plan: what to run and where the job master is.
        signals: the signals forwarded to the agent (and the master, on its host), which
            stop the workers gracefully (torchrun's ``--signals-to-handle``).
        preflight: checks of the job (validation, a test write of its storage), run before
            anything starts; what it raises is raised.
    """
    return _Launcher(plan, signals, preflight).run()
