"""The ElasticAgent: one per node; joins rounds, runs workers, reports, restarts on order.

Loop::

    register → join round → start nproc workers → watch them and heartbeat
        a worker failed       → stop the others, report it; the master answers restart/stop
        all workers succeeded → report it; wait for the master's stop (or a restart)
        master says restart   → stop workers, join the next round
        master says stop      → stop workers, exit

Workers are stopped by SIGTERM to their whole process tree, then SIGKILL after
``Failure.stop_grace_s``. SIGTERM/SIGINT to the agent is forwarded the same way.

The agent hosts the node's :class:`~dlrover_core.checkpoint.saver.CheckpointSaver`: the
workers' shared-memory snapshots outlive them and are persisted in the background; after a
failure the newest ones are persisted too ("save at breakpoint") unless the restarted
workers restore from memory within ``_BREAKPOINT_GRACE_S``. When the workers succeed, the
final flush is bounded by ``Checkpoint.persist_timeout_s``; a final checkpoint that is not
durable is reported as fatal (the job ends FAILED naming the storage), never as success.

Heartbeats go from a thread of their own with a client of their own: nothing the main
thread does — a storage write, the final flush, a stack dump, a node check — delays them,
so a slow disk never makes the node look lost. The saver reports with its own client too.

Fencing: ``register`` gives the agent a token; every call carries it, and the segments of
its workers are named with it. When the master has replaced this agent (it was frozen or
cut off past the heartbeat timeout and a new agent registered for the node), its calls are
answered ``fenced``: it stops its own workers and exits without touching the segments,
files or node record of its replacement.
The agent removes its segments when it exits, and stale ones of its node when it starts.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any, Protocol, TypeVar

import attrs

from dlrover_core import env as env_names
from dlrover_core import rundir
from dlrover_core.agent.forkserver import Standby, StandbyGone
from dlrover_core.agent.hang import PEER_DUMP_GRACE_S, HangWatcher
from dlrover_core.agent.launch import worker_argv, worker_env
from dlrover_core.agent.progress import ProgressTail, exception_from_error_file, exception_from_output
from dlrover_core.agent.replicas import NodeReplicas
from dlrover_core.agent.workers import WorkerProcess, kill_trees
from dlrover_core.checkpoint.saver import CheckpointSaver
from dlrover_core.checkpoint.shm import node_prefix, remove_segments
from dlrover_core.control_plane import OMP_NUM_THREADS, omp_num_threads
from dlrover_core.errors import MasterUnavailableError, ProtocolError, RendezvousError
from dlrover_core.fileio import write_atomic
from dlrover_core.logging import get_logger
from dlrover_core.protocol.client import MasterClient
from dlrover_core.protocol.codec import decode
from dlrover_core.protocol.messages import (
    Action,
    CheckpointErrorReport,
    Exited,
    FailureReport,
    Heartbeat,
    Join,
    NodeCheckReport,
    NodeCheckResult,
    Poll,
    PollState,
    Register,
    RoundAssignment,
    ShardAnswer,
    ShardReport,
    Succeeded,
    WorkerFailure,
)
from dlrover_core.protocol.progress import CheckpointRecord, ProgressRecord
from dlrover_core.retry import rpc_retrying
from dlrover_core.rundir import RunDir
from dlrover_core.signals import SignalWatcher
from dlrover_core.spec import JobSpec

__all__ = ["ElasticAgent"]

log = get_logger()

_POLL_S = 0.05
#: After a failure, how long restarted workers get to restore before the agent persists
#: the snapshots held in memory anyway (seconds).
_BREAKPOINT_GRACE_S = 10.0
#: Before a hang is reported in a job with live recovery, how long the agent waits for the
#: workers to make progress again (seconds): they may wait on a process that another node's
#: agent found stopped and is replacing.
_HANG_CONFIRM_S = 2.0
#: After a worker raised before its first step, how long its node's other workers get to
#: raise the same (seconds).
_SIBLING_ERROR_WAIT_S = 3.0
#: How long the first workers wait for the node's standby to finish its imports (seconds):
#: they would do the same imports themselves, so waiting costs nothing unless it hangs.
_STANDBY_READY_TIMEOUT_S = 300.0


def _fresh(path: Path) -> Path:
    """``path``, with what an earlier incarnation left there removed (a worker's error file
    must be its own)."""
    path.unlink(missing_ok=True)
    return path


def _is_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP: state ``T`` in ``/proc/<pid>/stat``)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


class _Answer(Protocol):
    """An answer of the master that says whether the asking agent was replaced."""

    @property
    def fenced(self) -> bool: ...


_A = TypeVar("_A", bound=_Answer)


class ElasticAgent:
    """Runs the workers of one node for the whole job.

    Args:
        job: the (resolved) Job.
        job_id: the run's id.
        node_id: this node's stable id.
        client: a client of the job master.
        log_dir: the run's log directory (worker logs go to ``node_<id>/``).
        accelerator: the node's Accelerator instance.
        nproc: workers to start per round.
        storage: checkpoint storage for the saver (``None``: no saver).
        echo: where worker output is copied with a ``[rank N]`` prefix (stdout).
        result_file: where to write the job's :class:`JobResult` (JSON) when it ends.
    """

    def __init__(
        self,
        *,
        job: JobSpec,
        job_id: str,
        node_id: int,
        client: MasterClient,
        log_dir: Path,
        accelerator: Any,
        nproc: int,
        storage: Any = None,
        echo: IO[str] | None = None,
        result_file: Path | None = None,
    ) -> None:
        self.job = job
        self.result_file = result_file
        self.job_id = job_id
        self.node_id = node_id
        self.client = client
        self.log_dir = log_dir
        self.node_dir = RunDir(log_dir).node_dir(node_id)
        self.accelerator = accelerator
        self.nproc = nproc
        self.echo = echo if echo is not None else sys.stdout
        self.workers: list[WorkerProcess] = []
        self._tails: dict[int, ProgressTail] = {}
        self._stop = threading.Event()
        self._signal: int | None = None
        self.token = 0  # fencing token, from register
        self._fenced = threading.Event()
        self._master_lost = threading.Event()  # no heartbeat reached the master for its timeout
        client.give_up_when(self._master_lost)  # (a call in flight then ends, not after its retries)
        self._standby: Standby | None = None  # the node's warm fork server (Failure.warm_restart)
        self._standby_failed = False  # a standby died before it was warm: start workers cold
        self.replicas: NodeReplicas | None = None  # snapshot replicas (Checkpoint.replicas)
        self._breakpoint_due: float | None = None  # monotonic deadline of a pending breakpoint save
        self._storage = storage
        self.saver: CheckpointSaver | None = None
        self.hangs = HangWatcher(node_id=node_id, node_dir=self.node_dir, hang_timeout_s=job.failure.hang_timeout_s,
                                 storage_busy=lambda: self.saver is not None and self.saver.busy())
        # heartbeat thread state (guarded by _state_lock: the tails are read by both threads)
        self._state_lock = threading.RLock()
        self._round: int | None = None  # the round whose workers run, None between rounds
        self._ordered: tuple[int, Action] | None = None  # (round, action) a heartbeat answer ordered
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        self._beat_lock = threading.Lock()  # held for a whole heartbeat (drain, send, answer)
        self._world: RoundAssignment | None = None  # the running round's assignment
        self._replacements = 0  # workers replaced in the live world (names their progress files)
        self._saver_ranks: set[int] = set()  # the ranks whose snapshots the saver persists this round

    # ----- entry -----------------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        """On SIGTERM, SIGINT and the other stop signals (:func:`~dlrover_core.signals.stop_signals`:
        SIGHUP and SIGQUIT by default), stop the workers with a grace period, then exit. The
        stop is set on a watcher thread (:class:`~dlrover_core.signals.SignalWatcher`), never
        in the handler: the main thread may be inside the stop event's own lock."""

        def on_signal(signum: int) -> None:
            self._signal = signum
            self._stop.set()

        SignalWatcher(on_signal).start()

    def request_stop(self) -> None:
        """Ask the agent to stop its workers and exit (thread-safe)."""
        self._stop.set()

    # ----- calls to the master ----------------------------------------------------------------

    @property
    def _token(self) -> int | None:
        """The fencing token every call for this node carries (``None`` before ``register``)."""
        return self.token or None

    def _heed(self, answer: _A) -> _A:
        """Look at an answer to a call for this node: a ``fenced`` one stops this agent for good."""
        if answer.fenced and not self._fenced.is_set():
            log.error("agent_fenced", node_id=self.node_id, token=self.token,
                      reason="the master replaced this agent (it was silent past failure.heartbeat_timeout_s); "
                             "stopping without touching the replacement's workers, memory or files")
            self._fenced.set()
            self._stop.set()
        return answer

    def _report_shard(self, client: MasterClient, shard: ShardReport) -> ShardAnswer:
        """The saver's report of a durable shard (on its own client)."""
        return self._heed(client.checkpoint_shard(shard))

    def _report_checkpoint_error(self, client: MasterClient, error: CheckpointErrorReport) -> None:
        """The saver's report of a failed shard write (on its own client)."""
        self._heed(client.checkpoint_error(error))

    @property
    def _shm_prefix(self) -> str:
        return node_prefix(self.job_id, self.node_id, self.token)

    def run(self) -> int:
        """Run until the master says stop; return the process exit code."""
        self.node_dir.mkdir(parents=True, exist_ok=True)
        ckpt = self.job.checkpoint
        if self._storage is not None and ckpt.memory_every_steps and ckpt.replicas_for(self.job.nodes.max):
            self.replicas = NodeReplicas(job_id=self.job_id, node_id=self.node_id, master_addr=self.client.addr,
                                         mb_per_s=ckpt.replica_mb_per_s, cpu_share=ckpt.replica_cpu_share)
        answer = self.client.register(Register(node_id=self.node_id, host=socket.gethostname(), pid=os.getpid(),
                                               replica_addr=self.replicas.address if self.replicas else ""))
        self.token = answer.token
        if self.replicas is not None:
            self.replicas.set_token(self.token)
        # segments of this node's earlier agents (a crashed or replaced one) are stale
        stale = remove_segments(node_prefix(self.job_id, self.node_id))
        if stale:
            log.warning("stale_segments_removed", node_id=self.node_id, segments=stale)
        if self._storage is not None:
            saver_client = MasterClient(self.client.addr)
            saver_client.give_up_when(self._master_lost)
            self.saver = CheckpointSaver(
                job_id=self.job_id, node_id=self.node_id, storage=self._storage, agent=self.token,
                persist_timeout_s=self.job.checkpoint.persist_timeout_s,
                report_shard=functools.partial(self._report_shard, saver_client),
                report_error=functools.partial(self._report_checkpoint_error, saver_client))
            self.saver.start()
        self._hb_thread = threading.Thread(target=self._heartbeat_loop, name="dlrover-heartbeat", daemon=True)
        self._hb_thread.start()
        # the standby imports torch while this agent waits for its peers; it forks every worker
        self._start_standby(low_priority=False)
        try:
            while not self._stop.is_set():
                world = self._rendezvous()
                if world is None:
                    break
                if self._run_round(world) == Action.STOP:
                    break
        except MasterUnavailableError as exc:
            log.error("master_unreachable", node_id=self.node_id, error=str(exc))
            return 1
        finally:
            self._exit()
        if self._signal is not None:
            log.info("agent_signalled", node_id=self.node_id, signal=signal.Signals(self._signal).name)
            return 128 + self._signal
        if self._master_lost.is_set():
            return 1
        return 3 if self._fenced.is_set() else 0

    def _exit(self) -> None:
        """Stop workers, standbys, the saver and the heartbeat; remove this agent's segments;
        tell the master (unless fenced: then the node is the replacement's)."""
        with self._state_lock:
            self._round = None
        self._stop_workers()
        if self._standby is not None:
            self._standby.close()
            self._standby = None
        if self.saver is not None:
            # the job ends before workers came back, or a signal (preemption, time limit,
            # requeue, cancel) stops this node: persist what memory holds
            if not self._fenced.is_set() and (self._breakpoint_due is not None or self._signal is not None):
                self.saver.request_breakpoint()
            gone = self._fenced.is_set() or self._master_lost.is_set()
            bound = 0.0 if (self.saver.fatal or gone) else self.job.checkpoint.persist_timeout_s
            result = self.saver.stop(timeout_s=bound)
            if not result.ok and not self._fenced.is_set() and bound:
                log.error("checkpoint_not_durable_at_exit", node_id=self.node_id, reason=result.reason)
        if self.replicas is not None:
            self.replicas.close()
        removed = remove_segments(self._shm_prefix)
        log.debug("segments_removed", node_id=self.node_id, count=len(removed))
        self._hb_stop.set()
        if self._hb_thread is not None:
            self._hb_thread.join(timeout=10)
        if not self._fenced.is_set() and not self._master_lost.is_set():
            self._keep_result()
            with contextlib.suppress(Exception):  # the master may already be gone
                self.client.exited(Exited(node_id=self.node_id, token=self._token))

    def _keep_result(self) -> None:
        """Write the job's result to ``result_file`` when the job is over (before this agent
        says it exits: the master may leave once every agent did). ``dlrover run`` on a host
        without the master reads it to exit with the job's outcome."""
        if self.result_file is None:
            return
        with contextlib.suppress(Exception):  # best effort: the master may already be gone
            result = self.client.result()
            if result.state.is_terminal:
                write_atomic(self.result_file, json.dumps(result.to_dict()))

    # ----- heartbeats (own thread) ------------------------------------------------------------

    def _heartbeat_loop(self) -> None:
        """Beat every ``Failure.heartbeat_interval_s`` until the agent exits, on a client of
        its own: an order for the running round is left in ``_ordered`` for the main loop."""
        interval = self.job.heartbeat_interval_s
        give_up_s = self.job.heartbeat_timeout_s
        # a beat is retried for a few intervals only, so the watch below sees failures in time;
        # a slow answer (a loaded master) is waited for up to half the timeout
        client = MasterClient(self.client.addr, timeout_s=max(2.0, min(10.0, give_up_s / 2)),
                              retrying=lambda: rpc_retrying(attempts=3, max_total_s=max(1.0, 2 * interval)))
        last_ok = time.monotonic()
        try:
            while not self._hb_stop.wait(interval):
                try:
                    self._beat(client)
                    last_ok = time.monotonic()
                except MasterUnavailableError as exc:
                    log.warning("heartbeat_failed", node_id=self.node_id, error=str(exc))
                    silent_s = time.monotonic() - last_ok
                    if silent_s > give_up_s:  # the master has lost this node by now, if it lives
                        self._lose_master(silent_s)
                        return
                except Exception as exc:  # never let the heartbeat thread die
                    log.error("heartbeat_error", node_id=self.node_id, error=f"{type(exc).__name__}: {exc}")
        finally:
            client.close()

    def _lose_master(self, silent_s: float) -> None:
        """No heartbeat reached the master for ``Failure.heartbeat_timeout_s``: it is gone, or
        this host is cut off from it (then it has declared this node lost, and the others go
        on). Stop the workers and exit 1 without calling it again: under ``dlrover run`` the
        host's launcher starts the agent anew if the master answers again (the node then
        rejoins), or reports the master unreachable."""
        log.error("master_lost", node_id=self.node_id, silent_s=round(silent_s, 1), master_addr=self.client.addr,
                  reason="no heartbeat reached the job master for failure.heartbeat_timeout_s")
        self._master_lost.set()
        self._stop.set()

    def _beat(self, client: MasterClient | None = None) -> Action:
        """One heartbeat: the round's progress, worker pids and storage saves; returns the
        master's action (``"none"`` between rounds)."""
        with self._beat_lock:  # one heartbeat at a time: the last progress never overtakes the one before
            return self._beat_once(client)

    def _beat_once(self, client: MasterClient | None) -> Action:
        with self._state_lock:
            round_index = self._round
            steps, records, saves, taken = self._drain() if round_index is not None else ({}, [], {}, {})
            tails = dict(self._tails)
            workers = {w.rank: w.pid for w in self.workers if w.poll() is None} if round_index is not None else {}
        beat = Heartbeat(node_id=self.node_id, round=-1 if round_index is None else round_index, workers=workers,
                         steps=steps, records=tuple(records), saves={k: tuple(v) for k, v in saves.items()},
                         pid=os.getpid(), token=self._token,
                         replicas=self.replicas.held() if self.replicas is not None else ())
        try:
            answer = self._heed((client or self.client).heartbeat(beat))
        except MasterUnavailableError:
            with self._state_lock:  # deliver them with the next heartbeat
                for rank, records_taken in taken.items():
                    tails[rank].put_back(records_taken)
            raise
        action = answer.action
        if round_index is None:
            return Action.NONE
        if self.replicas is not None and answer.replica_source >= 0:  # (a source relaunched in a live recovery)
            self.replicas.follow(answer.replica_source, answer.replica_source_addr, answer.replica_source_ranks)
        if action != Action.NONE:
            with self._state_lock:
                if self._round == round_index and self._ordered is None:
                    self._ordered = (round_index, action)
        return action

    # ----- rendezvous --------------------------------------------------------------------

    def _join(self) -> Action:
        return self._heed(self.client.join(Join(node_id=self.node_id, nproc=self.nproc, token=self._token))).action

    def _rendezvous(self) -> RoundAssignment | None:
        """Join the next round and poll until it formed: this node's place in it (``None``:
        stop)."""
        if self._join() == Action.STOP:
            return None
        deadline = time.monotonic() + self.job.nodes.join_timeout_s
        while not self._stop.is_set():
            answer = self._heed(self.client.poll(Poll(node_id=self.node_id, token=self._token)))
            if answer.state == PollState.READY:
                log.info("rendezvous_ready", node_id=self.node_id, round=answer.round,
                         node_rank=answer.node_rank, world_size=answer.world_size)
                return answer
            if answer.state == PollState.STOP:
                return None
            self._breakpoint_tick(restored=False)
            if answer.state == PollState.REJOIN:
                self._join()
            if answer.state == PollState.CHECK:
                result = self._node_check(answer)
                self._heed(self.client.node_check(NodeCheckReport(
                    node_id=self.node_id, check_round=answer.check_round, result=result, token=self._token)))
                continue
            if time.monotonic() > deadline:
                raise RendezvousError(f"node {self.node_id}: no round formed within nodes.join_timeout_s="
                                      f"{self.job.nodes.join_timeout_s:g} s")
            self._stop.wait(0.02)
        return None

    def _node_check(self, order: RoundAssignment) -> NodeCheckResult:
        """Run this node's part of a node check round (a subprocess in the check group)."""
        env = {**os.environ, "RANK": str(order.group_rank), "WORLD_SIZE": str(order.group_size),
               "MASTER_ADDR": order.store_host, "MASTER_PORT": str(order.store_port),
               "DLROVER_CHECK_PREFIX": order.prefix, "DLROVER_ACCELERATOR": self.accelerator.name,
               "DLROVER_NODE_ID": str(self.node_id),
               **self.accelerator.worker_env(0, 1)}
        proc = subprocess.Popen([sys.executable, "-m", "dlrover_core.agent.node_check"], env=env, cwd=self.job.workdir,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + order.timeout_s
        stdout = stderr = ""
        while True:
            try:
                stdout, stderr = proc.communicate(timeout=self.job.heartbeat_interval_s)
                break
            except subprocess.TimeoutExpired:  # (the heartbeat thread keeps the node alive meanwhile)
                if time.monotonic() > deadline:
                    proc.kill()
                    stdout, stderr = proc.communicate()
                    break
        lines = [line for line in stdout.splitlines() if line.startswith("{")]
        try:
            result = (decode(NodeCheckResult, json.loads(lines[-1])) if lines
                      else NodeCheckResult(ok=False, error=(stderr or "no result")[-500:]))
        except (ValueError, ProtocolError) as exc:
            result = NodeCheckResult(ok=False, error=f"unreadable result {lines[-1][:200]!r}: {exc}")
        if proc.returncode is None or (time.monotonic() > deadline and not lines):
            result = NodeCheckResult(ok=False, error=f"timed out after {order.timeout_s} s")
        log.info("node_check_done", node_id=self.node_id, check_round=order.check_round, group=list(order.group),
                 ok=result.ok, elapsed_s=result.elapsed_s, error=result.error or None)
        return result

    # ----- one round -----------------------------------------------------------------------

    def _start_workers(self, world: RoundAssignment) -> None:
        round_dir = self.node_dir / rundir.round_dir(world.round)
        round_dir.mkdir(parents=True, exist_ok=True)
        argv = worker_argv(self.job)
        self.workers, self._tails = [], {}
        for local_rank in range(world.nproc):
            rank = world.rank_offset + local_rank
            progress = round_dir / rundir.progress_file(rank)
            error_file = _fresh(round_dir / rundir.error_file(rank))
            env = {**os.environ, **worker_env(
                self.job, job_id=self.job_id, node_id=self.node_id, world=world, local_rank=local_rank,
                master_addr=self.client.addr, accelerator=self.accelerator, progress_file=str(progress),
                log_dir=str(self.log_dir), agent_pid=os.getpid(), agent_token=self.token, error_file=str(error_file),
            ), "DLROVER_STACK_FILE": str(self.hangs.stack_file(world.round, rank))}
            if world.live_join:  # the round runs on without this node: its workers join it live
                env[env_names.LIVE_JOIN] = "1"
            worker = self._new_worker(rank=rank, local_rank=local_rank, argv=argv, env=env)
            self.workers.append(worker)
            self._tails[rank] = ProgressTail(progress, started=time.monotonic(), error_file=error_file)
        if self.saver is not None:
            self._saver_ranks = {w.rank for w in self.workers}
            self.saver.set_ranks(sorted(self._saver_ranks))
            if self.replicas is not None:
                self.replicas.set_ranks(sorted(self._saver_ranks))
        log.info("workers_started", node_id=self.node_id, round=world.round, ranks=[w.rank for w in self.workers],
                 pids=[w.pid for w in self.workers], warm=[w.warm for w in self.workers])

    # ----- warm restart -------------------------------------------------------------------

    def _standby_env(self) -> dict[str, str]:
        """What a standby imports torch with: the workers' values of the variables libraries
        read at import time."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "DLROVER_WATCH_PID": str(os.getpid())}
        threads = omp_num_threads(self.job, nproc=self.nproc, environ=os.environ)
        if threads is not None:
            env[OMP_NUM_THREADS] = threads
        env.update(self.accelerator.worker_env(0, self.nproc))
        env.update(self.job.env)
        return env

    def _start_standby(self, *, low_priority: bool) -> None:
        """Start the node's standby (Failure.warm_restart; none for ``--no-python``, whose
        entrypoint is not Python, or after one died warming up: it would again)."""
        if (not self.job.failure.warm_restart or os.environ.get(env_names.WORKER_EXEC) == "1"
                or self._standby_failed or self._stop.is_set()):
            return
        shared = os.environ.get(env_names.SHARED_STANDBY) == "1"  # nodes share this host (the local scheduler)
        self._standby = Standby(env=self._standby_env(), cwd=self.job.workdir, job_id=self.job_id,
                                log_file=self.node_dir / rundir.STANDBY_LOG, low_priority=low_priority,
                                shared_log_file=self.log_dir / rundir.SHARED_STANDBY_LOG if shared else None)
        log.debug("standby_started", node_id=self.node_id, pid=self._standby.pid, low_priority=low_priority,
                  shared=self._standby.shared)

    def _keep_standby(self) -> None:
        """Start a new standby where the node's one died after it was warm (at nice 19: the
        workers run now)."""
        if self._standby is not None and not self._standby.alive():
            warm = self._standby.warmed
            log.warning("standby_exited", node_id=self.node_id, pid=self._standby.pid,
                        exit_code=self._standby.exit_code, warm=warm,
                        log=str(self.node_dir / rundir.STANDBY_LOG))
            self._standby.close()
            self._standby = None
            self._standby_failed = not warm
            self._start_standby(low_priority=True)

    def _take_standby(self) -> Standby | None:
        """The node's standby, once it is ready: the first one (started with the agent) is
        waited for, as the workers would import the same themselves; one restarted at low
        priority is not (a fresh process starts sooner)."""
        standby = self._standby
        if standby is None:
            return None
        if not standby.low_priority and not standby.ready():
            standby.wait_ready(_STANDBY_READY_TIMEOUT_S, self._stop)
        if not standby.ready():
            self._keep_standby()
            return None
        return standby

    def _new_worker(self, *, rank: int, local_rank: int, argv: list[str], env: dict[str, str]) -> WorkerProcess:
        """Start a worker: forked by the node's standby when it is ready, a fresh process otherwise."""
        kwargs = {"rank": rank, "local_rank": local_rank, "argv": argv, "env": env, "cwd": self.job.workdir,
                  "log_file": self.node_dir / rundir.rank_log(rank), "echo": self.echo}
        standby = self._take_standby() if argv[0] == sys.executable else None  # (its interpreter only)
        if standby is not None:
            try:
                return WorkerProcess(**kwargs, standby=standby)
            except StandbyGone as exc:
                log.info("worker_started_cold", node_id=self.node_id, rank=rank, reason=str(exc))
        return WorkerProcess(**kwargs)

    # ----- hangs (dlrover_core.agent.hang) ----------------------------------------------------

    def _on_hang(self, round_index: int, hung: list[WorkerProcess]) -> Action:
        failures = self.hangs.failures(round_index, self.workers, hung, self._tails)
        # report first and stop a moment later: the other nodes' workers hang in the same
        # collective, and their agents dump those stacks (on their own timeout, or on the
        # master's order) before our workers' exit resets the connections they wait on
        return self._report_failures(round_index, failures, stop_after_s=PEER_DUMP_GRACE_S)

    def _stop_workers(self) -> None:
        if self.workers:
            kill_trees(self.workers, grace_s=self.job.failure.stop_grace_s)
            self.workers = []

    def _save_at_breakpoint(self) -> None:
        """Workers stopped after a failure: arrange to persist every complete snapshot newer
        than the last commit ("save at breakpoint") — unless the restarted workers restore
        within ``_BREAKPOINT_GRACE_S``: they restore from memory and go on saving (and
        persisting on schedule), and the persist would only slow that restore down. If they
        do not come back in time, or the job ends, the snapshots are persisted then."""
        if self.saver is not None and self._breakpoint_due is None:
            self._breakpoint_due = time.monotonic() + _BREAKPOINT_GRACE_S

    def _breakpoint_tick(self, restored: bool) -> None:
        if self._breakpoint_due is None or self.saver is None:
            return
        if restored:
            self._breakpoint_due = None
        elif time.monotonic() > self._breakpoint_due:
            self._breakpoint_due = None
            self.saver.request_breakpoint()

    def _drain(self) -> tuple[dict[int, int], list[ProgressRecord], dict[int, list[int]], dict[int, list]]:
        """New progress (call with ``_state_lock`` held): every local rank's newest step,
        rank 0's records, the steps each rank saved for storage, and what was taken from
        each tail (to put back if the master does not answer). Records read elsewhere (a
        failure report reads the tails for exception records) are forwarded too."""
        records: list[ProgressRecord] = []
        saves: dict[int, list[int]] = {}
        taken: dict[int, list] = {}
        held: set[int] = set()  # ranks the workers reported holding
        for rank, tail in self._tails.items():
            tail.read()
            new = taken[rank] = tail.take_unsent()
            # rank 0's records: in the live world the rank a worker holds changes, and each
            # step record says which it was (a record that does not say is its file's rank's)
            records.extend(r for r in new if (rank if r.rank is None else r.rank) == 0)
            held.update(r.rank for r in new if r.rank is not None)
            persisted = [r.step for r in new if isinstance(r, CheckpointRecord) and r.persist]
            if persisted:
                saves[rank] = persisted
        steps = {rank: tail.last_step for rank, tail in self._tails.items() if tail.last_step >= 0}
        if self.saver is not None and not held <= self._saver_ranks:
            # workers took other ranks in the live world: their snapshots are named by them
            self._saver_ranks |= held
            self.saver.set_ranks(sorted(self._saver_ranks))
            if self.replicas is not None:
                self.replicas.set_ranks(sorted(self._saver_ranks))
        return steps, records, saves, taken

    def _heartbeat(self, round_index: int) -> Action:
        """A heartbeat from the main thread (the last progress before a failure report)."""
        return self._beat()

    def _run_round(self, world: RoundAssignment) -> Action:
        """Run one round's workers; return ``restart`` or ``stop``."""
        round_index = world.round
        self._world = world
        if self.replicas is not None:
            fetched = self.replicas.fetch_missing(world.replica_holders)
            if fetched:
                log.info("replicas_fetched", node_id=self.node_id, round=round_index, replicas=fetched)
            self.replicas.follow(world.replica_source, world.replica_source_addr, world.replica_source_ranks)
        self._start_workers(world)  # (the heartbeat thread does not look at workers between rounds)
        with self._state_lock:
            self._round, self._ordered = round_index, None
        try:
            return self._watch_round(round_index)
        finally:
            with self._state_lock:
                self._round = None

    def _final_flush(self, round_index: int) -> Action | None:
        """The workers succeeded: wait (bounded) until their last checkpoints are durable.
        If they are not, report it as fatal (the job ends FAILED naming the storage) and
        return the master's order (``stop``, unless it ordered a restart meanwhile);
        ``None`` when all is durable."""
        if self.saver is None:
            return None
        result = self.saver.flush(self.job.checkpoint.persist_timeout_s)
        if result.ok:
            return None
        log.error("checkpoint_not_durable", node_id=self.node_id, round=round_index, reason=result.reason)
        answer = self._heed(self.client.checkpoint_error(CheckpointErrorReport(
            node_id=self.node_id, step=result.step, error=result.reason, storage=self.saver.storage.url, fatal=True,
            token=self._token)))
        return Action.RESTART if answer.action == Action.RESTART else Action.STOP

    def _watch_round(self, round_index: int) -> Action:
        reported_success = False
        while not self._stop.is_set():
            codes = [(w, w.poll()) for w in self.workers]
            failed = [(w, c) for w, c in codes if c not in (None, 0)]
            if failed:
                action = self._on_failure(round_index, failed)
                if action is None:  # replaced: the others go on
                    continue
                return action
            hung = self.hangs.hung(self.workers, self._tails)
            live = not self.job.live_blocker and any(t.live for t in self._tails.values())
            if hung and live and not any(_is_stopped(w.pid) for w in hung):
                # the others may be waiting on a process another node is replacing right now:
                # look again, with fresh progress, after a moment
                self._stop.wait(_HANG_CONFIRM_S)
                with self._state_lock:
                    for tail in self._tails.values():
                        tail.read()
                hung = [w for w in self.hangs.hung(self.workers, self._tails) if w in hung]
            if hung:
                stopped = [w for w in hung if _is_stopped(w.pid)] if live else []
                if stopped:  # the others wait on a frozen (stopped) process: it is the one to replace
                    failures = self.hangs.failures(round_index, self.workers, stopped, self._tails, stopped=True)
                    action = self._report_live(round_index, stopped, failures, stop_after_s=PEER_DUMP_GRACE_S)
                    if action is None:
                        continue
                    return action
                return self._on_hang(round_index, hung)
            started = all(t.last_step >= 0 for t in self._tails.values())
            self._breakpoint_tick(restored=started)
            if started:
                self._keep_standby()
            if not reported_success and all(c == 0 for _, c in codes):
                for w in self.workers:
                    w.join_output()
                not_durable = self._final_flush(round_index)  # the final checkpoint is committed first
                if not_durable is not None:
                    return not_durable
                self._heartbeat(round_index)
                log.info("workers_succeeded", node_id=self.node_id, round=round_index)
                answer = self._heed(self.client.succeeded(Succeeded(node_id=self.node_id, round=round_index,
                                                                    token=self._token)))
                reported_success = True
                if answer.action != Action.NONE:
                    return answer.action
            with self._state_lock:
                ordered = self._ordered if self._ordered and self._ordered[0] == round_index else None
            if ordered is not None:
                action = ordered[1]
                log.info("master_ordered", node_id=self.node_id, action=action, round=round_index)
                self.hangs.dump_stalled(round_index, self.workers, self._tails)
                self._stop_workers()
                self._report_late_exceptions(round_index)
                if action == Action.RESTART:
                    self._save_at_breakpoint()
                return action
            self._stop.wait(_POLL_S)
        return Action.STOP

    def _read_exceptions(self, failed: list[tuple[WorkerProcess, int]]) -> None:
        """Each failed worker's uncaught exception: its own record, else what torch's
        ``@record`` wrote into its ``TORCHELASTIC_ERROR_FILE``, else the traceback at the end
        of its output (a script that failed before importing ``dlrover_core.train``)."""
        with self._state_lock:
            for w, code in failed:
                tail = self._tails[w.rank]
                tail.read()  # an uncaught exception's record, if the worker wrote one
                recorded = (exception_from_error_file(tail.error_file, step=tail.last_step)
                            if tail.error_file is not None else None)
                if tail.exception is None:
                    tail.exception = recorded
                elif recorded is not None and tail.exception.unix_time_s is None:
                    tail.exception = attrs.evolve(tail.exception, unix_time_s=recorded.unix_time_s)
                if tail.exception is None and code > 0:
                    tail.exception = exception_from_output(w.log_file, step=tail.last_step)

    def _exited(self, w: WorkerProcess, code: int | None, seen_at: float | None = None) -> WorkerFailure:
        """The failure report of a worker that exited (or recorded an exception)."""
        tail = self._tails[w.rank]
        error_file = tail.error_file if tail.error_file is not None and tail.error_file.exists() else None
        return WorkerFailure.exited(rank=w.rank, local_rank=w.local_rank, exit_code=code, exception=tail.exception,
                                    seen_at=seen_at, error_file=str(error_file or ""))

    def _on_failure(self, round_index: int, failed: list[tuple[WorkerProcess, int]]) -> Action:
        seen_at = time.time()  # a failure without an exception's own time failed by now (torchrun's timestamp)
        for w, code in failed:
            log.warning("worker_exited", node_id=self.node_id, rank=w.rank, local_rank=w.local_rank, exit_code=code)
        for w, _ in failed:
            w.join_output()
        self._read_exceptions(failed)
        early = any((exc := self._tails[w.rank].exception) is not None and exc.before_first_step for w, _ in failed)
        if early and len(failed) < len(self.workers):
            # an error before the first step is likely the script's, raised by every rank:
            # let this node's other workers reach it too (the master stops the job when all
            # ranks report the same error) instead of killing them first
            deadline = time.monotonic() + _SIBLING_ERROR_WAIT_S
            while time.monotonic() < deadline and any(w.poll() is None for w in self.workers):
                time.sleep(0.05)
            failed = [(w, c) for w in self.workers if (c := w.poll()) not in (None, 0)]
            for w, _ in failed:
                w.join_output()
            self._read_exceptions(failed)
        failures = [self._exited(w, code, seen_at) for w, code in failed]
        # a worker of this node loops in the live world: the master may answer ``replace``
        if not self.job.live_blocker and not early and any(t.live for t in self._tails.values()):
            return self._report_live(round_index, [w for w, _ in failed], failures)
        return self._report_failures(round_index, failures)

    def _report_live(self, round_index: int, failed: list[WorkerProcess], failures: list[WorkerFailure], *,
                     stop_after_s: float | None = None) -> Action | None:
        """Report failed (or frozen) workers without stopping the others first: the master
        may answer ``replace`` (the survivors go on, only these restart, as joiners of the
        running world); ``None`` then. Otherwise stop every worker (``stop_after_s`` later:
        see :meth:`_on_hang`) and return the master's order."""
        self._heartbeat(round_index)  # forward the last progress before the failure
        answer = self._heed(self.client.failure(FailureReport(node_id=self.node_id, round=round_index,
                                                              failures=tuple(failures), token=self._token)))
        if answer.action == Action.REPLACE and not self._stop.is_set():
            self._replace(round_index, failed)
            return None
        if stop_after_s is not None:
            self._stop.wait(stop_after_s)
        self._stop_workers()
        self._save_at_breakpoint()
        return Action.STOP if answer.action == Action.STOP else Action.RESTART

    def _replace(self, round_index: int, failed: list[WorkerProcess]) -> None:
        """Start a replacement for each failed worker in its slot (a warm standby when one
        is ready); it joins the running world with its peers' live state."""
        world = self._world
        assert world is not None
        round_dir = self.node_dir / rundir.round_dir(world.round)
        argv = worker_argv(self.job)
        kill_trees([w for w in failed if w.poll() is None], grace_s=0.0)  # a frozen one
        for old in failed:
            self._replacements += 1
            rank, local_rank = old.rank, old.local_rank
            progress = round_dir / rundir.progress_file(rank, self._replacements)
            error_file = _fresh(round_dir / rundir.error_file(rank, self._replacements))
            env = {**os.environ, **worker_env(
                self.job, job_id=self.job_id, node_id=self.node_id, world=world, local_rank=local_rank,
                master_addr=self.client.addr, accelerator=self.accelerator, progress_file=str(progress),
                log_dir=str(self.log_dir), agent_pid=os.getpid(), agent_token=self.token, error_file=str(error_file),
            ), "DLROVER_STACK_FILE": str(self.hangs.stack_file(world.round, rank)), env_names.LIVE_JOIN: "1"}
            worker = self._new_worker(rank=rank, local_rank=local_rank, argv=argv, env=env)
            with self._state_lock:
                self.workers[self.workers.index(old)] = worker
                # a replacement: its node's step times still tell the hang timeout, and once it
                # asks to join (live_ready) it is past its start-up (see HangWatcher.hung)
                self._tails[rank] = ProgressTail(progress, started=time.monotonic(), joiner=True,
                                                 step_times=self._tails[rank].step_times, error_file=error_file)
            log.info("worker_replaced", node_id=self.node_id, round=round_index, rank=rank, local_rank=local_rank,
                     old_pid=old.pid, pid=worker.pid, warm=worker.warm)

    def _report_late_exceptions(self, round_index: int) -> None:
        """Workers that died of an exception while the master's restart order was on its way
        still tell the master what killed them (it looks for the same error on every rank)."""
        failures = []
        with self._state_lock:
            for tail in self._tails.values():
                tail.read()
        for rank, tail in self._tails.items():
            recorded = (exception_from_error_file(tail.error_file, step=tail.last_step)
                        if tail.exception is None and tail.error_file is not None else None)
            exception = tail.exception or recorded
            if exception is not None:
                error_file = str(tail.error_file) if tail.error_file is not None and tail.error_file.exists() else ""
                failures.append(WorkerFailure.exited(rank=rank, local_rank=rank - min(self._tails), exit_code=None,
                                                     exception=exception, error_file=error_file))
        if failures:
            self._heed(self.client.failure(FailureReport(node_id=self.node_id, round=round_index,
                                                         failures=tuple(failures), token=self._token)))

    def _report_failures(self, round_index: int, failures: list[WorkerFailure], *,
                         stop_after_s: float | None = None) -> Action:
        """Stop the workers and report ``failures``; with ``stop_after_s``, report first and
        stop the workers that long after (a hang: see :meth:`_on_hang`)."""
        if stop_after_s is None:
            self._stop_workers()
        self._heartbeat(round_index)  # forward the last progress before the failure
        answer = self._heed(self.client.failure(FailureReport(node_id=self.node_id, round=round_index,
                                                              failures=tuple(failures), token=self._token)))
        if stop_after_s is not None:
            self._stop.wait(stop_after_s)
            self._stop_workers()
        # the master has told everyone to restart (a ``replace`` cannot be heeded once every
        # worker is stopped: join the next round, the master places this node again);
        # persist what memory holds before rejoining
        self._save_at_breakpoint()
        return Action.STOP if answer.action == Action.STOP else Action.RESTART

