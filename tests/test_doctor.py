"""`dlrover doctor`, accelerator selection by priority, and the error naming a missing plugin package."""

from __future__ import annotations

import json
import time

import pytest
from click.testing import CliRunner

from dlrover_core import Job, JobSpecError, hookimpl
from dlrover_core.accelerators import Accelerator, DeviceReport, NodeCheckResult
from dlrover_core.cli import main as cli
from dlrover_core.doctor import diagnose
from dlrover_core.errors import DeviceError
from dlrover_core.plugins import PluginHost


def _accelerator(name: str, priority: int, report: DeviceReport | None = None, *, sleep_s: float = 0.0,
                 raises: bool = False) -> type[Accelerator]:
    class Fake(Accelerator):
        torch_device_type = "cpu"
        dist_backend = "gloo"

        def probe(self) -> DeviceReport:
            time.sleep(sleep_s)
            if raises:
                raise RuntimeError("driver library crashed")
            return report or DeviceReport(accelerator=name, present=False, reason="no such device")

        def node_check(self, *, group=None) -> NodeCheckResult:
            return NodeCheckResult(matmul_tflops=1.0, allreduce_gbps=None, elapsed_s=0.0)

    Fake.name = name
    Fake.priority = priority
    return Fake


def host_with(*classes: type[Accelerator]) -> PluginHost:
    class Plugin:
        @hookimpl
        def dlrover_register_accelerators(self, register):
            for cls in classes:
                register(cls)

    host = PluginHost(load_entry_points=False)
    host.register(Plugin(), name="fakes", distribution="dlrover-plugin-fakes")
    return host


def present(name: str, count: int = 2) -> DeviceReport:
    return DeviceReport(accelerator=name, present=True, count=count, model="Fake X1", memory_mb=1024,
                        healthy=(True,) * count)


def test_auto_takes_the_present_accelerator_with_the_highest_priority():
    host = host_with(_accelerator("big", 100, present("big")), _accelerator("absent", 200),
                     _accelerator("small", 50, present("small")))
    assert host.create_accelerator("auto").name == "big"
    d = diagnose(host)
    assert d.auto == "big"
    assert [p.name for p in d.probes] == ["absent", "big", "small", "cpu"]
    assert "absent: not available: no such device" in d.summary()


def test_naming_an_absent_accelerator_says_why():
    host = host_with(_accelerator("absent", 200))
    with pytest.raises(DeviceError, match="'absent' is not usable here: no such device"):
        host.create_accelerator("absent")


def test_a_hanging_or_raising_probe_does_not_stop_the_others():
    host = host_with(_accelerator("hangs", 300, sleep_s=5.0), _accelerator("raises", 200, raises=True))
    start = time.monotonic()
    d = diagnose(host, deadline_s=0.5)
    assert time.monotonic() - start < 3.0
    by_name = {p.name: p.report for p in d.probes}
    assert "did not answer within 0.5 s" in by_name["hangs"].reason
    assert "RuntimeError: driver library crashed" in by_name["raises"].reason
    assert d.auto == "cpu"


def test_doctor_cli_explains_why_only_cpu_is_available():
    result = CliRunner().invoke(cli, ["doctor"])
    assert result.exit_code == 0, result.output
    assert 'accelerator="auto" picks: cpu' in result.output
    out = CliRunner().invoke(cli, ["doctor", "--json"])
    data = json.loads(out.stdout)
    assert data["auto"] == "cpu"
    names = {a["name"] for a in data["accelerators"]} | set(data["not_installed"])
    assert {"cpu", "cuda", "ascend", "ppu"} <= names  # installed ones probed, the others named with their package
    for a in data["accelerators"]:
        assert a["present"] or a["reason"], a  # every absent accelerator says why


def test_an_uninstalled_project_plugin_is_named_by_its_package(monkeypatch):
    monkeypatch.setenv("DLROVER_DISABLE_PLUGINS", "dlrover-plugin-ascend")
    import dlrover_core.plugins as plugins

    monkeypatch.setattr(plugins, "_host", None)
    with pytest.raises(JobSpecError, match="pip install dlrover-plugin-ascend"):
        Job(name="x", entrypoint="json.tool", accelerator="ascend").validate()


def test_auto_nproc_and_per_rank_environment_come_from_the_accelerator(monkeypatch, tmp_path):
    """nproc_per_node="auto" takes the device count and each worker gets the accelerator's
    environment for its local rank, in the exact plan Job.dryrun() returns."""
    import dlrover_core.plugins as plugins
    from dlrover_core import Nodes

    class Quad(_accelerator("quad", 500, present("quad", count=4))):
        visible_devices_env = "QUAD_VISIBLE_DEVICES"

        def worker_env(self, local_rank, local_world_size):
            return {"QUAD_DEVICE_INDEX": str(local_rank), "QUAD_WORLD": str(local_world_size)}

    Quad.name = "quad"
    monkeypatch.setattr(plugins, "_host", host_with(Quad))
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    plan = Job(name="q", entrypoint=str(script), nodes=Nodes(min=2, max=2, nproc_per_node="auto"),
               accelerator="auto", log_dir=str(tmp_path / "runs")).dryrun()
    assert len(plan.workers) == 8
    node0 = [w for w in plan.workers if w.env["GROUP_RANK"] == "0"]
    assert [w.env["QUAD_DEVICE_INDEX"] for w in node0] == ["0", "1", "2", "3"]
    assert {w.env["QUAD_WORLD"] for w in plan.workers} == {"4"}
    assert {w.env["DLROVER_ACCELERATOR"] for w in plan.workers} == {"quad"}
