"""``dlrover run`` against ``torchrun``: the same command lines, the same workers.

Every torchrun flag of the installed torch (``torch.distributed.run.get_args_parser()``) is
declared by ``dlrover run``: accepted with torchrun's meaning and default, or rejected with
one line naming the flag and why (``test_every_torchrun_flag_is_declared``, ...).

``test_same_workers_as_torchrun`` runs each command line of ``CASES`` under ``torchrun FLAGS
torchrun_env.py out ARGS`` and ``dlrover run FLAGS torchrun_env.py out ARGS`` (each in its own
directory; two processes for the two-host cases) and compares, per rank and attempt, what
tests/scripts/torchrun_env.py wrote: the torch elastic variables (RANK, LOCAL_RANK,
WORLD_SIZE, GROUP_*, ROLE_*, MASTER_*, TORCHELASTIC_*, OMP_NUM_THREADS, ...), sys.argv,
whether it ran as __main__, its working directory, the all-reduce's sum; and which workers'
lines the console shows, on which stream; and the exit codes. Any difference fails the test
unless ``DIFFERENCES`` (or the case) lists it with the reason: ``deliberate=True`` for a
choice of dlrover's, ``deliberate=False`` for a gap known and reported (a bug of ours not
fixed yet: when it is, the entry no longer matches and must go). docs/torchrun.md says the
same for people; ``test_docs_table_lists_every_torchrun_flag`` keeps the two in step.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import click
import psutil
import pytest
from click.testing import CliRunner
from helpers import ROOT, SCRIPTS

from dlrover_core import cli, run_command, torchrun

BIN = Path(sys.executable).parent
TORCHRUN = BIN / "torchrun"
DLROVER = BIN / "dlrover"  # the installed command: `python -m` would put the directory on sys.path
SCRIPT = SCRIPTS / "torchrun_env.py"
MODULE = "compat_env_mod"  # -m: the script copied into the launcher's working directory
EXECUTABLE = "./compat_env_exec"  # --no-python: the script with a #! line, ditto
KINDS = ("torchrun", "dlrover")
UNSET = "<unset>"
JOB_ID = r"[a-z0-9-]+-\d{8}-\d{6}-[0-9a-f]{4}"  # dlrover_core.scheduler_backend.new_job_id
UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
LAUNCH_TIMEOUT_S = 120


@dataclass(frozen=True, eq=False)
class Difference:
    """A difference between what torchrun's and dlrover's workers see, known and explained.

    ``item`` (a regular expression) names what differs: ``env:NAME`` (a variable),
    ``console:out:N`` / ``console:err:N`` (on which of the launcher's streams a line that local
    rank N wrote to its stdout / stderr shows, or ``<unset>``: not shown), ``argv``,
    ``as_main``, ``cwd``, ``sum``, ``file:NAME``, ``exit``. ``torchrun`` and ``dlrover`` are
    regular expressions the two values match in full (``<unset>``: not set); ``when`` limits
    it to some cases.
    """

    item: str
    torchrun: str
    dlrover: str
    reason: str
    deliberate: bool = True
    when: Callable[[Case], bool] = lambda case: True

    def explains(self, case: Case, item: str, t: str, d: str) -> bool:
        return (re.fullmatch(self.item, item) is not None and re.fullmatch(self.torchrun, t) is not None
                and re.fullmatch(self.dlrover, d) is not None and self.when(case))


@dataclass(frozen=True, eq=False)
class Case:
    """One command line: ``FLAGS ENTRY out ARGS``. ``{port}`` in a flag is a free port (the
    same for every host of the case); ``hosts`` gives each host's own flags (two: two launcher
    processes on loopback, as two hosts); ``entry`` is ``script`` (tests/scripts/torchrun_env.py),
    ``module`` (its copy in the working directory, run with ``-m``) or ``exec`` (an executable
    copy, ``--no-python``)."""

    id: str
    flags: tuple[str, ...] = ()
    args: tuple[str, ...] = ()
    entry: str = "script"
    hosts: tuple[tuple[str, ...], ...] = ((),)
    differences: tuple[Difference, ...] = ()

    def gives(self, flag: str) -> bool:
        return any(f == flag or f.startswith(flag + "=") for f in self.flags)


def _without(flag: str) -> Callable[[Case], bool]:
    return lambda case: not case.gives(flag)


#: What differs between torchrun's workers and dlrover's in every case where it applies.
DIFFERENCES = (
    Difference("env:MASTER_PORT", r"\d+", r"\d+",
               "dlrover's workers meet on a TCPStore the job master serves, fresh for every rendezvous round on a "
               "free port (a restarted world never meets stale keys); torchrun's is the store its group-rank-0 "
               "agent opens on a free port (c10d, and one host without --master-port) or --master-port (static). "
               "--rdzv-endpoint / --master-addr:--master-port is where dlrover's job master listens."),
    Difference("env:MASTER_ADDR", re.escape(socket.getfqdn()), r"127\.0\.0\.1",
               "c10d (and torchrun's one-host default, --standalone): torchrun's store is on the group-rank-0 "
               "host, at its FQDN (or --local-addr); dlrover's is served by the job master, at the host of "
               "--rdzv-endpoint (127.0.0.1 for one host). Static: both --master-addr",
               when=lambda case: not case.gives("--local-addr") and not case.gives("--master-port")),
    Difference("env:TORCHELASTIC_RUN_ID", f"{UUID}|none", JOB_ID,
               "without --rdzv-id torchrun's id is a uuid4 (one host) or 'none' (static); dlrover's is the job id "
               "it generates (<name>-<date>-<time>-<hex>), which names the run directory <log-dir>/<job id> "
               "and `dlrover status|logs|cancel <job id>`",
               when=_without("--rdzv-id")),
    Difference("env:TORCHELASTIC_MAX_RESTARTS", "0", "3",
               "the default of --max-restarts: torchrun 0, dlrover 3 (a job-wide budget of recoveries, all hosts "
               "together: recovering is what dlrover is for)",
               when=_without("--max-restarts")),
    Difference(r"console:err:\d+", "stderr", "stdout",
               "dlrover's agent reads each worker's stdout and stderr as one stream (in order, into "
               "rank_<r>.log) and shows it on its stdout with a '[rank N] ' prefix; torchrun's workers write to "
               "its stderr"),
    Difference("env:TORCHELASTIC_ERROR_FILE", r".+/error\.json", r".+/node_\d+/round_\d+/error_rank\d+\.json",
               "both give each worker (and each of its incarnations) a file for torch's @record, and read it back "
               "for the failure's root cause; torchrun's is <tmp>/.../attempt_N/<local rank>/error.json, "
               "dlrover's lies in the run directory beside the worker's log (node_<id>/round_<R>/error_rank<r>.json; "
               "a live replacement's: error_rank<r>_r<k>.json)"),
    Difference("env:CUDA_VISIBLE_DEVICES", r"\d+", ".*",
               "--virtual-local-rank: torchrun narrows CUDA_VISIBLE_DEVICES to the worker's device whatever the "
               "device; dlrover narrows the accelerator's own visibility variable (cuda's is CUDA_VISIBLE_DEVICES), "
               "and cpu, which has none, keeps it as it was (LOCAL_RANK is 0 in both)",
               when=lambda case: case.gives("--virtual-local-rank")),
    Difference("env:TORCH_NCCL_ASYNC_ERROR_HANDLING", "1", UNSET,
               "GAP, reported: torchrun sets it to 1 (unless set) in every worker; dlrover leaves torch's own "
               "default. It changes how NCCL failures end a GPU worker, which the live recovery "
               "(dlrover_core/train/live.py) depends on: to be decided with a GPU test, not here",
               deliberate=False),
)

_TWO_HOSTS_C10D = ("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:{port}",
                   "--rdzv-id", "compat2")
_TWO_HOSTS_STATIC = ("--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", "{port}")

CASES = [
    Case("defaults", ("--nproc-per-node", "2")),
    Case("standalone-role-filter", ("--standalone", "--nproc-per-node", "2", "--role", "trainer",
                                    "--local-ranks-filter", "1")),
    Case("c10d-one-host", ("--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                           "127.0.0.1:{port}", "--rdzv-id", "compat1", "--rdzv-conf", "join_timeout=60",
                           "--local-addr", "127.0.0.1")),
    Case("module", ("--nproc-per-node", "2", "-m"), entry="module"),
    Case("no-python", ("--nproc-per-node", "2", "--no-python"), entry="exec"),
    Case("run-path-start-method-signals-vlr", ("--nproc-per-node", "2", "--run-path", "--start-method", "fork",
                                               "--signals-to-handle", "SIGTERM,SIGINT", "--virtual-local-rank")),
    Case("max-restarts-monitor-shutdown", ("--nproc-per-node", "2", "--max-restarts", "2", "--monitor-interval",
                                           "0.5", "--shutdown-timeout", "5"), args=("--fail-first",)),
    Case("log-dir-redirects-tee", ("--nproc-per-node", "2", "--log-dir", "logs", "-r", "0:3", "-t", "1:3")),
    Case("redirects-stdout", ("--nproc-per-node", "2", "--redirects", "0:1"), differences=(
        Difference("console:err:0", "stderr", UNSET,
                   "-r/-t with 1 or 2 (one stream): dlrover reads a worker's stdout and stderr as one stream, so "
                   "it keeps both of that rank's streams off the console (both are in rank_<r>.log)"),)),
    Case("two-hosts-c10d", _TWO_HOSTS_C10D, args=("--init",), hosts=((), ())),
    Case("two-hosts-static", _TWO_HOSTS_STATIC, args=("--init",), hosts=(("--node-rank", "0"), ("--node-rank", "1"))),
]


# ----- running both launchers ----------------------------------------------------------------------


@dataclass
class Outcome:
    """What one launcher's run of a case left: the items compared (name -> value)."""

    items: dict[str, str] = field(default_factory=dict)
    transcript: str = ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _clean_env() -> dict[str, str]:
    """This environment without anything either launcher reads or sets for its workers."""
    drop = ("PET_", "TORCHELASTIC_", "DLROVER_", "MASTER_", "GROUP_", "ROLE_", "TORCH_NCCL_")
    names = {"OMP_NUM_THREADS", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GLOO_SOCKET_IFNAME"}
    return {k: v for k, v in os.environ.items() if not k.startswith(drop) and k not in names}


def _prepare(case: Case, cwd: Path) -> str:
    (cwd / "out").mkdir(parents=True)
    if case.entry == "module":
        shutil.copy(SCRIPT, cwd / f"{MODULE}.py")
        return MODULE
    if case.entry == "exec":
        path = cwd / EXECUTABLE
        path.write_text(f"#!{sys.executable}\n" + SCRIPT.read_text())
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
        return EXECUTABLE
    return str(SCRIPT)


def _launch(kind: str, case: Case, root: Path, port: int) -> Outcome:
    cwd = root / case.id / kind
    entry = _prepare(case, cwd)
    command = [str(TORCHRUN)] if kind == "torchrun" else [str(DLROVER), "run"]
    flags = [f.format(port=port) for f in case.flags]
    procs = []
    for i, host in enumerate(case.hosts):
        with open(cwd / f"host{i}.stdout", "wb") as o, open(cwd / f"host{i}.stderr", "wb") as e:
            procs.append(subprocess.Popen([*command, *flags, *host, entry, "out", *case.args], cwd=cwd,
                                          # (TMPDIR: torchrun's torchelastic_* log dirs stay in the test's directory)
                                          env={**_clean_env(), "TMPDIR": str(cwd)}, stdin=subprocess.DEVNULL,
                                          stdout=o, stderr=e,
                                          start_new_session=True))
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:  # the launcher and every process it started (some in their own sessions)
            for proc in [*psutil.Process(p.pid).children(recursive=True), psutil.Process(p.pid)]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    proc.kill()
            codes.append(p.wait())
    return _collect(kind, case, cwd, codes)


def _collect(kind: str, case: Case, cwd: Path, codes: list[int]) -> Outcome:
    """What the launcher's run in ``cwd`` left: exit codes, console lines, the workers' files."""
    outcome = Outcome()
    outcome.items["exit"] = ",".join(map(str, codes))
    transcript, console = [], {}
    for i, host in enumerate(case.hosts):
        out, err = cwd / f"host{i}.stdout", cwd / f"host{i}.stderr"
        for stream, path in (("stdout", out), ("stderr", err)):
            text = path.read_text(errors="replace")
            transcript.append(f"--- {kind} {' '.join(host)} {stream}\n{text[-3000:]}")
            for worker_stream, local_rank in re.findall(r"worker-(out|err) local_rank=(\d+)", text):
                console.setdefault(f"console:{worker_stream}:{local_rank}", set()).add(stream)
    outcome.items.update({item: ",".join(sorted(streams)) for item, streams in console.items()})
    outcome.transcript = "\n".join(transcript)
    for path in sorted((cwd / "out").glob("rank_*.json")):
        outcome.items[f"file:{path.name}"] = "present"
        record = json.loads(path.read_text().replace(str(cwd), "<cwd>"))
        where = path.stem
        for name, value in record["env"].items():
            outcome.items[f"{where} env:{name}"] = UNSET if value is None else str(value)
        outcome.items[f"{where} argv"] = json.dumps(record["argv"])
        for name in ("as_main", "cwd", "sum"):
            if name in record:
                outcome.items[f"{where} {name}"] = str(record[name])
    return outcome


@pytest.fixture(scope="module")
def outcomes(request, tmp_path_factory):
    """Both launchers' outcome of every selected case, two at a time (a two-host case is two
    launchers at once): ``{(case id, kind): Future[Outcome]}``."""
    if not (TORCHRUN.exists() and DLROVER.exists()):
        pytest.skip(f"needs torchrun and dlrover next to {sys.executable}")
    root = tmp_path_factory.mktemp("torchrun-compat")
    selected = [item.callspec.params["case"] for item in request.session.items
                if item.module is request.module and "case" in getattr(getattr(item, "callspec", None), "params", {})]
    futures: dict[tuple[str, str], Future[Outcome]] = {}
    with ThreadPoolExecutor(2, thread_name_prefix="compat") as pool:
        for case in selected:
            for kind in KINDS:  # each launcher its own port: the two runs overlap
                futures[case.id, kind] = pool.submit(_launch, kind, case, root, _free_port())
        yield futures
        for f in futures.values():
            f.cancel()


def _compare(case: Case, t: Outcome, d: Outcome) -> tuple[list[str], list[str], set[int]]:
    """(the unexplained differences, the explained ones with their reason, the ids of the
    Differences that explained some)."""
    unexplained, explained, used = [], [], set()
    for item in sorted(set(t.items) | set(d.items)):
        tv, dv = t.items.get(item, UNSET), d.items.get(item, UNSET)
        if tv == dv:
            continue
        name = item.split(" ", 1)[-1]  # "rank_0_attempt_0 env:RANK" -> "env:RANK"
        why = next((x for x in (*case.differences, *DIFFERENCES) if x.explains(case, name, tv, dv)), None)
        line = f"{item}: torchrun {tv!r}, dlrover {dv!r}"
        if why is None:
            unexplained.append(line)
        else:
            used.add(id(why))
            explained.append(f"{line} ({'deliberate' if why.deliberate else 'known gap'})")
    return unexplained, explained, used


@pytest.mark.slow
@pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S * len(CASES))
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_same_workers_as_torchrun(case, outcomes):
    t = outcomes[case.id, "torchrun"].result()
    d = outcomes[case.id, "dlrover"].result()
    assert t.items["exit"] == ",".join("0" * len(case.hosts)), f"torchrun failed:\n{t.transcript}"
    assert any(k.startswith("file:") for k in t.items), f"torchrun's workers wrote nothing:\n{t.transcript}"
    unexplained, explained, used = _compare(case, t, d)
    print("\n".join(explained))
    assert not unexplained, ("differences from torchrun not in DIFFERENCES:\n  " + "\n  ".join(unexplained)
                             + f"\n{d.transcript}")
    assert all(id(x) in used for x in case.differences), "a difference the case lists is not there (any more)"
    if "--init" in case.args:
        assert {v for k, v in d.items.items() if k.endswith(" sum")} == {"3.0"}  # 1 + 2: one world of two


