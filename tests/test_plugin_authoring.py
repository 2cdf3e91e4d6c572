"""Writing plugins outside the core: the template copied, renamed, installed and tested as
its README says; the fsspec example plugin tested as installed; and the fsspec storage used by
a real 2-node job that loses a worker to SIGKILL."""

from __future__ import annotations

import json
import re
import shutil
import signal
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT, SCRIPTS, make_venv, pip_into, run_checked

from dlrover_core import Checkpoint, Failure, Job, JobState, Nodes
from dlrover_core.plugins import reset_host
from dlrover_core.testing import kill_worker_at_step
from dlrover_core.train import Checkpointer

TEMPLATE = ROOT / "examples" / "plugin_template"
FSSPEC_PLUGIN = ROOT / "examples" / "plugins" / "dlrover-plugin-fsspec"
_BUILD_LITTER = shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".ruff_cache")
#: pytest as a plugin author runs it; asyncio: this environment's pytest-asyncio, not theirs.
PYTEST = ("-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:asyncio")


def copy_project(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=_BUILD_LITTER)
    return dst


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A fresh venv with the core's wheel and the fsspec plugin's wheel installed."""
    tmp = tmp_path_factory.mktemp("authoring")
    return make_venv(tmp, [ROOT, copy_project(FSSPEC_PLUGIN, tmp / "src" / "dlrover-plugin-fsspec")])


def rename_template(project: Path, name: str) -> None:
    """Step 2 of the template's README: rename the package and every reference to it."""
    (project / "dlrover_plugin_example").rename(project / f"dlrover_plugin_{name}")
    dist = f"dlrover-plugin-{name.replace('_', '-')}"
    for path in [project / "pyproject.toml", project / "README.md", *project.glob("dlrover_plugin_*/*.py"),
                 *project.glob("tests/*.py")]:
        text = path.read_text().replace("dlrover_plugin_example", f"dlrover_plugin_{name}")
        text = re.sub(r"^example = ", f"{name} = ", text.replace("dlrover-plugin-example", dist), flags=re.MULTILINE)
        path.write_text(text)


def test_template_readme_steps_hold(venv, tmp_path):
    """The README's steps as written: copy, rename, pip install -e, pytest; the plugin then
    shows in `dlrover plugins list` under its new name."""
    readme = (TEMPLATE / "README.md").read_text()
    for step in ("cp -r examples/plugin_template", "mv dlrover_plugin_example dlrover_plugin_NAME",
                 "pip install -e '.[test]'", "pytest", "dlrover plugins list"):
        assert step in readme, step
    project = copy_project(TEMPLATE, tmp_path / "dlrover-plugin-acme")
    rename_template(project, "acme")
    for path in (p for p in project.rglob("*") if p.is_file()):
        assert not re.search(r"dlrover.plugin.example|^example = ", path.read_text(), re.MULTILINE), path
    pip_into(venv, "-e", project)
    out = run_checked(venv, *PYTEST, cwd=project, timeout_s=180)
    assert re.search(r"\b7 passed\b", out), out
    listing = {p["name"]: p for p in json.loads(run_checked(venv, "-m", "dlrover_core.cli", "plugins", "list", "--json"))}
    assert listing["acme"]["distribution"] == "dlrover-plugin-acme"
    assert listing["acme"]["backends"] == {"optimizer": ["signsgd"]} and not listing["acme"]["errors"]


def test_fsspec_plugin_passes_its_tests_as_installed(venv, tmp_path):
    """The example storage plugin's own tests, run from a copy of its tests only, so the
    installed wheel is what they import."""
    tests = shutil.copytree(FSSPEC_PLUGIN / "tests", tmp_path / "tests", ignore=_BUILD_LITTER)
    out = run_checked(venv, *PYTEST, tests, cwd=tmp_path, timeout_s=240)
    assert re.search(r"\b\d+ passed\b", out) and "failed" not in out, out
    where = run_checked(venv, "-c", "import dlrover_plugin_fsspec as p; print(p.__file__)")
    assert where.startswith(str(venv.parent.parent)), where


@pytest.fixture
def fsspec_installed(tmp_path, monkeypatch) -> Path:
    """The fsspec plugin pip-installed into a directory on PYTHONPATH: this process, the
    job master, agents and workers all find it through its entry point."""
    target = tmp_path / "site"
    pip_into(Path(sys.executable), "--target", target, copy_project(FSSPEC_PLUGIN, tmp_path / "src"))
    monkeypatch.setenv("PYTHONPATH", str(target))
    monkeypatch.syspath_prepend(str(target))
    reset_host()
    return target


def _events(result) -> list[dict]:
    return [json.loads(line) for line in (Path(result.log_dir) / "events.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_node_job_on_fsspec_storage_survives_a_sigkill(fsspec_installed, tmp_path, monkeypatch):
    """A 2-node job checkpointing to `Checkpoint(storage="fsspec", dir="file://...")`: agents
    persist and the master commits through the plugin; a SIGKILLed worker is restarted and
    resumes; the last commit then restores from storage through the plugin; nothing torn or
    staged is left."""
    from dlrover_plugin_fsspec import FsspecStorage

    url = f"file://{tmp_path}/ck"

    job = Job(name="fsspec-e2e", entrypoint=str(SCRIPTS / "tiny_train.py"), args=["--steps", "30", "--step-sleep", "0.05"],
              nodes=Nodes(min=2, max=2), accelerator="cpu",
              checkpoint=Checkpoint(storage="fsspec", dir=url, persist_every_steps=5),
              failure=Failure(max_restarts=1, stop_grace_s=5), log_dir=str(tmp_path / "runs"))
    run = job.submit()
    kill = kill_worker_at_step(run, step=12, rank=1, sig=signal.SIGKILL, timeout_s=120)
    result = run.wait(progress=False)
    assert kill.done.wait(5) and kill.pid is not None
    assert result.state == JobState.SUCCEEDED, result.reason
    assert result.restarts == 1 and result.final_step == 29
    failure = next(f for f in result.failures if f.signal == "SIGKILL")
    assert failure.rank == 1 and failure.restored_step is not None and failure.restored_step >= 10
    committed = [e["step"] for e in _events(result) if e["kind"] == "checkpoint_committed"]
    assert committed and max(committed) == 25

    storage = FsspecStorage(url)
    assert storage.latest_step() == 25
    files = storage.list()
    assert "step_0000000025/checkpoint.json" in files
    shards = json.loads(storage.read("step_0000000025/checkpoint.json"))["shards"]
    assert {p for p in files if p.startswith("step_0000000025/")} == {
        "step_0000000025/checkpoint.json", *(f"step_0000000025/{shards[r]['file']}" for r in ("0", "1"))}
    assert all(re.fullmatch(rf"rank_0000{r}-round\d+\.safetensors", shards[str(r)]["file"]) for r in (0, 1))
    assert not [p for p in (tmp_path / "ck").rglob("*") if p.name.endswith(".staging")]

    # what rank 1 of a later 2-rank job does with nothing in memory: restore the commit through the
    # plugin (at another world size the core reshards with DCP, which reads a local directory itself)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = torch.nn.Linear(8, 1)
    restored = Checkpointer(url, storage="fsspec").load({"model": model})
    assert (restored.step, restored.source) == (25, "storage")
    assert set(restored.state) == {"model", "optimizer", "extra"}  # what tiny_train saves, CRC-checked on load
