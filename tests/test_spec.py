"""The Job spec: every invalid field is named with its value and what is allowed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import attrs
import pytest

from dlrover_core import Checkpoint, Failure, Job, JobSpecError, Nodes, Optimizer, Parallel

SCRIPT = "train.py"


@pytest.fixture
def script(workdir):
    (workdir / SCRIPT).write_text("print('hi')\n")
    return SCRIPT


def make(script, **kw):
    return Job(name="demo", entrypoint=script, **kw)


@pytest.mark.parametrize(
    ("build", "field", "fragment"),
    [
        (lambda: Nodes(min=3, max=2), "nodes.max", ">= nodes.min (3)"),
        (lambda: Nodes(min=0), "nodes.min", ">= 1"),
        (lambda: Nodes(min=2, nproc_per_node=0), "nodes.nproc_per_node", ">= 1"),
        (lambda: Nodes(min=2, nproc_per_node="many"), "nodes.nproc_per_node", "integer"),
        (lambda: Nodes(min=3, max=3, node_unit=2), "nodes.node_unit", "multiple"),
        (lambda: Nodes(last_call_s=-1), "nodes.last_call_s", ">= 0"),
        (lambda: Nodes(join_timeout_s=0), "nodes.join_timeout_s", "> 0"),
        (lambda: Nodes.parse("two"), "nodes", "MIN:MAX"),
        (lambda: Nodes.parse(True), "nodes", "int"),
        (lambda: Checkpoint(persist_every_steps=-5), "checkpoint.persist_every_steps", ">= 0"),
        (lambda: Checkpoint(memory_every_steps=-1), "checkpoint.memory_every_steps", ">= 0"),
        (lambda: Checkpoint(keep_last=0), "checkpoint.keep_last", ">= 1"),
        (lambda: Checkpoint(dir=""), "checkpoint.dir", "non-empty"),
        (lambda: Checkpoint(replicas=2), "checkpoint.replicas", "0, 1 or None"),
        (lambda: Checkpoint(replicas=True), "checkpoint.replicas", "0, 1 or None"),
        (lambda: Failure(max_restarts=-1), "failure.max_restarts", ">= 0"),
        (lambda: Failure(hang_timeout_s=0), "failure.hang_timeout_s", "> 0"),
        (lambda: Failure(node_check="yes"), "failure.node_check", "True or False"),
        (lambda: Failure(heartbeat_interval_s=5, heartbeat_timeout_s=5), "failure.heartbeat_timeout_s", "more than"),
        (lambda: Failure(stop_grace_s=-1), "failure.stop_grace_s", "> 0"),
        (lambda: Failure(live_recovery="yes"), "failure.live_recovery", "True or False"),
        (lambda: Failure(node_failure_window_s=0), "failure.node_failure_window_s", "> 0"),
        (lambda: Optimizer(""), "optimizer.name", "registered optimizer"),
        (lambda: Optimizer("adamw", lr=object()), "optimizer.options", "JSON-safe"),
        (lambda: Parallel([42]), "parallel.strategies[0]", "(name, {options})"),
    ],
)
def test_part_validation_names_field_value_and_fix(build, field, fragment):
    """An invalid part raises JobSpecError naming the field, the value and what is allowed."""
    with pytest.raises(JobSpecError) as err:
        build()
    assert err.value.field == field
    assert fragment in str(err.value)
    assert field in str(err.value)


@pytest.mark.parametrize(
    ("kwargs", "field", "fragment"),
    [
        ({"name": "Bad Name"}, "name", "lowercase"),
        ({"entrypoint": "missing.py"}, "entrypoint", "existing script"),
        ({"entrypoint": "no_such_module_xyz.main"}, "entrypoint", "importable module"),
        ({"entrypoint": "not a module!"}, "entrypoint", "script path"),
        ({"scheduler": "slurmish"}, "scheduler", "local"),
        ({"accelerator": "tpu"}, "accelerator", "cpu"),
        ({"checkpoint": Checkpoint(storage="s3x")}, "checkpoint.storage", "posix"),
        ({"optimizer": Optimizer("lion")}, "optimizer.name", "adamw"),
        ({"parallel": Parallel(["zero9"])}, "parallel.strategies[0]", "ddp"),
        ({"args": ["--steps", 5]}, "args[1]", "string"),
        ({"env": {"A": 1}}, "env['A']", "string"),
        ({"workdir": "no/such/dir"}, "workdir", "existing directory"),
        ({"nodes": "3:1"}, "nodes.max", ">= nodes.min"),
    ],
)
def test_job_validation_names_field_value_and_fix(script, kwargs, field, fragment):
    """Job-level errors list the known names for unknown backends and say what to do: the
    field's own checks at Job(...), the machine's (plugins, files) at validate()."""
    base = {"name": "demo", "entrypoint": script}
    with pytest.raises(JobSpecError) as err:
        Job(**{**base, **kwargs}).validate()
    assert err.value.field == field
    assert fragment in str(err.value)


def test_unknown_scheduler_lists_known_ones(script):
    """The error for an unknown scheduler names every registered one."""
    from dlrover_core.plugins import get_host

    known = ", ".join(get_host().registries.scheduler.names())
    assert "local" in known
    with pytest.raises(JobSpecError, match=re.escape(f"registered schedulers: {known}")):
        make(script, scheduler="nope").validate()


def test_nodes_shorthands():
    """nodes=2 means min=max=2; '1:4' is an elastic range."""
    assert Nodes.parse(2) == Nodes(min=2, max=2)
    assert Nodes.parse("1:4") == Nodes(min=1, max=4)
    assert Nodes.parse({"min": 1, "max": 2}) == Nodes(min=1, max=2)


def test_frozen_and_evolve(script):
    """Jobs are frozen; attrs.evolve makes a changed copy."""
    job = make(script)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        job.name = "other"  # type: ignore[misc]
    assert attrs.evolve(job, name="other").name == "other"


def test_to_dict_from_dict_round_trip(script):
    """to_dict() is JSON-safe and from_dict() gives back an equal Job."""
    job = make(
        script, args=["--steps", "3"], nodes=Nodes(min=1, max=2, nproc_per_node="auto", node_unit=1),
        checkpoint=Checkpoint(dir="ck", persist_every_steps=10), failure=Failure(max_restarts=5, hang_timeout_s=60),
        optimizer=Optimizer("sgd", lr=0.1, momentum=0.9), parallel=Parallel(["ddp"]), env={"X": "1"},
    )
    data = json.loads(json.dumps(job.to_dict()))
    assert Job.from_dict(data) == job


def test_from_dict_rejects_unknown_keys_and_bad_values(script):
    data = make(script).to_dict()
    with pytest.raises(JobSpecError):
        Job.from_dict({**data, "colour": "blue"})
    with pytest.raises(JobSpecError) as err:
        Job.from_dict({**data, "nodes": {**data["nodes"], "min": 0}})
    assert err.value.field == "nodes.min"


def test_module_entrypoints(workdir):
    """'pkg.mod' and 'pkg.mod:fn' entrypoints are checked by import lookup, not executed."""
    assert Job(name="m", entrypoint="json.tool").entrypoint == "json.tool"
    assert Job(name="m", entrypoint="json:dumps").entrypoint == "json:dumps"


def test_dryrun_lists_exact_processes_and_environment(script):
    """dryrun() returns the master, one agent per node and the first round's workers with
    their torch environment, and starts nothing."""
    job = make(script, nodes=Nodes(min=2, max=2, nproc_per_node=2), accelerator="cpu")
    plan = job.dryrun()
    roles = [p.role for p in plan.processes]
    assert roles == ["master", "agent", "agent"]
    assert [w.env["RANK"] for w in plan.workers] == ["0", "1", "2", "3"]
    w3 = plan.workers[3]
    assert w3.env["LOCAL_RANK"] == "1" and w3.env["GROUP_RANK"] == "1" and w3.env["WORLD_SIZE"] == "4"
    assert w3.env["LOCAL_WORLD_SIZE"] == "2" and w3.env["TORCHELASTIC_RESTART_COUNT"] == "0"
    assert w3.env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert w3.argv[-1].endswith(SCRIPT)
    assert plan.processes[1].env["DLROVER_MASTER_ADDR"] in plan.processes[1].argv
    assert "[master]" in str(plan) and "RANK=3" in str(plan)
    assert not Path(plan.log_dir).exists(), "a dry run must not create anything"


def test_building_and_decoding_a_spec_loads_no_plugin_and_touches_no_file(tmp_path, monkeypatch):
    """A spec is plain data: the master, agents and workers decode it without the plugin host
    or the filesystem (a workdir that does not exist here is fine until validate())."""
    import dlrover_core.plugins as plugins
    from dlrover_core.spec import JobSpec

    def no_host():
        raise AssertionError("the plugin host was loaded")

    monkeypatch.setattr(plugins, "get_host", no_host)
    monkeypatch.setattr(plugins, "_host", None)
    job = Job(name="demo", entrypoint="train.py", workdir=str(tmp_path / "elsewhere"), scheduler="k9s",
              accelerator="tpu", checkpoint=Checkpoint(storage="s3x"))
    decoded = JobSpec.from_dict(job.to_dict())
    assert decoded.scheduler == "k9s" and decoded.workdir.endswith("elsewhere")
    assert type(Job.from_dict(job.to_dict())) is Job


def test_scheduler_options_are_json_data_named_in_errors(script):
    job = make(script, scheduler_options={"image": "img:1", "shm_size_mb": 512})
    assert Job.from_dict(job.to_dict()).scheduler_options == {"image": "img:1", "shm_size_mb": 512}
    with pytest.raises(JobSpecError) as err:
        make(script, scheduler_options={"image": object()})
    assert err.value.field == "scheduler_options['image']"


def test_the_default_heartbeat_grows_with_the_job(script):
    """Left unset, the heartbeat interval keeps one master at 2,000 heartbeats a second:
    0.5 s up to 1,000 nodes, 5 s at 10,000, 50 s at 100,000; the timeout is six missed
    heartbeats, at least 30 s. Explicit values win; the spec keeps None (automatic)."""
    from dlrover_core.spec import auto_heartbeat

    for nodes, interval_s, timeout_s in ((1, 0.5, 30.0), (1000, 0.5, 30.0), (4000, 2.0, 30.0),
                                         (10_000, 5.0, 30.0), (100_000, 50.0, 300.0)):
        job = make(script, nodes=Nodes(min=1, max=nodes))
        assert (job.heartbeat_interval_s, job.heartbeat_timeout_s) == (interval_s, timeout_s) == auto_heartbeat(nodes)
        assert job.failure.heartbeat_interval_s is None and job.to_dict()["failure"]["heartbeat_interval_s"] is None
    job = make(script, nodes=10_000, failure=Failure(heartbeat_interval_s=0.2))
    assert (job.heartbeat_interval_s, job.heartbeat_timeout_s) == (0.2, 30.0)
    job = make(script, nodes=10_000, failure=Failure(heartbeat_timeout_s=12))
    assert (job.heartbeat_interval_s, job.heartbeat_timeout_s) == (5.0, 12.0)
    assert Job.from_dict(job.to_dict()) == job


def test_a_timeout_below_the_automatic_interval_is_refused_naming_the_field(script):
    with pytest.raises(JobSpecError) as err:
        make(script, nodes=100_000, failure=Failure(heartbeat_timeout_s=20))
    assert err.value.field == "failure.heartbeat_timeout_s"
    assert "automatic for nodes.max=100000" in str(err.value)
    with pytest.raises(JobSpecError, match="failure.heartbeat_interval_s"):
        Failure(heartbeat_interval_s=0)


def test_replicas_default_to_one_where_there_is_more_than_one_node():
    assert [Checkpoint().replicas_for(n) for n in (1, 2, 64)] == [0, 1, 1]
    assert Checkpoint(replicas=0).replicas_for(8) == 0 and Checkpoint(replicas=1).replicas_for(1) == 0