@pytest.mark.slow
@pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S * len(CASES))
def test_every_difference_is_still_there(request, outcomes):
    """Each entry of DIFFERENCES explains a difference in some case: one that no longer does
    (a gap fixed, a default changed) goes, from here and from docs/torchrun.md."""
    if len({case for case, _ in outcomes}) < len(CASES):
        pytest.skip("runs with every case")
    used = set()
    for case in CASES:
        used |= _compare(case, outcomes[case.id, "torchrun"].result(), outcomes[case.id, "dlrover"].result())[2]
    assert [x.item for x in DIFFERENCES if id(x) not in used] == []


def test_cases_cover_every_accepted_flag():
    """Each accepted torchrun flag is on a command line of CASES (but --event-log-handler: its
    one accepted value is the default; and --numa-binding, which needs GPUs: where there is none
    both launchers refuse it, tests/test_worker_placement.py)."""
    used = {f for case in CASES for f in (*case.flags, *(f for h in case.hosts for f in h))}
    unused = {names[0] for dest, names in _torch_options().items() if dest not in _rejected_dests()
              and not used & set(names)}
    assert unused == {"--event-log-handler", "--numa-binding"}


# ----- the flags ---------------------------------------------------------------------------------


def _torch_options() -> dict[str, tuple[str, ...]]:
    """torchrun's options: dest -> option strings (long names first)."""
    from torch.distributed.run import get_args_parser

    return {a.dest: tuple(sorted(a.option_strings, key=lambda s: (not s.startswith("--"), s)))
            for a in get_args_parser()._actions if a.option_strings and a.dest != "help"}


