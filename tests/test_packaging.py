"""The plugin packages as users get them: wheels built from ``plugins/*``, installed into a
fresh virtual environment, found through their entry points — and, without one, a Job
naming it fails with the package to install."""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ACCELERATORS = {"cuda": "dlrover-plugin-cuda", "ascend": "dlrover-plugin-ascend", "ppu": "dlrover-plugin-ppu"}


def run(*cmd: str | Path, env: dict[str, str] | None = None, timeout_s: float = 240) -> str:
    # run outside the checkout: `python -c` puts the working directory first on sys.path
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout_s,
                       env={**os.environ, **(env or {})}, cwd=tempfile.gettempdir())
    if p.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd[:5]))} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p.stdout


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory) -> Path:
    """A new venv holding the wheels of the core and the accelerator plugins. Their
    third-party dependencies (torch above all) come from the test's own environment through
    a path entry appended after the venv's own site-packages, so the wheels' copies of our
    packages are the ones imported and found by ``importlib.metadata``."""
    tmp = tmp_path_factory.mktemp("packaging")
    wheels = tmp / "wheels"
    projects = [ROOT] + [ROOT / "plugins" / name for name in ACCELERATORS]
    run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", wheels, *projects)
    venv = tmp / "venv"
    run(sys.executable, "-m", "venv", venv)
    py = venv / "bin" / "python"
    run(py, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", *sorted(wheels.glob("*.whl")))
    purelib = Path(run(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())
    ours = [p for p in site.getsitepackages() + [sysconfig.get_paths()["purelib"]] if Path(p).is_dir()]
    (purelib / "zz_test_dependencies.pth").write_text("\n".join(dict.fromkeys(ours)) + "\n")
    return py


def test_wheels_install_and_register_in_a_fresh_venv(fresh_venv):
    listing = json.loads(run(fresh_venv, "-m", "dlrover_core.cli", "plugins", "list", "--json"))
    by_dist = {p["distribution"]: p for p in listing}
    for name, dist in ACCELERATORS.items():
        assert dist in by_dist, sorted(by_dist)
        assert by_dist[dist]["backends"].get("accelerator") == [name]
        assert not by_dist[dist]["errors"], by_dist[dist]["errors"]
    where = run(fresh_venv, "-c", "import dlrover_core, dlrover_plugin_ascend as a; print(dlrover_core.__file__); print(a.__file__)")
    venv_root = str(fresh_venv.parent.parent)
    assert all(line.startswith(venv_root) for line in where.split()), where  # the wheels' code, not the checkout's


def test_installed_plugin_resolves_and_explains_the_missing_device(fresh_venv):
    code = (
        "from dlrover_core import Job\n"
        "from dlrover_core.plugins import get_host\n"
        "from dlrover_core.errors import DeviceError\n"
        "job = Job(name='x', entrypoint='json.tool', accelerator='ascend')\n"
        "try:\n"
        "    get_host().create_accelerator(job.accelerator)\n"
        "except DeviceError as e:\n"
        "    print('DeviceError:', e)\n"
    )
    out = run(fresh_venv, "-c", code)
    assert out.startswith("DeviceError: accelerator 'ascend' is not usable here:"), out


def test_without_the_plugin_the_job_names_the_package(fresh_venv):
    code = (
        "from dlrover_core import Job, JobSpecError\n"
        "try:\n"
        "    Job(name='x', entrypoint='json.tool', accelerator='ascend')\n"
        "except JobSpecError as e:\n"
        "    print(e)\n"
    )
    out = run(fresh_venv, "-c", code, env={"DLROVER_DISABLE_PLUGINS": "dlrover-plugin-ascend"})
    assert "pip install dlrover-plugin-ascend" in out, out
