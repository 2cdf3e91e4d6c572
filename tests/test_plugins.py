"""Plugin loading: built-ins through the same hooks, entry points, isolation, allow/block lists."""

from __future__ import annotations

import json
import types

import pytest
from click.testing import CliRunner
from helpers import install_dist

from dlrover_core import PluginError, PluginNotFoundError, hookimpl
from dlrover_core.cli import main as cli
from dlrover_core.plugins import PluginHost, get_host
from dlrover_core.storage.posix import PosixStorage

GOOD = """
    from dlrover_core import hookimpl
    from dlrover_core.storage.posix import PosixStorage

    class MirrorStorage(PosixStorage):
        name = "mirror"

    @hookimpl
    def dlrover_register_storages(register):
        register(MirrorStorage)

    @hookimpl
    def dlrover_register_optimizers(register):
        import torch
        register(torch.optim.RMSprop, name="rmsprop")
"""


@pytest.fixture
def site(tmp_path, monkeypatch):
    d = tmp_path / "site"
    d.mkdir()
    monkeypatch.syspath_prepend(str(d))
    return d


def test_builtins_register_through_hooks():
    """cpu, local, docker, posix, adamw/adam/sgd and the parallel strategies come from built-in plugins
    like any other."""
    regs = PluginHost(load_entry_points=False).registries
    assert regs.accelerator.names() == ["cpu"]
    assert regs.scheduler.names() == ["docker", "local"]
    assert regs.storage.names() == ["posix"]
    assert regs.optimizer.names() == ["adam", "adamw", "sgd"]
    assert regs.parallel_strategy.names() == ["amp", "auto", "checkpoint", "compile", "ddp", "fsdp", "mesh"]
    entry = regs.scheduler.entry("local")
    assert entry.plugin == "dlrover_core.schedulers.local" and entry.distribution == "dlrover-core"


def test_unknown_name_lists_known_ones():
    with pytest.raises(PluginNotFoundError) as err:
        get_host().registries.storage.get("s3")
    assert err.value.known == ["posix"]
    assert "known storages: posix" in str(err.value)
    assert isinstance(err.value, LookupError)


def test_entry_point_plugin_is_found(site):
    """A distribution with a `dlrover` entry point registers its backends, attributed to it."""
    install_dist(site, "dlrover-plugin-mirror", "dlrover_plugin_mirror", GOOD)
    host = PluginHost()
    assert host.registries.storage.names() == ["mirror", "posix"]
    assert "rmsprop" in host.registries.optimizer
    info = host.plugins["dlrover-plugin-mirror"]
    assert info.distribution == "dlrover-plugin-mirror" and info.version == "1.2.3"
    assert info.backends == {"storage": ["mirror"], "optimizer": ["rmsprop"]}
    assert info.errors == []


def test_broken_plugin_is_reported_and_skipped(site):
    """A plugin that raises on import is listed with its error; the host keeps working."""
    install_dist(site, "dlrover-plugin-broken", "dlrover_plugin_broken", "raise RuntimeError('kaboom')\n")
    install_dist(site, "dlrover-plugin-mirror", "dlrover_plugin_mirror", GOOD)
    host = PluginHost()
    broken = host.plugins["dlrover-plugin-broken"]
    assert broken.errors and "kaboom" in broken.errors[0]
    assert "mirror" in host.registries.storage


def test_allow_and_block_lists(site):
    install_dist(site, "dlrover-plugin-mirror", "dlrover_plugin_mirror", GOOD)
    assert "dlrover-plugin-mirror" not in PluginHost(environ={"DLROVER_PLUGINS": ""}).plugins
    assert "dlrover-plugin-mirror" in PluginHost(environ={"DLROVER_PLUGINS": "dlrover-plugin-mirror"}).plugins
    assert "dlrover-plugin-mirror" not in PluginHost(environ={"DLROVER_DISABLE_PLUGINS": "dlrover-plugin-mirror"}).plugins
    # built-ins always load
    assert "posix" in PluginHost(environ={"DLROVER_PLUGINS": ""}).registries.storage


def test_unknown_hook_is_rejected():
    """A plugin implementing a hook that does not exist is refused with the reason."""
    plugin = types.SimpleNamespace()

    @hookimpl
    def dlrover_register_gpus(register):  # no such hook
        pass

    plugin.dlrover_register_gpus = dlrover_register_gpus
    host = PluginHost(load_entry_points=False)
    info = host.register(plugin, name="typo")
    assert info.errors and "dlrover_register_gpus" in info.errors[0]
    assert host.registries.storage.names() == ["posix"]