def _torch_actions() -> dict[str, object]:
    from torch.distributed.run import get_args_parser

    return {a.dest: a for a in get_args_parser()._actions if a.option_strings and a.dest != "help"}


def _ours() -> dict[str, click.Option]:
    return {p.name: p for p in run_command.run.params if isinstance(p, click.Option)}


def _rejected_dests() -> set[str]:
    return {flag[2:].replace("-", "_") for flag in torchrun.REJECTED_FLAGS}


#: Rejected values of accepted flags: (the command line, what the one line must name).
REJECTED_VALUES = [
    (["--event-log-handler", "console"], "--event-log-handler"),
    (["--rdzv-backend", "etcd"], "--rdzv-backend"),
    (["--rdzv-backend", "etcd-v2"], "--rdzv-backend"),
]

#: Defaults that differ from torchrun's, with why (docs/torchrun.md says the same).
DEFAULT_DIFFERENCES = {
    "max_restarts": "dlrover's budget of recoveries is job-wide (all hosts) and recovering is the point: 3, not 0",
    "monitor_interval": "it sets the agent's heartbeat to the job master; unset, it grows with the job size "
                        "(dlrover_core.spec.auto_heartbeat) instead of torchrun's 0.1 s polling",
    "log_dir": "dlrover always keeps the logs: <log-dir>/<job id>/, 'dlrover-runs' in the working directory",
    "node_rank": "unset: c10d lets the job master assign it; static with one node is 0; static with more "
                 "nodes asks for it instead of making every host rank 0",
}


