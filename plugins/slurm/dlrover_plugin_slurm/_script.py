"""The sbatch script of a job: what ``SlurmScheduler.dryrun`` shows and ``submit`` hands to sbatch.

One batch job per dlrover job. The script runs on the first node of the allocation and:

1. moves aside what a previous run of the same Slurm job left (a requeued job runs the script
   again: ``SLURM_RESTART_COUNT`` > 0) — the new run resumes from the latest committed
   checkpoint;
2. starts the job master there (``python -m dlrover_core.master``), restarting it up to
   ``MASTER_RESTARTS`` times if it dies without a result (it resumes from its journal);
3. starts one elastic agent per node with ``srun --ntasks-per-node=1`` (``python -m
   dlrover_core.agent``, node id = ``SLURM_NODEID``); the master relaunches a lost node's agent
   as a new ``srun`` step (``SlurmScheduler.relaunch_node``). Each srun task is
   :mod:`dlrover_plugin_slurm.node_task`, which runs the agent and, if a signal (SIGKILL, the
   OOM killer) ended it, removes the shared-memory segments it left on that node;
4. on Slurm's warning signal (``--signal=B:USR1@WARN_S``: the time limit is near) requeues the
   job; every process then gets SIGTERM, and each agent saves its newest in-memory snapshots
   at the breakpoint before it exits;
5. exits 0 only if the master's result is SUCCEEDED (so Slurm's own state agrees).
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from dlrover_core import JobSpec, JobSpecError
from dlrover_core.backend import control_plane, env, rundir

__all__ = ["MASTER_RESTARTS", "WARN_S", "agent_argv", "node_task_argv", "render_sbatch"]

#: Seconds before the time limit at which Slurm sends the warning signal (sbatch --signal).
#: Slurm may send it up to 60 s earlier than asked (sbatch(1), --signal).
WARN_S = 120
#: How often the batch script restarts a master that died without writing a result.
MASTER_RESTARTS = 3
#: Seconds the batch script waits for the master to listen before it gives up.
MASTER_LISTEN_TIMEOUT_S = 120
#: Seconds the batch script gives the agents to exit once the master has its result.
AGENTS_EXIT_S = 60

q = shlex.quote

# shell expansions kept unquoted in command lines
_PORT, _HOST, _NODE_ID, _ADDR = '"$MASTER_PORT"', '"$MASTER_HOST"', '"$SLURM_NODEID"', f'"${env.MASTER_ADDR}"'


def agent_argv(python: str, job_id: str, node_id: str, master_addr: str, log_dir: str) -> list[str]:
    """The agent's command line (the same as the local scheduler's)."""
    return list(control_plane.agent_argv(python, job_id=job_id, node_id=node_id, master_addr=master_addr,
                                         log_dir=log_dir))


def node_task_argv(python: str, job_id: str, node_id: str, master_addr: str, log_dir: str) -> list[str]:
    """The srun task of a node: :mod:`dlrover_plugin_slurm.node_task`, which runs the agent
    (:func:`agent_argv`) and removes the node's shared memory when the agent has ended."""
    return list(control_plane.agent_argv(python, job_id=job_id, node_id=node_id, master_addr=master_addr,
                                         log_dir=log_dir, module="dlrover_plugin_slurm.node_task"))


def _join(argv: Sequence[str], raw: Sequence[str] = ()) -> str:
    """Shell words for ``argv``, quoted, except those in ``raw`` (shell expansions kept as is)."""
    return " ".join(a if a in raw else q(a) for a in argv)