def test_malformed_backend_is_reported_not_fatal():
    """Registering something that is not a backend is recorded against the plugin."""

    class NotStorage:
        name = "bogus"

    class Plugin:
        @hookimpl
        def dlrover_register_storages(self, register):
            register(NotStorage)
            register(PosixStorage, name="posix2")

    host = PluginHost(load_entry_points=False)
    host.register(Plugin(), name="malformed", distribution="dlrover-plugin-malformed")
    regs = host.registries
    assert "bogus" not in regs.storage and "posix2" in regs.storage
    assert any("malformed storage" in e for e in host.plugins["malformed"].errors)


def test_duplicate_names_name_both_distributions():
    class Plugin:
        @hookimpl
        def dlrover_register_storages(self, register):
            register(PosixStorage)  # "posix" again

    host = PluginHost(load_entry_points=False)
    host.register(Plugin(), name="dup", distribution="dlrover-plugin-dup")
    with pytest.raises(PluginError) as err:
        host.registries.storage.get("posix")
    assert "dlrover-core" in str(err.value) and "dlrover-plugin-dup" in str(err.value)


def test_event_observer_errors_are_swallowed():
    seen = []

    class Observer:
        @hookimpl
        def dlrover_on_job_event(self, event):
            seen.append(event)

    class Failing:
        @hookimpl
        def dlrover_on_job_event(self, event):
            raise RuntimeError("observer bug")

    host = PluginHost(load_entry_points=False)
    host.register(Observer(), name="obs")
    host.register(Failing(), name="fail")
    host.emit("evt")
    assert seen == ["evt"]


def test_cli_plugins_list_json_and_table(site):
    install_dist(site, "dlrover-plugin-broken", "dlrover_plugin_broken", "import does_not_exist\n")
    runner = CliRunner()
    out = runner.invoke(cli, ["plugins", "list", "--json"])
    assert out.exit_code == 0, out.output
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    assert rows["dlrover_core.schedulers.local"]["backends"] == {"scheduler": ["local"]}
    assert rows["dlrover_core.schedulers.local"]["hooks"] == ["dlrover_register_schedulers"]
    assert "does_not_exist" in rows["dlrover-plugin-broken"]["errors"][0]
    table = runner.invoke(cli, ["plugins", "list"])
    assert table.exit_code == 0 and "posix" in table.output


# ----- isolation and conflicts with installed distributions ---------------------------------

#: A plugin whose register hook hands over something that is not a backend.
MALFORMED = """
    from dlrover_core import hookimpl

    class NotAStorage:
        name = "bogus"

    @hookimpl
    def dlrover_register_storages(register):
        register(NotAStorage)
"""

#: A plugin whose register hook itself raises.
RAISING_HOOK = """
    from dlrover_core import hookimpl

    @hookimpl
    def dlrover_register_schedulers(register):
        raise RuntimeError("scheduler plugin bug")
"""


def twin(dist_suffix: str) -> str:
    return f"""
    from dlrover_core import hookimpl
    from dlrover_core.storage.posix import PosixStorage

    class TwinStorage{dist_suffix}(PosixStorage):
        name = "twin"

    @hookimpl
    def dlrover_register_storages(register):
        register(TwinStorage{dist_suffix})
"""


def install_broken_plugins(site) -> None:
    install_dist(site, "dlrover-plugin-broken", "dlrover_plugin_broken", "raise RuntimeError('kaboom')\n")
    install_dist(site, "dlrover-plugin-malformed", "dlrover_plugin_malformed", MALFORMED)
    install_dist(site, "dlrover-plugin-raising", "dlrover_plugin_raising", RAISING_HOOK)


