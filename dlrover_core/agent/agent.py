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
workers restore from memory within ``_BREAKPOINT_GRACE_S``.
The agent removes the node's segments when it exits, and stale ones of its job when it starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from dlrover_core.agent.launch import worker_argv, worker_env
from dlrover_core.agent.progress import ProgressTail
from dlrover_core.agent.workers import Standby, WorkerProcess, kill_trees
from dlrover_core.checkpoint.saver import CheckpointSaver
from dlrover_core.checkpoint.shm import remove_segments
from dlrover_core.errors import MasterUnavailableError, RendezvousError
from dlrover_core.logging import get_logger
from dlrover_core.master.client import MasterClient
from dlrover_core.spec import Job

__all__ = ["ElasticAgent"]

log = get_logger()

_POLL_S = 0.05
#: Least time a worker gets before its first report before it counts as hung (seconds).
_STARTUP_S = 300.0
#: After a failure, how long restarted workers get to restore before the agent persists
#: the snapshots held in memory anyway (seconds).
_BREAKPOINT_GRACE_S = 10.0


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
    """

    def __init__(
        self,
        *,
        job: Job,
        job_id: str,
        node_id: int,
        client: MasterClient,
        log_dir: Path,
        accelerator: Any,
        nproc: int,
        storage: Any = None,
        echo: IO[str] | None = None,
    ) -> None:
        self.job = job
        self.job_id = job_id
        self.node_id = node_id
        self.client = client
        self.log_dir = log_dir
        self.node_dir = log_dir / f"node_{node_id}"
        self.accelerator = accelerator
        self.nproc = nproc
        self.echo = echo if echo is not None else sys.stdout
        self.workers: list[WorkerProcess] = []
        self._tails: dict[int, ProgressTail] = {}
        self._stop = threading.Event()
        self._signal: int | None = None
        self._shm_prefix = f"dlrover-{job_id}-n{node_id}-"
        self._standbys: list[Standby] = []
        self._breakpoint_due: float | None = None  # monotonic deadline of a pending breakpoint save
        self.saver = None
        if storage is not None:
            self.saver = CheckpointSaver(job_id=job_id, node_id=node_id, storage=storage,
                                         report=lambda endpoint, body: self.client.call(endpoint, body))

    # ----- entry -----------------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        """Forward SIGTERM/SIGINT: stop the workers with a grace period, then exit."""

        def handler(signum: int, _frame: object) -> None:
            self._signal = signum
            self._stop.set()

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def request_stop(self) -> None:
        """Ask the agent to stop its workers and exit (thread-safe)."""
        self._stop.set()

    def run(self) -> int:
        """Run until the master says stop; return the process exit code."""
        self.node_dir.mkdir(parents=True, exist_ok=True)
        stale = remove_segments(self._shm_prefix)
        if stale:
            log.warning("stale_segments_removed", node_id=self.node_id, segments=stale)
        self.client.call("register", {"node_id": self.node_id, "host": socket.gethostname(), "pid": os.getpid()})
        if self.saver is not None:
            self.saver.start()
        self._fill_standbys()
        try:
            while not self._stop.is_set():
                world = self._rendezvous()
                if world is None:
                    break
                if self._run_round(world) == "stop":
                    break
        except MasterUnavailableError as exc:
            log.error("master_unreachable", node_id=self.node_id, error=str(exc))
            return 1
        finally:
            self._stop_workers()
            for standby in self._standbys:
                standby.close()
            self._standbys = []
            if self.saver is not None:
                # the job ends before workers came back, or a signal (preemption, time limit,
                # requeue, cancel) stops this node: persist what memory holds
                if self._breakpoint_due is not None or self._signal is not None:
                    self.saver.request_breakpoint()
                self.saver.stop()
            removed = remove_segments(self._shm_prefix)
            log.debug("segments_removed", node_id=self.node_id, count=len(removed))
            try:
                self.client.call("exited", {"node_id": self.node_id})
            except Exception:  # the master may already be gone
                pass
        if self._signal is not None:
            log.info("agent_signalled", node_id=self.node_id, signal=signal.Signals(self._signal).name)
            return 128 + self._signal
        return 0

    # ----- rendezvous --------------------------------------------------------------------

    def _rendezvous(self) -> dict[str, Any] | None:
        answer = self.client.call("join", {"node_id": self.node_id, "nproc": self.nproc})
        if answer.get("action") == "stop":
            return None
        deadline = time.monotonic() + self.job.nodes.join_timeout_s
        while not self._stop.is_set():
            answer = self.client.call("poll", {"node_id": self.node_id})
            if answer["state"] == "ready":
                log.info("rendezvous_ready", node_id=self.node_id, round=answer["round"],
                         node_rank=answer["node_rank"], world_size=answer["world_size"])
                return answer
            if answer["state"] == "stop":
                return None
            self._breakpoint_tick(restored=False)
            if answer["state"] == "rejoin":
                self.client.call("join", {"node_id": self.node_id, "nproc": self.nproc})
            if answer["state"] == "check":
                result = self._node_check(answer)
                self.client.call("node_check", {"node_id": self.node_id, "check_round": answer["check_round"],
                                                "result": result})
                continue
            if time.monotonic() > deadline:
                raise RendezvousError(f"node {self.node_id}: no round formed within nodes.join_timeout_s="
                                      f"{self.job.nodes.join_timeout_s:g} s")
            self._stop.wait(0.02)
        return None

    def _node_check(self, order: dict[str, Any]) -> dict[str, Any]:
        """Run this node's part of a node check round (a subprocess in the check group)."""
        env = {**os.environ, "RANK": str(order["group_rank"]), "WORLD_SIZE": str(order["group_size"]),
               "MASTER_ADDR": str(order["store_host"]), "MASTER_PORT": str(order["store_port"]),
               "DLROVER_CHECK_PREFIX": order["prefix"], "DLROVER_ACCELERATOR": self.accelerator.name,
               "DLROVER_NODE_ID": str(self.node_id),
               **self.accelerator.worker_env(0, 1)}
        proc = subprocess.Popen([sys.executable, "-m", "dlrover_core.agent.node_check"], env=env, cwd=self.job.workdir,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + order["timeout_s"]
        stdout = stderr = ""
        while True:
            try:
                stdout, stderr = proc.communicate(timeout=self.job.failure.heartbeat_interval_s)
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() > deadline:
                    proc.kill()
                    stdout, stderr = proc.communicate()
                    break
                # keep heartbeating while the check runs, or the node looks lost
                self.client.call("heartbeat", {"node_id": self.node_id, "round": -1, "pid": os.getpid()})
        lines = [line for line in stdout.splitlines() if line.startswith("{")]
        result = json.loads(lines[-1]) if lines else {"ok": False, "error": (stderr or "no result")[-500:]}
        if proc.returncode is None or (time.monotonic() > deadline and not lines):
            result = {"ok": False, "error": f"timed out after {order['timeout_s']} s"}
        log.info("node_check_done", node_id=self.node_id, check_round=order["check_round"], group=order["group"],
                 ok=result.get("ok"), elapsed_s=result.get("elapsed_s"), error=result.get("error"))
        return result

    # ----- one round -----------------------------------------------------------------------

    def _start_workers(self, world: dict[str, Any]) -> None:
        round_dir = self.node_dir / f"round_{world['round']}"
        round_dir.mkdir(parents=True, exist_ok=True)
        argv = worker_argv(self.job)
        self.workers, self._tails = [], {}
        for local_rank in range(int(world["nproc"])):
            rank = int(world["rank_offset"]) + local_rank
            progress = round_dir / f"progress_rank{rank}.jsonl"
            env = {**os.environ, **worker_env(
                self.job, job_id=self.job_id, node_id=self.node_id, world=world, local_rank=local_rank,
                master_addr=self.client.addr, accelerator=self.accelerator, progress_file=str(progress),
                log_dir=str(self.log_dir), agent_pid=os.getpid(),
            ), "DLROVER_STACK_FILE": str(self._stack_file(int(world["round"]), rank))}
            standby = self._take_standby()
            worker = WorkerProcess(rank=rank, local_rank=local_rank, argv=argv, env=env, cwd=self.job.workdir,
                                   log_file=self.node_dir / f"rank_{rank}.log", echo=self.echo, standby=standby)
            self.workers.append(worker)
            self._tails[rank] = ProgressTail(progress, started=time.monotonic())
        if self.saver is not None:
            self.saver.set_ranks([w.rank for w in self.workers])
        log.info("workers_started", node_id=self.node_id, round=world["round"], ranks=[w.rank for w in self.workers],
                 pids=[w.pid for w in self.workers], warm=[w.warm for w in self.workers])

    # ----- warm restart -------------------------------------------------------------------

    def _standby_env(self) -> dict[str, str]:
        """What a standby imports torch with: the workers' values of the variables libraries
        read at import time."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "DLROVER_WATCH_PID": str(os.getpid())}
        if self.nproc > 1 and "OMP_NUM_THREADS" not in os.environ and "OMP_NUM_THREADS" not in self.job.env:
            env["OMP_NUM_THREADS"] = "1"
        env.update(self.accelerator.worker_env(0, self.nproc))
        env.update(self.job.env)
        return env

    def _fill_standbys(self) -> None:
        """Keep ``nproc`` warm standbys (Failure.warm_restart)."""
        if not self.job.failure.warm_restart:
            return
        self._standbys = [s for s in self._standbys if s.alive()]
        while len(self._standbys) < self.nproc:
            self._standbys.append(Standby(env=self._standby_env(), cwd=self.job.workdir))

    def _take_standby(self) -> Standby | None:
        while self._standbys:
            standby = self._standbys.pop(0)
            if standby.alive():
                return standby
        return None

    def _stack_file(self, round_index: int, rank: int) -> Path:
        return self.node_dir / f"stacks_round{round_index}_rank{rank}.txt"

    # ----- hangs ---------------------------------------------------------------------------

    def _hang_timeout_s(self) -> float | None:
        """``Failure.hang_timeout_s``, or derived once steps were seen: 20x the median step
        time of this node's ranks, at least 60 s. ``None``: not known yet (no detection).
        (The 20x / 60 s rule is ours: slow steps in a healthy job vary by a few x at most,
        and a minute is short next to the 30 minutes of gloo's default timeout.)"""
        if self.job.failure.hang_timeout_s is not None:
            return self.job.failure.hang_timeout_s
        times = sorted(t for tail in self._tails.values() for t in tail.step_times)
        if len(times) < 3:
            return None
        return max(60.0, 20 * times[len(times) // 2])

    def _hung(self) -> list[WorkerProcess]:
        """Live workers without progress for the hang timeout. Before a worker's first
        report (imports, data loading, restore) the timeout is at least ``_STARTUP_S``."""
        timeout = self._hang_timeout_s()
        if timeout is None:
            return []
        now = time.monotonic()
        hung = []
        for w in self.workers:
            tail = self._tails[w.rank]
            limit = timeout if tail.last_step >= 0 else max(timeout, _STARTUP_S)
            if w.poll() is None and now - tail.last_progress > limit:
                hung.append(w)
        return hung

    def _dump_stacks(self, round_index: int, workers: list[WorkerProcess]) -> list[str]:
        """Write each worker's Python stacks next to its log: py-spy when installed (it reads
        a stopped or stuck process from outside), else the worker's faulthandler (SIGUSR1)."""
        beside = Path(sys.executable).with_name("py-spy")  # installed in this venv, maybe not on PATH
        py_spy = shutil.which("py-spy") or (str(beside) if beside.exists() else None)
        written = []
        for w in workers:
            path = self._stack_file(round_index, w.rank)
            if py_spy:
                try:
                    out = subprocess.run([py_spy, "dump", "--pid", str(w.pid), "--nonblocking"], capture_output=True,
                                         text=True, timeout=20)
                    path.write_text(out.stdout + out.stderr)
                except (subprocess.TimeoutExpired, OSError) as exc:
                    path.write_text(f"py-spy failed: {exc}\n")
            else:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.pid, signal.SIGUSR1)
                time.sleep(1.0)
            written.append(str(path))
        return written

    def _on_hang(self, round_index: int, hung: list[WorkerProcess]) -> str:
        timeout = self._hang_timeout_s()
        stacks = self._dump_stacks(round_index, self.workers)
        log.warning("workers_hung", node_id=self.node_id, ranks=[w.rank for w in hung], timeout_s=timeout,
                    steps={w.rank: self._tails[w.rank].last_step for w in hung}, stacks=stacks)
        failures = [{"rank": w.rank, "local_rank": w.local_rank, "exit_code": None, "kind": "hang",
                     "detail": f"no progress for {timeout:g} s at step {self._tails[w.rank].last_step}; stacks: "
                               f"{self._stack_file(round_index, w.rank)}"} for w in hung]
        return self._report_failures(round_index, failures)

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

    def _drain(self) -> tuple[dict[int, int], list[dict[str, Any]]]:
        """New progress: every local rank's newest step, and rank 0's records."""
        records: list[dict[str, Any]] = []
        for rank, tail in self._tails.items():
            new = tail.read()
            if rank == 0:
                records.extend(new)
        steps = {rank: tail.last_step for rank, tail in self._tails.items() if tail.last_step >= 0}
        return steps, records

    def _heartbeat(self, round_index: int) -> str:
        steps, records = self._drain()
        answer = self.client.call("heartbeat", {
            "node_id": self.node_id, "round": round_index,
            "workers": {str(w.rank): w.pid for w in self.workers if w.poll() is None},
            "steps": {str(k): v for k, v in steps.items()}, "records": records, "pid": os.getpid(),
        })
        return answer["action"]

    def _run_round(self, world: dict[str, Any]) -> str:
        """Run one round's workers; return ``"restart"`` or ``"stop"``."""
        round_index = int(world["round"])
        self._start_workers(world)
        interval = self.job.failure.heartbeat_interval_s
        last_beat = 0.0
        reported_success = False
        while not self._stop.is_set():
            codes = [(w, w.poll()) for w in self.workers]
            failed = [(w, c) for w, c in codes if c not in (None, 0)]
            if failed:
                return self._on_failure(round_index, failed)
            hung = self._hung()
            if hung:
                return self._on_hang(round_index, hung)
            started = all(t.last_step >= 0 for t in self._tails.values())
            self._breakpoint_tick(restored=started)
            if self.job.failure.warm_restart and len(self._standbys) < self.nproc and started:
                self._fill_standbys()  # workers are past their start: prepare the next ones
            if not reported_success and all(c == 0 for _, c in codes):
                for w in self.workers:
                    w.join_output()
                if self.saver is not None:
                    self.saver.flush()  # the final checkpoint is committed before the job ends
                self._heartbeat(round_index)
                log.info("workers_succeeded", node_id=self.node_id, round=round_index)
                answer = self.client.call("succeeded", {"node_id": self.node_id, "round": round_index})
                reported_success = True
                if answer["action"] != "none":
                    return "stop" if answer["action"] == "stop" else "restart"
            now = time.monotonic()
            if now - last_beat >= interval:
                last_beat = now
                action = self._heartbeat(round_index)
                if action != "none":
                    log.info("master_ordered", node_id=self.node_id, action=action, round=round_index)
                    self._stop_workers()
                    self._report_late_exceptions(round_index)
                    if action == "restart":
                        self._save_at_breakpoint()
                    return action
            self._stop.wait(_POLL_S)
        return "stop"

    def _on_failure(self, round_index: int, failed: list[tuple[WorkerProcess, int]]) -> str:
        for w, code in failed:
            log.warning("worker_exited", node_id=self.node_id, rank=w.rank, local_rank=w.local_rank, exit_code=code)
        for w, _ in failed:
            w.join_output()
            self._tails[w.rank].read()  # an uncaught exception's record, if the worker wrote one
        failures = []
        for w, code in failed:
            exc = self._tails[w.rank].exception
            failures.append({"rank": w.rank, "local_rank": w.local_rank, "exit_code": code,
                             "kind": "exception" if exc else ("signal" if code < 0 else "exit"),
                             "exception": exc})
        return self._report_failures(round_index, failures)

    def _report_late_exceptions(self, round_index: int) -> None:
        """Workers that died of an exception while the master's restart order was on its way
        still tell the master what killed them (it looks for the same error on every rank)."""
        failures = []
        for rank, tail in self._tails.items():
            tail.read()
            if tail.exception is not None:
                failures.append({"rank": rank, "local_rank": rank - min(self._tails), "exit_code": None,
                                 "kind": "exception", "exception": tail.exception})
        if failures:
            self.client.call("failure", {"node_id": self.node_id, "round": round_index, "failures": failures})

    def _report_failures(self, round_index: int, failures: list[dict[str, Any]]) -> str:
        self._stop_workers()
        self._heartbeat(round_index)  # forward the last progress before the failure
        answer = self.client.call("failure", {"node_id": self.node_id, "round": round_index, "failures": failures})
        # the master has told everyone to restart; persist what memory holds before rejoining
        self._save_at_breakpoint()
        return "stop" if answer["action"] == "stop" else "restart"

