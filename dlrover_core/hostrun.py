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

* a host that died with its launcher is awaited by the master; ``dlrover run`` started on
  a new host stands in for it (:meth:`~dlrover_core.master.fleet.Fleet.assign`: the lost
  node's id, its ranks and, sharded, their shards from the buddy's replicas);
* a host cut off from the master: its agent stops its workers once no heartbeat got
  through for ``Failure.heartbeat_timeout_s`` (the master has declared the node lost by then,
  and the others went on); if the master answers again within as long, the launcher starts
  the agent again and the node rejoins the running job with the others' live state.

Stop signals and the outcome: ``dlrover run`` keeps its stop signals (SIGINT, SIGTERM,
torchrun's ``--signals-to-handle``) from its first instruction (:mod:`dlrover_core.stoplatch`)
and acts on them between its steps: one that comes before the agent and the master are
started starts neither; a later one is forwarded to both, and again every
``_FORWARD_AGAIN_S`` while they run (each ignores it until its own handlers are installed,
rather than dying of it). On the master's host the launcher owns the job's outcome: the
master writes ``result.json`` at its end; where it could not (a stop signal came before it
started, or it was stopped or died first), the launcher writes one, CANCELLED after a stop
signal (the reason names the signal) and FAILED otherwise, so ``dlrover status`` reports the
job's end instead of a master that does not answer. The result's summary is printed at the
end, after a stop signal too, and the exit code is :func:`~dlrover_core.display.exit_code`'s:
0 succeeded, 1 failed, 128+N stopped by signal N (130 for Ctrl-C, 143 for SIGTERM).

Progress: the master's host shows the job's progress line, the one ``Job.run()`` shows
(:class:`~dlrover_core.display.ProgressDisplay`), live on a terminal (the agent's and its
workers' output then passes through the launcher, which prints it above the line), as plain
lines when asked (``--progress``), never in JSON mode unless asked.

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
import fcntl
import ipaddress
import json
import os
import select
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import attrs
import psutil

from dlrover_core import env, rundir
from dlrover_core.agent import __main__ as agent_main
from dlrover_core.control_plane import encode_job
from dlrover_core.display import ProgressDisplay, exit_code
from dlrover_core.errors import DLRoverError, JobSpecError
from dlrover_core.fileio import write_atomic
from dlrover_core.logging import get_logger, json_mode, write_record
from dlrover_core.master import __main__ as master_main
from dlrover_core.plugins import get_host
from dlrover_core.protocol import JobResult, JobState
from dlrover_core.protocol.client import MasterClient, fetch_master_status
from dlrover_core.protocol.messages import AssignNode, FailureReport, WorkerFailure
from dlrover_core.retry import rpc_retrying
from dlrover_core.rundir import RunDir
from dlrover_core.scheduler_backend import new_job_id
from dlrover_core.spec import JobSpec
from dlrover_core.stoplatch import StopLatch

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
    would add to torchrun's start. The launcher has no thread when it forks (checked).

    ``ignore``: signals the child ignores from its first instruction until its own code
    handles them (the agent's and the master's :class:`~dlrover_core.signals.SignalWatcher`).
    The launcher forwards its stop signals to them; one that came before their handlers would
    otherwise end them at once (the master without writing the job's result), so it is
    ignored instead and the launcher sends it again until they exit. ``output``: a file (the
    master's log) or the write end of a pipe the launcher reads (the agent's output under the
    live progress line) for the child's stdout and stderr; ``None``: the launcher's own.
    """

    def __init__(self, name: str, main: Callable[[list[str]], int | None], argv: list[str], *,
                 environ: dict[str, str], output: Path | int | None = None, close: tuple[int, ...] = (),
                 ignore: tuple[int, ...] = ()) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            code = 1
            try:
                for signum in ignore:  # first: the launcher's latch is no handler of the child's
                    signal.signal(signum, signal.SIG_IGN)
                sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__  # not the live line's proxies
                os.setsid()
                _set_process_name(name)
                for fd in close:
                    os.close(fd)
                null = os.open(os.devnull, os.O_RDONLY)
                os.dup2(null, 0)
                os.close(null)
                if isinstance(output, int):
                    os.dup2(output, 1)
                    os.dup2(output, 2)
                    os.close(output)
                elif output is not None:
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

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


#: Seconds between two sends of a stop signal to a child that has not exited yet (one that
#: received it before its own handlers were installed ignored it).
_FORWARD_AGAIN_S = 0.5
#: Seconds between two progress updates (the master's status) on the master's host.
_PROGRESS_POLL_S = 0.5
#: Size asked for the pipe of the agent's output under the live line (``F_SETPIPE_SZ``): room
#: for the agent to write while the launcher waits on a call to the master (bytes).
_PIPE_SIZE = 1 << 20


class _Launcher:
    def __init__(self, plan: HostPlan, signals: tuple[int, ...], preflight: Callable[[], object] | None, *,
                 latch: StopLatch, own_latch: bool, progress: bool | None) -> None:
        self.plan = plan
        self.signals = signals
        self.preflight = preflight
        self.latch = latch
        self.own_latch = own_latch
        self.progress = progress
        self.host, self.port = parse_endpoint(plan.endpoint)
        self.key = f"{socket.gethostname()}:{os.getpid()}"
        self.sock: socket.socket | None = None
        self.master: _Child | None = None
        self.master_restarts = 0
        self.agent: _Child | None = None
        self.agent_restarts = 0
        self.job_id = plan.rdzv_id
        self.run_dir: Path | None = None
        self.display: ProgressDisplay | None = None
        try:  # the command's start: the wall time of a result the launcher writes itself
            self.started = psutil.Process().create_time()
        except psutil.Error:  # pragma: no cover
            self.started = time.time()
        self._outputs: dict[int, bytes] = {}  # read ends of the agent's output pipes -> unfinished line
        self._forwarded: dict[int, float] = {}  # pid -> when the stop signal was last sent to it
        self._stop_noted = False
        self._scratch = tempfile.TemporaryDirectory(prefix="dlrover-run-")
        self.result_file = Path(self._scratch.name) / rundir.RESULT

    @property
    def stop_signal(self) -> int | None:
        """The stop signal this launcher received (``None``: none)."""
        return self.latch.signum

    # ----- processes -------------------------------------------------------------------

    def _base_env(self) -> dict[str, str]:
        variables = {**os.environ, "PYTHONUNBUFFERED": "1", env.WATCH_PID: str(os.getpid()),
                     env.JOB_SPEC: encode_job(self.plan.job),
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
                             output=RunDir(self.run_dir).master_log, close=tuple(self._outputs), ignore=self.signals)
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
        close = (*(() if self.sock is None else (self.sock.fileno(),)), *self._outputs)
        if self.display is not None and self.display.is_live:
            # under the live line, the agent's (and its workers') output comes through this
            # launcher, which prints it above the line; else it writes to the terminal itself
            read_fd, write_fd = os.pipe()
            with contextlib.suppress(OSError, AttributeError):
                fcntl.fcntl(write_fd, fcntl.F_SETPIPE_SZ, _PIPE_SIZE)  # (Linux; a smaller pipe still works)
            try:
                self.agent = _Child("dlrover-agent", agent_main.main, argv, environ=self._base_env(), output=write_fd,
                                    close=(*close, read_fd), ignore=self.signals)
            finally:
                os.close(write_fd)
            os.set_blocking(read_fd, False)
            self._outputs[read_fd] = b""
        else:
            # the agent and its workers write to this terminal, as torchrun's do
            self.agent = _Child("dlrover-agent", agent_main.main, argv, environ=self._base_env(), close=close,
                                ignore=self.signals)

    def _wait(self, proc: _Child, timeout_s: float) -> int | None:
        """Wait up to ``timeout_s`` for ``proc`` to exit (copying output meanwhile)."""
        deadline = time.monotonic() + timeout_s
        while proc.poll() is None and time.monotonic() < deadline:
            self._idle(0.02)
        return proc.returncode

    def _stop_children(self) -> None:
        """SIGTERM to what still runs, SIGKILL after 30 s (idempotent)."""
        for proc in (self.agent, self.master):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                if self._wait(proc, 30.0) is None:
                    proc.kill()
                    self._wait(proc, 5.0)

    # ----- output, progress, signals ------------------------------------------------------

    def _idle(self, seconds: float) -> None:
        """Sleep ``seconds``, printing the agent's output as it comes (live line only)."""
        if not self._outputs:
            time.sleep(seconds)
            return
        deadline = time.monotonic() + seconds
        while True:
            left = deadline - time.monotonic()
            ready, _, _ = select.select(list(self._outputs), [], [], max(0.0, left))
            for fd in ready:
                self._copy_output(fd)
            if not ready or time.monotonic() >= deadline:
                return

    def _copy_output(self, fd: int) -> None:
        assert self.display is not None
        chunks = []
        eof = False
        while True:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                break
            if not chunk:
                eof = True
                break
            chunks.append(chunk)
        data = self._outputs[fd] + b"".join(chunks)
        *lines, rest = data.split(b"\n")
        if eof and rest:
            lines, rest = [*lines, rest], b""
        for line in lines:
            self.display.line(line.decode(errors="replace").rstrip("\r"))
        if eof:
            del self._outputs[fd]
            os.close(fd)
        else:
            self._outputs[fd] = rest

    def _copy_remaining_output(self, timeout_s: float = 2.0) -> None:
        """After the agent exited: the rest of what it wrote (its pipe ends when its last
        writer does)."""
        deadline = time.monotonic() + timeout_s
        while self._outputs and time.monotonic() < deadline:
            self._idle(0.05)

    def _show_progress(self) -> None:
        assert self.display is not None
        answer = fetch_master_status(self.endpoint, timeout_s=1.0)
        if answer is not None:
            self.display.update(answer.to_job_status(), time.time() - self.started)

    def _forward_stop(self) -> None:
        """Send the stop signal this launcher received to its agent and master, and again
        every ``_FORWARD_AGAIN_S`` while they run (see :class:`_Child`)."""
        signum = self.latch.signum
        if signum is None:
            return
        if not self._stop_noted:
            self._stop_noted = True
            log.info("stop_signal_received", signal=self.latch.name, job_id=self.job_id or None)
            if self.display is not None:
                self.display.note("interrupted", f"{self.latch.name}: stopping the job")
        now = time.monotonic()
        for proc in (self.agent, self.master):
            if proc is not None and proc.poll() is None and now - self._forwarded.get(proc.pid, -1e9) >= _FORWARD_AGAIN_S:
                proc.send_signal(signum)
                self._forwarded[proc.pid] = now

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

    def _read_result(self, path: Path) -> JobResult | None:
        with contextlib.suppress(ValueError, OSError):
            return JobResult.from_dict(json.loads(path.read_text()))
        return None

    def _result(self) -> JobResult | None:
        if self.run_dir is not None:  # this host's master writes it at its end
            if self.master is not None:
                deadline = time.monotonic() + _RESULT_WAIT_S
                while self.master.poll() is None and time.monotonic() < deadline:
                    self._forward_stop()
                    self._idle(0.05)
            return self._read_result(RunDir(self.run_dir).result)
        return self._read_result(self.result_file)  # what this host's agent kept at its end

    def _write_own_result(self) -> JobResult:
        """The job's result when its master could not write one (it never started: a stop
        signal came first; it was stopped or died before it wrote one): CANCELLED after a stop
        signal, else FAILED, with the reason. ``dlrover status`` then reports it."""
        assert self.run_dir is not None
        if self.stop_signal is not None:
            state = JobState.CANCELLED
            when = ("before the job started" if self.master is None
                    else "before its job master recorded the end of the job")
            reason = f"{self.latch.name} to dlrover run (pid {os.getpid()}) {when}"
        else:
            state = JobState.FAILED
            reason = f"the job master exited without writing the job's result (see {RunDir(self.run_dir).master_log})"
        result = JobResult(job_id=self.job_id, state=state, reason=reason, final_step=-1, restarts=0,
                           wall_time_s=round(max(0.0, time.time() - self.started), 3), productive_s=0.0, goodput=0.0,
                           checkpoint_stall_s=0.0, restore_s=0.0, recomputed_s=0.0, detection_s=0.0, restart_s=0.0,
                           rendezvous_s=0.0, startup_s=0.0, failures=(), metrics={}, log_dir=str(self.run_dir))
        write_atomic(RunDir(self.run_dir).result, json.dumps(result.to_dict(), indent=2))
        log.warning("job_result_written_by_launcher", job_id=self.job_id, state=state.value, reason=reason)
        return result

    # ----- the run --------------------------------------------------------------------------

    def _stopping(self) -> bool:
        return self.stop_signal is not None

    def run(self) -> int:
        try:
            return self._run()
        finally:
            self._stop_children()
            if self.display is not None:
                self.display.stop()
            for fd in list(self._outputs):
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._outputs.clear()
            if self.sock is not None:
                self.sock.close()
            self._scratch.cleanup()
            if self.own_latch:
                self.latch.disarm()

    def _run(self) -> int:
        plan = self.plan
        # the plugins, loaded once before the agent and the master are forked (see _Child);
        # a stop signal that came meanwhile skips what is left before the outcome is written
        if not self._stopping():
            get_host()
        if self.preflight is not None and not self._stopping():
            self.preflight()
        if threading.active_count() > 1:  # pragma: no cover - a fork would copy a lock held by a thread
            raise DLRoverError("dlrover run cannot start its agent: a thread runs in the launcher")
        self.sock = claim_endpoint(self.host, self.port)
        if self.sock is not None:
            self.job_id = self.job_id or new_job_id(plan.job.name)
            self.run_dir = Path(plan.log_dir) / self.job_id
            self.run_dir.mkdir(parents=True, exist_ok=True)
            for stale in (rundir.JOURNAL, rundir.RESULT):  # an earlier run's with this id: start afresh
                path = self.run_dir / stale
                if path.exists():  # (a journal: its master crashed; a result: it ended)
                    path.rename(path.with_suffix(f".{int(time.time())}.old"))
            self.display = ProgressDisplay(self.job_id, progress=self.progress)
            if self._stopping():  # nothing started: this launcher writes the outcome
                self._write_handle()
                return self._finish()
            self._start_master()
            self._write_handle()
            log.info("hosting_job_master", job_id=self.job_id, endpoint=self.endpoint)
        elif plan.standalone:
            raise DLRoverError(f"--standalone could not listen on {self.endpoint}")
        if self._stopping():  # another host's master runs the job: this host never joined
            return self._finish()
        if self.display is not None:
            self.display.start()
        self._start_agent()
        code = self._supervise()
        return self._finish() if code is None else code

    def _write_handle(self) -> None:
        """``job.json`` and ``handle.json`` in the run directory, so ``dlrover status|logs|cancel
        JOB_ID`` find this job (the local scheduler's format: the master and this host's agent;
        before a master started, this launcher stands in its place)."""
        assert self.run_dir is not None
        master_pid = self.master.pid if self.master is not None else os.getpid()
        write_atomic(RunDir(self.run_dir).job, json.dumps({
            "scheduler": "local", "job_id": self.job_id, "log_dir": str(self.run_dir),
            "native_id": str(master_pid)}, indent=2))
        write_atomic(RunDir(self.run_dir).handle, json.dumps({
            "job_id": self.job_id, "master_addr": self.endpoint, "master_pid": master_pid, "agents": {},
            "launcher_pid": os.getpid()}, indent=2))

    def _supervise(self) -> int | None:
        """Watch the agent (and the master) until the agent exits; return the exit code of a
        launcher that could not follow the job to its end, or ``None`` when the job's result
        decides it (:meth:`_finish`)."""
        assert self.agent is not None
        next_progress = 0.0
        while True:
            self._idle(0.05)
            self._forward_stop()
            if self.display is not None and self.display.mode != "off" and time.monotonic() >= next_progress:
                next_progress = time.monotonic() + _PROGRESS_POLL_S
                self._show_progress()
            if (self.master is not None and self.master.poll() is not None and self.agent.poll() is None
                    and not self._stopping()):
                self._master_died()
            code = self.agent.poll()
            if code is None:
                continue
            if self._stopping() or code == _AGENT_DONE:
                return None
            if code == _AGENT_FENCED:
                log.error("agent_replaced", reason="the master replaced this host's agent (it was silent past "
                                                   "failure.heartbeat_timeout_s)")
                return 1
            if code == _AGENT_MASTER_GONE:
                if not self._master_answers_again():
                    if self._stopping():
                        return None
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
        while time.monotonic() < deadline and not self._stopping():
            if self._job_over() is False:
                log.warning("job_master_back", endpoint=self.endpoint)
                return True
            self._idle(0.5)
        return False

    def _master_died(self) -> None:
        assert self.master is not None and self.run_dir is not None
        if RunDir(self.run_dir).result.exists():
            return  # it ended the job (its agents are stopping)
        if self.master_restarts >= _MASTER_RESTARTS:
            return
        self.master_restarts += 1
        log.warning("job_master_died", exit_code=self.master.returncode, restart=self.master_restarts,
                    of=_MASTER_RESTARTS)
        self._idle(min(4.0, 0.5 * 2 ** self.master_restarts))
        self._start_master()
        self._write_handle()

    def _finish(self) -> int:
        """The job's outcome, shown (the summary, or the result's JSON record) and turned into
        the exit code (:func:`~dlrover_core.display.exit_code`). On the master's host the
        launcher owns it: when the master wrote no result (a stop signal came before it
        started, or it was stopped or died first), the launcher writes one."""
        result = self._result()
        if result is None and self.run_dir is not None:
            self._stop_children()  # a master still running past the wait: stopped now
            result = self._read_result(RunDir(self.run_dir).result) or self._write_own_result()
        self._copy_remaining_output()
        if self.display is not None:
            self.display.stop()
        if result is None:  # another host's master runs the job, and this host knows nothing of its end
            if self._stopping():
                print(f"dlrover run: this host left job {self.job_id or '(not joined)'} on {self.latch.name}",
                      flush=True)
                return exit_code(None, self.stop_signal)
            log.error("job_result_unknown", reason="the job master did not say how the job ended (see its log on "
                                                    f"the host of {self.endpoint})")
            return 1
        if self.display is not None:
            self.display.result(result)  # the summary; JSON Lines: the result is one object
        elif json_mode():  # (every host has the whole of it)
            write_record(result.to_record())
        else:
            print(f"job {result.job_id}: {result.state.value}" + (f" ({result.reason})" if result.reason else "")
                  + f"; the summary is on the job master's host ({self.endpoint})", flush=True)
        return exit_code(result, self.stop_signal)


def run_host(plan: HostPlan, *, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT),
             preflight: Callable[[], object] | None = None, latch: StopLatch | None = None,
             progress: bool | None = None) -> int:
    """Run this host's part of the job (see the module docstring); return the exit code
    (:func:`~dlrover_core.display.exit_code`): 0 when the job succeeded, 1 when it failed or
    this host could not take part, 128+N when signal N (one of ``signals``) stopped it. On the
    master's host the job's summary is printed at the end, also after a stop signal, and a job
    stopped before its master could record it gets its ``result.json`` from this launcher.

    Args:
        plan: what to run and where the job master is.
        signals: the signals that stop the job: forwarded to the agent (and the master, on
            its host), which stop the workers gracefully (torchrun's ``--signals-to-handle``).
        preflight: checks of the job (validation, a test write of its storage), run before
            anything starts; what it raises is raised.
        latch: the process's stop latch, armed at its first instruction
            (:func:`dlrover_core.stoplatch.process_latch`); made to handle exactly
            ``signals``. ``None``: one is armed now (and disarmed at the end).
        progress: the master's host shows the job's progress: ``None`` as a live line on a
            terminal only (never in JSON mode), ``True`` also as plain lines (JSON records)
            when stdout is not a terminal, ``False`` never
            (:class:`~dlrover_core.display.ProgressDisplay`).
    """
    own = latch is None
    if latch is None:
        latch = StopLatch(signals).arm()
    else:
        latch.handle_only(signals)
    return _Launcher(plan, signals, preflight, latch=latch, own_latch=own, progress=progress).run()