def test_every_torchrun_flag_is_declared():
    """Every option of torch.distributed.run.get_args_parser() (both spellings) is an option of
    `dlrover run`: a new torch flag fails here until it is accepted or rejected."""
    ours = _ours()
    for dest, names in _torch_options().items():
        assert dest in ours, f"torchrun's {names[0]} is not declared by dlrover run"
        declared = set(ours[dest].opts) | set(ours[dest].secondary_opts)
        assert set(names) <= declared, f"{names[0]}: torchrun spells it {names}, dlrover run {sorted(declared)}"
        rejected = dest in _rejected_dests()
        assert ours[dest].hidden == rejected, f"{names[0]}: hidden exactly when rejected"
    assert set(torchrun.REJECTED_FLAGS) <= {names[0] for names in _torch_options().values()}


def test_accepted_flags_have_torchruns_defaults_and_environment_variables():
    """Same default as torchrun's unless DEFAULT_DIFFERENCES says why; the PET_* variable
    torchrun reads for a flag is read by dlrover run too (a rejected flag set that way is
    rejected, not ignored)."""
    ours, differing = _ours(), {}
    ctx = click.Context(run_command.run)
    for dest, action in _torch_actions().items():
        mine = ours[dest]
        if type(action).__name__ in ("env", "check_env"):  # torch's actions that read PET_<DEST>
            assert mine.envvar == f"PET_{dest.upper()}", f"{action.option_strings[0]}: reads {mine.envvar}"
        if dest in _rejected_dests():
            continue
        default = mine.get_default(ctx)
        if default != action.default:
            differing[dest] = (action.default, default)
    assert set(differing) == set(DEFAULT_DIFFERENCES), differing