def render_sbatch(
    job: JobSpec,
    *,
    job_id: str,
    log_dir: str,
    python: str,
    gres: str | None,
    sbatch_options: dict[str, str] | None = None,
    extra_env: dict[str, str] | None = None,
) -> str:
    """The complete sbatch script for ``job`` (already resolved: absolute workdir and log_dir).

    Args:
        job_id: the run's id (also the Slurm job name).
        log_dir: the run's log directory (on a filesystem every node shares).
        python: the interpreter every node runs (same path on every node).
        gres: ``--gres`` value (``"gpu:8"``), or ``None`` for none.
        sbatch_options: more ``#SBATCH --<name>=<value>`` lines (partition, account, time...),
            after the node and device requests.
        extra_env: more variables exported to the master and agents.
    """
    nodes = job.nodes
    elastic = nodes.min != nodes.max
    variables = control_plane.job_env(job, job_id=job_id, log_dir=log_dir, sort_keys=True)
    sbatch = [
        f"--job-name={job_id}",
        f"--nodes={nodes.min}-{nodes.max}" if elastic else f"--nodes={nodes.max}",
        "--ntasks-per-node=1",
        "--exclusive",
    ]
    if gres:
        sbatch.append(f"--gres={gres}")
    sbatch += [f"--{name}={value}" for name, value in (sbatch_options or {}).items()]
    sbatch += [
        f"--chdir={job.workdir}",
        f"--output={log_dir}/{rundir.SLURM_OUT}",
        "--open-mode=append",
        "--requeue",
        f"--signal=B:USR1@{WARN_S}",
    ]
    if elastic:
        sbatch.append("--no-kill")  # a failed node does not end the job: it goes on with fewer
    for opt in sbatch:
        if any(c.isspace() or c in "'\"" for c in opt):
            raise JobSpecError("workdir/log_dir", opt, "paths without spaces or quotes (sbatch reads #SBATCH lines "
                                                       "word by word)")
    lines = [
        "#!/bin/bash",
        f"# dlrover job {job_id}, made by dlrover-plugin-slurm: the master runs in this script on the",
        "# first node of the allocation; srun starts one elastic agent per node.",
        *(f"#SBATCH {opt}" for opt in sbatch),
        "",
        "set -u",
        *(f"export {key}={q(variables[key])}" for key in (env.JOB_ID, env.LOG_DIR, env.JOB_SPEC, "PYTHONUNBUFFERED")),
    ]
    for key in sorted(extra_env or {}):
        lines.append(f"export {key}={q((extra_env or {})[key])}")
    master_argv = list(control_plane.master_argv(python, job_id=job_id, host="0.0.0.0", port=_PORT, store_host=_HOST,
                                                 log_dir=log_dir))
    agent = node_task_argv(python, job_id, _NODE_ID, _ADDR, log_dir)
    agent_cmd = "exec " + _join(agent, raw=(_NODE_ID, _ADDR))
    srun_nodes = '"$SLURM_JOB_NUM_NODES"' if elastic else str(nodes.max)
    lines += [
        f"LOG_DIR={q(log_dir)}",
        f'mkdir -p "$LOG_DIR/{rundir.SLURM_DIR}"',
        "",
        "# A requeued run (time limit, preemption, node failure) starts over from the latest",
        "# committed checkpoint: keep what the previous run left aside.",
        'if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then',
        '    previous="$LOG_DIR/run_$((SLURM_RESTART_COUNT - 1))"',
        '    mkdir -p "$previous"',
        f"    for f in {rundir.RESULT} {rundir.GOODPUT} {rundir.JOURNAL}; do",
        '        if [ -e "$LOG_DIR/$f" ]; then mv "$LOG_DIR/$f" "$previous/"; fi',
        "    done",
        '    echo "dlrover: run $SLURM_RESTART_COUNT of Slurm job $SLURM_JOB_ID (requeued)"',
        "fi",
        "",
        "# The master, here on the first node, reachable by every node at its Slurm address.",
        'MASTER_HOST=${DLROVER_SLURM_MASTER_HOST:-$(scontrol show node --oneliner "$SLURMD_NODENAME" '
        "| sed -n 's/.* NodeAddr=\\([^ ]*\\).*/\\1/p')}",
        'MASTER_HOST=${MASTER_HOST:-$(hostname)}',
        f"MASTER_PORT=$({q(python)} -c 'import socket; s = socket.socket(); s.bind((\"\", 0)); "
        "print(s.getsockname()[1])')",
        f'export {env.MASTER_ADDR}="$MASTER_HOST:$MASTER_PORT"',
        f'echo "${env.MASTER_ADDR}" > "$LOG_DIR/{rundir.SLURM_MASTER_ADDR}"',
        "start_master() {",
        f'    {_join(master_argv, raw=(_PORT, _HOST))} >> "$LOG_DIR/{rundir.MASTER_LOG}" 2>&1 &',
        "    MASTER_PID=$!",
        "}",
        "start_master",
        "waited=0",
        'until (exec 3<>"/dev/tcp/$MASTER_HOST/$MASTER_PORT") 2>/dev/null; do',
        f'    if ! kill -0 "$MASTER_PID" 2>/dev/null || [ "$waited" -ge {MASTER_LISTEN_TIMEOUT_S * 5} ]; then',
        f'        echo "dlrover: the master did not start; see $LOG_DIR/{rundir.MASTER_LOG}" >&2',
        '        kill "$MASTER_PID" 2>/dev/null',
        "        exit 1",
        "    fi",
        "    sleep 0.2; waited=$((waited + 1))",
        "done",
        "",
        "# One agent per node; the node id is the node's index in the allocation. The task runs the",
        "# agent, and removes the node's shared memory if a signal (SIGKILL, OOM) ended the agent.",
        f"srun --nodes={srun_nodes} --ntasks-per-node=1 --kill-on-bad-exit=0 --job-name=dlrover-agents \\",
        f'    --output="$LOG_DIR/{rundir.node_log("%n")}" --open-mode=append \\',
        f"    bash -c {q(agent_cmd)} &",
        "AGENTS_PID=$!",
        "",
        "# Slurm's warning before the time limit: requeue now. Every process then gets SIGTERM;",
        "# agents save their newest snapshots at the breakpoint, and the next run resumes from them.",
        "on_warning() {",
        '    echo "dlrover: Slurm signalled the end of the time limit (SIGUSR1): requeueing job $SLURM_JOB_ID"',
        '    scontrol requeue "$SLURM_JOB_ID"',
        "}",
        "trap on_warning USR1",
        "",
        "restarts=0",
        "while true; do",
        '    while kill -0 "$MASTER_PID" 2>/dev/null; do wait "$MASTER_PID"; done',
        f'    if [ -e "$LOG_DIR/{rundir.RESULT}" ]; then break; fi',
        f'    if [ "$restarts" -ge {MASTER_RESTARTS} ]; then',
        '        echo "dlrover: the master died $restarts times without a result" >&2',
        "        exit 1",
        "    fi",
        "    restarts=$((restarts + 1))",
        '    echo "dlrover: the master exited without a result; restart $restarts (it resumes from its journal)"',
        "    start_master",
        "done",
        "",
        "# The agents stop once the master has its result; Slurm ends any step left when this exits.",
        f"for _ in $(seq {AGENTS_EXIT_S * 5}); do",
        '    kill -0 "$AGENTS_PID" 2>/dev/null || break',
        "    sleep 0.2",
        "done",
        f"exec {q(python)} -c 'import json, sys; sys.exit(json.load(open(sys.argv[1]))[\"state\"] != \"SUCCEEDED\")' "
        f'"$LOG_DIR/{rundir.RESULT}"',
        "",
    ]
    return "\n".join(lines)
