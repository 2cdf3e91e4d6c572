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
    rows = {r["name"]: r for r in json.loads(out.output)}
    assert rows["dlrover_core.schedulers.local"]["backends"] == {"scheduler": ["local"]}
    assert rows["dlrover_core.schedulers.local"]["hooks"] == ["dlrover_register_schedulers"]
    assert "does_not_exist" in rows["dlrover-plugin-broken"]["errors"][0]
    table = runner.invoke(cli, ["plugins", "list"])
    assert table.exit_code == 0 and "posix" in table.output