def test_nproc_per_node_cpu_counts_cores_as_torchrun():
    from torch.distributed.run import determine_local_world_size

    assert torchrun.nproc_per_node("cpu") == determine_local_world_size("cpu")


@pytest.mark.parametrize("flag", sorted(torchrun.REJECTED_FLAGS))
def test_rejected_flags_are_one_line_naming_the_flag(flag, tmp_path):
    spellings = [flag, "--" + flag[2:].replace("-", "_")]
    for spelling in spellings:
        _assert_refused([spelling, "x"], flag, tmp_path)
    dest = flag[2:].replace("-", "_").upper()
    if flag != "--logs-specs":  # torch reads it from the command line only
        _assert_refused([], flag, tmp_path, env={f"PET_{dest}": "1"})


@pytest.mark.parametrize(("argv", "flag"), REJECTED_VALUES, ids=[" ".join(a) for a, _ in REJECTED_VALUES])
def test_rejected_values_are_one_line_naming_the_flag(argv, flag, tmp_path):
    _assert_refused(argv, flag, tmp_path)


def _assert_refused(argv: list[str], flag: str, tmp_path: Path, env: dict[str, str] | None = None) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    result = CliRunner().invoke(cli.main, ["run", *argv, str(script)], env=env)
    assert result.exit_code == 2, (argv, result.output)
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and flag in errors[0] and "not supported" in errors[0], result.output


