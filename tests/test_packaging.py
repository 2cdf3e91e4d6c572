"""The plugin packages as users get them: wheels of the core, of every plugin under
``plugins/`` and of the example plugins under ``examples/plugins/``, installed into a fresh
virtual environment and found through their entry points — and, without one, a Job naming
it fails with the package to install."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import make_venv
from helpers import run_checked as run

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
ACCELERATORS = {"cuda": "dlrover-plugin-cuda", "ascend": "dlrover-plugin-ascend", "ppu": "dlrover-plugin-ppu"}
#: Every plugin distribution in the repository: a new one is packaged and checked here without
#: editing this file.
PLUGIN_PROJECTS = sorted(p.parent for pattern in ("plugins/*/pyproject.toml", "examples/plugins/*/pyproject.toml")
                         for p in ROOT.glob(pattern))


def expected_plugins() -> dict[str, str]:
    """Entry-point name -> distribution, read from each plugin's pyproject.toml."""
    expected = {}
    for project in PLUGIN_PROJECTS:
        meta = tomllib.loads((project / "pyproject.toml").read_text())["project"]
        for ep in meta.get("entry-points", {}).get("dlrover", {}):
            expected[ep] = meta["name"]
    return expected


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory) -> Path:
    """A new venv holding the wheels of the core and of every plugin."""
    return make_venv(tmp_path_factory.mktemp("packaging"), [ROOT, *PLUGIN_PROJECTS])


def test_every_plugin_project_declares_a_dlrover_entry_point():
    assert {p.name for p in PLUGIN_PROJECTS} >= {"cuda", "ascend", "ppu", "k8s", "slurm", "dlrover-plugin-fsspec"}
    declared = set(expected_plugins().values())
    for project in PLUGIN_PROJECTS:
        name = tomllib.loads((project / "pyproject.toml").read_text())["project"]["name"]
        assert name.startswith("dlrover-plugin-") and name in declared, f"{project}: no [project.entry-points.dlrover]"


def test_wheels_install_and_register_in_a_fresh_venv(fresh_venv):
    """`dlrover plugins list --json` in the venv lists exactly the plugins the pyprojects
    declare, each from its wheel, each registering something, none with an error."""
    listing = json.loads(run(fresh_venv, "-m", "dlrover_core.cli", "plugins", "list", "--json"))
    external = {p["name"]: p for p in listing if not p["builtin"]}
    expected = expected_plugins()
    assert {name: p["distribution"] for name, p in external.items()} == expected
    for name, plugin in external.items():
        assert not plugin["errors"], (name, plugin["errors"])
        assert plugin["backends"] and plugin["version"], (name, plugin)
    by_dist = {p["distribution"]: p for p in external.values()}
    for name, dist in ACCELERATORS.items():
        assert by_dist[dist]["backends"].get("accelerator") == [name]
    assert by_dist["dlrover-plugin-fsspec"]["backends"] == {"storage": ["fsspec"]}
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
        "    Job(name='x', entrypoint='json.tool', accelerator='ascend').validate()\n"
        "except JobSpecError as e:\n"
        "    print(e)\n"
    )
    out = run(fresh_venv, "-c", code, env={"DLROVER_DISABLE_PLUGINS": "dlrover-plugin-ascend"})
    assert "pip install dlrover-plugin-ascend" in out, out
