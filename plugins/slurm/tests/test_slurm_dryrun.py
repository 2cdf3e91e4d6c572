"""The slurm backend's dry run: the exact sbatch script, compared with a golden file, and pure.

Set ``DLROVER_UPDATE_GOLDEN=1`` to rewrite the golden files after an intended change.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dlrover_core import Job, hookimpl
from dlrover_core.accelerators import Accelerator, DeviceReport, NodeCheckResult
from dlrover_core.errors import JobSpecError
from dlrover_core.plugins import get_host
from dlrover_core.scheduler_backend import Capabilities
from dlrover_core.spec import Checkpoint, Failure
from dlrover_plugin_slurm import SlurmCli, SlurmScheduler, __version__

GOLDEN = Path(__file__).resolve().parent / "golden"
TINY = Path(__file__).resolve().parents[3] / "tests" / "scripts" / "tiny_train.py"


class FakeGpu(Accelerator):
    """An accelerator whose devices Slurm knows as GRES ``gpu``; never probed by a dry run."""

    name = "fakegpu"
    torch_device_type = "cpu"
    dist_backend = "gloo"
    slurm_gres = "gpu"

    def probe(self) -> DeviceReport:
        raise AssertionError("a Slurm dry run must not probe the submitting machine")

    def node_check(self, *, group=None) -> NodeCheckResult:  # pragma: no cover - never called
        raise AssertionError


class _FakeGpuPlugin:
    @hookimpl
    def dlrover_register_accelerators(self, register):
        register(FakeGpu)


@pytest.fixture
def fakegpu():
    get_host().register(_FakeGpuPlugin(), name="fakegpu")
    yield
    get_host().unregister("fakegpu")


def _job(tmp_path: Path, **overrides) -> Job:
    fields = dict(
        name="tiny", entrypoint=str(TINY), args=["--steps", "20"], nodes=2, accelerator="cpu", scheduler="slurm",
        workdir=str(tmp_path), log_dir=str(tmp_path / "runs"), checkpoint=Checkpoint(dir=str(tmp_path / "ckpt")),
        failure=Failure(heartbeat_timeout_s=5.0), env={"OMP_NUM_THREADS": "1"},
    )
    fields.update(overrides)
    return Job(**fields)


def _normalise(text: str, *, job_id: str, tmp_path: Path) -> str:
    """Stable text: the run's id, this machine's paths and interpreter replaced by names."""
    text = text.replace(job_id, "<JOB_ID>").replace(str(tmp_path), "<TMP>").replace(sys.executable, "<PYTHON>")
    return text.replace(str(TINY.parents[2]), "<REPO>")


def _check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("DLROVER_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert text == path.read_text(), f"{name} differs from its golden file (DLROVER_UPDATE_GOLDEN=1 rewrites it)"


def test_registered_as_slurm():
    """Installing dlrover-plugin-slurm registers the backend under the name ``slurm``; it
    declares what it can do."""
    assert get_host().registries.scheduler.get("slurm") is SlurmScheduler
    assert SlurmScheduler.capabilities == Capabilities(elastic=True, relaunch_node=True, follow_logs=True,
                                                       multi_host=True)
    assert __version__ == "0.1.0"


def test_sbatch_script_matches_golden(tmp_path):
    """The dry run of a 2-node cpu job is the sbatch script in tests/golden/job.sbatch: master on
    the first node, one srun'd agent per node (node id from SLURM_NODEID), requeue, a USR1
    warning before the time limit, output into the run's log directory, no GRES."""
    plan = SlurmScheduler().dryrun(_job(tmp_path))
    script = plan.files["job.sbatch"]
    assert plan.scheduler == "slurm" and plan.processes == ()
    assert plan.log_dir == str(tmp_path / "runs" / plan.job_id)
    assert re.fullmatch(r"tiny-\d{8}-\d{6}-[0-9a-f]{4}", plan.job_id)
    _check_golden("job.sbatch", _normalise(script, job_id=plan.job_id, tmp_path=tmp_path))
    assert "--gres" not in script
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)  # valid shell


def test_elastic_job_asks_for_a_node_range(tmp_path):
    """``Nodes(min < max)`` asks Slurm for a node range, keeps the job on a node failure
    (``--no-kill``) and starts one agent per allocated node."""
    plan = SlurmScheduler().dryrun(_job(tmp_path, nodes="1:2"))
    _check_golden("job_elastic.sbatch", _normalise(plan.files["job.sbatch"], job_id=plan.job_id, tmp_path=tmp_path))