# ----- docs/torchrun.md ----------------------------------------------------------------------------


def _doc_rows() -> dict[str, tuple[str, str]]:
    """docs/torchrun.md's flag table: first flag -> (status, the rest of the row)."""
    rows = {}
    for line in (ROOT / "docs" / "torchrun.md").read_text().splitlines():
        m = re.match(r"\|\s*`(-[-\w]+)[^|]*\|\s*([^|]+?)\s*\|(.*)\|\s*$", line)
        if m:
            rows[m.group(1)] = (m.group(2), m.group(3))
    return rows


def test_docs_table_lists_every_torchrun_flag():
    """docs/torchrun.md has one row per torchrun flag; the rejected ones are exactly those
    dlrover run rejects; each default that differs and each difference of DIFFERENCES is there."""
    rows = _doc_rows()
    long_names = {names[0]: dest for dest, names in _torch_options().items()}
    assert set(rows) == set(long_names)
    statuses = {status for status, _ in rows.values()}
    assert statuses <= {"accepted", "accepted, differs", "rejected"}, statuses
    assert {f for f, (status, _) in rows.items() if status == "rejected"} == set(torchrun.REJECTED_FLAGS)
    for flag, dest in long_names.items():
        if dest in DEFAULT_DIFFERENCES:
            assert rows[flag][0] == "accepted, differs", flag
    for _, flag in REJECTED_VALUES:
        assert rows[flag][0] == "accepted, differs", flag
    text = (ROOT / "docs" / "torchrun.md").read_text()
    for x in DIFFERENCES:
        name = x.item.split(":", 1)[1] if x.item.startswith("env:") else None
        if name:
            assert name in text, f"docs/torchrun.md does not mention {name}"