def test_cli_lists_every_broken_plugin_with_its_error(site):
    """An import error, a malformed backend and a raising hook each show in `dlrover plugins
    list` against the plugin that caused it; the built-ins show none."""
    install_broken_plugins(site)
    out = CliRunner().invoke(cli, ["plugins", "list", "--json"])
    assert out.exit_code == 0, out.output
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    assert rows["dlrover-plugin-broken"]["errors"] == ["import failed: RuntimeError: kaboom"]
    assert rows["dlrover-plugin-broken"]["distribution"] == "dlrover-plugin-broken"
    (malformed,) = rows["dlrover-plugin-malformed"]["errors"]
    assert "registered a malformed storage" in malformed and "NotAStorage" in malformed
    assert rows["dlrover-plugin-raising"]["errors"] == [
        "register: dlrover_register_schedulers raised RuntimeError: scheduler plugin bug"]
    assert all(not r["errors"] for r in rows.values() if r["builtin"])
    table = CliRunner().invoke(cli, ["plugins", "list"])
    assert table.exit_code == 0 and "kaboom" in table.output


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_job_runs_with_broken_plugins_installed(site, tmp_path, monkeypatch):
    """Master, agents and workers all load the broken plugins (they are on PYTHONPATH); a job
    that uses none of them succeeds."""
    from helpers import SCRIPTS

    from dlrover_core import Checkpoint, Failure, Job, JobState, Nodes

    install_broken_plugins(site)
    monkeypatch.setenv("PYTHONPATH", str(site))
    job = Job(name="isolated", entrypoint=str(SCRIPTS / "tiny_train.py"), args=["--steps", "4"],
              nodes=Nodes(min=1, max=1, nproc_per_node=1), accelerator="cpu",
              checkpoint=Checkpoint(dir=str(tmp_path / "ck"), persist_every_steps=2),
              failure=Failure(max_restarts=0), log_dir=str(tmp_path / "runs"))
    assert sorted(p for p in get_host().plugins if p.startswith("dlrover-plugin-")) == [
        "dlrover-plugin-broken", "dlrover-plugin-malformed", "dlrover-plugin-raising"]
    result = job.run(progress=False)
    assert result.state == JobState.SUCCEEDED, result.reason
    assert result.final_step == 3
    master_log = (tmp_path / "runs" / result.job_id / "master.log").read_text()
    assert "plugin_import_failed" in master_log and "kaboom" in master_log  # loaded there, reported, skipped


def test_two_distributions_registering_one_name_are_both_named(site):
    """The conflict is reported against the plugin loaded second, names both distributions,
    and using the name raises rather than picking one silently."""
    install_dist(site, "dlrover-plugin-twin-a", "dlrover_plugin_twin_a", twin("A"))
    install_dist(site, "dlrover-plugin-twin-b", "dlrover_plugin_twin_b", twin("B"))
    host = PluginHost()
    with pytest.raises(PluginError) as err:
        host.registries.storage.get("twin")
    message = str(err.value)
    assert "storage 'twin' is registered by more than one plugin" in message
    assert "dlrover-plugin-twin-a and dlrover-plugin-twin-b" in message and "DLROVER_DISABLE_PLUGINS" in message
    assert host.plugins["dlrover-plugin-twin-a"].errors == []
    assert host.plugins["dlrover-plugin-twin-b"].errors == [f"register: {message}"]
    # blocking one of them resolves it
    host = PluginHost(environ={"DLROVER_DISABLE_PLUGINS": "dlrover-plugin-twin-a"})
    assert host.registries.storage.entry("twin").distribution == "dlrover-plugin-twin-b"


def test_a_plugin_reusing_a_builtin_name_is_blamed_not_the_core():
    class Posix2:
        @hookimpl
        def dlrover_register_storages(self, register):
            register(PosixStorage)

    host = PluginHost(load_entry_points=False)
    host.register(Posix2(), name="posix2", distribution="dlrover-plugin-posix2")
    host.registries  # noqa: B018
    assert host.plugins["dlrover_core.storage.posix"].errors == []
    assert "dlrover-core and dlrover-plugin-posix2" in host.plugins["posix2"].errors[0]


def test_allow_and_block_lists_match_entry_point_or_distribution_names(site):
    install_dist(site, "dlrover-plugin-mirror", "dlrover_plugin_mirror", GOOD, ep_name="mirror")
    install_dist(site, "dlrover-plugin-broken", "dlrover_plugin_broken", "raise RuntimeError('kaboom')\n")

    def external(environ):  # of these two (the environment has other plugins installed)
        return sorted(n for n in PluginHost(environ=environ).plugins if n in ("mirror", "dlrover-plugin-broken"))

    assert external({}) == ["dlrover-plugin-broken", "mirror"]
    assert external({"DLROVER_PLUGINS": "mirror"}) == ["mirror"]  # entry-point name
    assert external({"DLROVER_PLUGINS": " dlrover-plugin-mirror , other "}) == ["mirror"]  # distribution, spaces
    assert external({"DLROVER_DISABLE_PLUGINS": "dlrover-plugin-broken"}) == ["mirror"]
    assert external({"DLROVER_PLUGINS": "mirror,dlrover-plugin-broken", "DLROVER_DISABLE_PLUGINS": "mirror"}) == [
        "dlrover-plugin-broken"]  # the block-list wins


def test_cli_honours_the_block_list(site):
    install_dist(site, "dlrover-plugin-broken", "dlrover_plugin_broken", "raise RuntimeError('kaboom')\n")
    out = CliRunner(env={"DLROVER_DISABLE_PLUGINS": "dlrover-plugin-broken"}).invoke(cli, ["plugins", "list", "--json"])
    assert out.exit_code == 0, out.output
    assert "dlrover-plugin-broken" not in {r["name"] for r in json.loads(out.stdout)}