def test_gres_comes_from_the_accelerator(tmp_path, fakegpu):
    """An accelerator with ``slurm_gres`` requests ``--gres=<name>:<nproc_per_node>``, without
    probing the submitting machine (it need not have the devices)."""
    job = _job(tmp_path, accelerator="fakegpu", nodes={"min": 2, "max": 2, "nproc_per_node": 8})
    script = SlurmScheduler().dryrun(job).files["job.sbatch"]
    assert "#SBATCH --gres=gpu:8\n" in script


def test_gres_needs_a_process_count(tmp_path, fakegpu):
    """``nproc_per_node="auto"`` cannot be turned into a GRES count on the submitting machine:
    the error names the field and what to do."""
    job = _job(tmp_path, accelerator="fakegpu", nodes={"min": 2, "max": 2, "nproc_per_node": "auto"})
    with pytest.raises(JobSpecError, match=r"nodes\.nproc_per_node.*--gres=gpu:N"):
        SlurmScheduler().dryrun(job)


def test_auto_accelerator_is_probed_on_the_nodes(tmp_path):
    """``accelerator="auto"`` stays "auto" in the job the agents get: each node probes its own devices."""
    plan = SlurmScheduler().dryrun(_job(tmp_path, accelerator="auto"))
    assert plan.job.accelerator == "auto"
    assert '"accelerator":"auto"' in plan.files["job.sbatch"]


def test_dryrun_is_pure(tmp_path, monkeypatch):
    """A dry run starts no process (no Slurm command) and writes nothing."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"dry run started a process: {args}")

    monkeypatch.setattr(subprocess, "run", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)
    before = sorted(p.name for p in tmp_path.iterdir())
    plan = SlurmScheduler().dryrun(_job(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert not Path(plan.log_dir).exists()


def test_paths_with_spaces_are_refused(tmp_path):
    """#SBATCH lines are read word by word: a log directory with a space is refused early."""
    spaced = tmp_path / "my runs"
    with pytest.raises(JobSpecError, match="without spaces"):
        SlurmScheduler().dryrun(_job(tmp_path, log_dir=str(spaced)))


def test_options_become_sbatch_lines_and_the_job_wins_over_sbatch_variables(tmp_path, monkeypatch):
    """scheduler_options (partition, account, qos, time) become #SBATCH lines; the Job's value
    wins over sbatch's own SBATCH_* variable (the fallback), which submit then removes from
    sbatch's environment so it cannot override the line; the dry-run text shows each option
    and where its value came from."""
    monkeypatch.setenv("SBATCH_PARTITION", "from-env")
    monkeypatch.setenv("SBATCH_ACCOUNT", "team")
    monkeypatch.delenv("SBATCH_QOS", raising=False)
    monkeypatch.delenv("SBATCH_TIMELIMIT", raising=False)
    plan = SlurmScheduler().dryrun(_job(tmp_path))
    assert "#SBATCH --partition=from-env\n#SBATCH --account=team\n" in plan.files["job.sbatch"]
    plan = SlurmScheduler().dryrun(_job(tmp_path, scheduler_options={"partition": "gpu", "time": "1:00:00"}))
    script = plan.files["job.sbatch"]
    assert "#SBATCH --partition=gpu\n#SBATCH --account=team\n#SBATCH --time=1:00:00\n" in script
    assert "from-env" not in script
    text = str(plan)
    assert '    partition="gpu"  (job)\n    account="team"  ($SBATCH_ACCOUNT)\n    qos=null  (default)\n' in text
    assert plan.request.argv == ("sbatch", "--parsable", str(Path(plan.log_dir) / "job.sbatch"))
    assert set(plan.request.unset_env) == {"SBATCH_PARTITION", "SBATCH_ACCOUNT", "SBATCH_TIMELIMIT"}

    calls = []

    def run(argv, **kwargs):
        calls.append((argv, kwargs["env"]))
        return subprocess.CompletedProcess(argv, 0, "42\n", "")

    handle = SlurmScheduler(SlurmCli(run=run, sleep=lambda s: None)).submit(plan)
    ((argv, env),) = calls
    assert argv == list(plan.request.argv) and handle.native_id == "42"
    assert "SBATCH_PARTITION" not in env and "SBATCH_ACCOUNT" not in env
    assert Path(plan.request.script_path).read_text() == script


def test_options_are_checked_before_the_script_is_rendered(tmp_path):
    with pytest.raises(JobSpecError, match=r"scheduler_options\['partition'\]='a b': a value without spaces"):
        SlurmScheduler().dryrun(_job(tmp_path, scheduler_options={"partition": "a b"}))
    with pytest.raises(JobSpecError, match=r"scheduler_options\['partiton'\].*account, partition, python, qos, time"):
        _job(tmp_path, scheduler_options={"partiton": "gpu"}).validate()
