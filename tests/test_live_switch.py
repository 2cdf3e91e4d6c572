"""Whether a job's failures can be recovered live, decided once, in the spec
(``JobSpec.live_blocker``): each parallel strategy declares when it registers whether it keeps
the training state replicated; the job carries the declarations as data; the master, the
agents and the workers read the same answer."""

from __future__ import annotations

import json

import pytest

from dlrover_core import Failure, Job, JobSpecError, Parallel, hookimpl
from dlrover_core import env as env_names
from dlrover_core.errors import PluginError
from dlrover_core.master.job_master import JobMaster
from dlrover_core.parallel_rules import REPLICATED_BUILTINS, first_unreplicated
from dlrover_core.plugins import get_host
from dlrover_core.spec import JobSpec
from dlrover_core.testing import register_plugin
from dlrover_core.train import context
from dlrover_core.validation import declare_replicated

SHARDS = "sharded"  # live, in a world that keeps its size (JobSpec.live_sharded)
NO_MEMORY = ("parallel strategy 'fsdp' shards the training state and checkpoint.memory_every_steps=0: a replacement's "
             "shard comes from its memory snapshot, so every worker restarts from storage")
BLOCK = {"wrap_class": "Block"}


class StrategyPlugin:
    """A third-party plugin with one strategy that declares replicated state and one that
    does not say."""

    @hookimpl
    def dlrover_register_parallel_strategies(self, register):
        register(lambda model, ctx: model, name="replica", replicated=True)
        register(lambda model, ctx: model, name="plain")


@pytest.fixture
def script(workdir):
    (workdir / "train.py").write_text("print('hi')\n")
    return "train.py"


def job(script, strategies=None, *, live_recovery=True, replicated=None) -> Job:
    parallel = None if strategies is None else Parallel(strategies, replicated=replicated)
    return Job(name="live", entrypoint=script, nodes=2, parallel=parallel,
               failure=Failure(live_recovery=live_recovery))


@pytest.mark.parametrize(("strategies", "live_recovery", "replicated", "reason"), [
    (None, True, None, ""),
    (["ddp"], True, None, ""),
    ([("checkpoint", BLOCK), "ddp", "amp", "compile"], True, None, ""),
    (["fsdp"], True, None, SHARDS),
    (["auto"], True, None, SHARDS),
    ([("mesh", [("data", 2)]), "ddp"], True, None, SHARDS),
    (["ddp", "amp"], False, None, "failure.live_recovery=False"),
    (["fsdp"], False, None, "failure.live_recovery=False"),
    (["ddp", "tag"], True, None, SHARDS),  # not resolved: a plugin's strategy counts as sharding
    (["ddp", "tag"], True, ["ddp", "tag"], ""),  # resolved: its plugin declared it replicated
    (["ddp", "amp"], True, ["amp"], SHARDS),  # resolved: the registry's word wins
])
def test_the_live_switch_is_the_specs_answer(script, strategies, live_recovery, replicated, reason):
    """Failures are recovered live with ``Failure(live_recovery=True)``: in a smaller world
    when every strategy keeps the state replicated, in a world that keeps its size
    (``live_sharded``) when one shards it; otherwise the reason names the obstacle."""
    spec = job(script, strategies, live_recovery=live_recovery, replicated=replicated)
    assert spec.live_blocker == ("" if reason == SHARDS else reason)
    assert spec.live_sharded == (reason == SHARDS or (strategies is not None and "fsdp" in strategies
                                                        and not live_recovery))


def test_sharded_state_without_memory_snapshots_restarts_every_worker(script):
    """A replacement's shard comes from its node's memory: with memory snapshots off, the
    blocker says so and names the setting."""
    from dlrover_core import Checkpoint

    spec = Job(name="live", entrypoint=script, nodes=2, parallel=Parallel(["fsdp"]),
               checkpoint=Checkpoint(memory_every_steps=0))
    assert spec.live_sharded and spec.live_blocker == NO_MEMORY


def test_the_built_ins_register_what_the_spec_knows_of_them():
    """The built-ins declare replicated state when they register, and the spec's own list
    (for specs that never met the registry) says the same."""
    declared = {e.name: e.replicated for e in get_host().registries.parallel_strategy.entries()
                if e.distribution == "dlrover-core"}
    assert declared == {"ddp": True, "amp": True, "compile": True, "checkpoint": True,
                        "fsdp": False, "mesh": False, "auto": False}
    assert REPLICATED_BUILTINS == {name for name, replicated in declared.items() if replicated}
    assert first_unreplicated(["ddp", "amp"]) is None and first_unreplicated(["amp", "fsdp", "mesh"]) == "fsdp"


@pytest.mark.parametrize(("strategies", "replicated", "sharded"), [
    (["ddp", "replica"], ("ddp", "replica"), False),
    (["ddp", "plain"], ("ddp",), True),
    (["fsdp", "replica"], ("replica",), True),
])
def test_a_plugins_declaration_reaches_the_spec_as_data(script, strategies, replicated, sharded):
    """Where plugins are loaded (``Job.dryrun()``, ``submit()``, ``run()``) each strategy's
    declaration is copied into ``Parallel.replicated``; a strategy that did not say is taken
    not to keep the state replicated. The processes decode it with the spec."""
    with register_plugin(StrategyPlugin(), name="strategies"):
        resolved = declare_replicated(job(script, strategies))
        assert resolved.parallel.replicated == replicated and resolved.live_sharded == sharded
        plan = job(script, strategies).dryrun()
    assert plan.job.parallel.replicated == replicated
    master = next(p for p in plan.processes if p.role == "master")
    decoded = JobSpec.from_dict(json.loads(master.env[env_names.JOB_SPEC]))
    assert decoded.parallel.replicated == replicated and decoded.live_sharded == sharded


def test_a_job_without_strategies_or_with_unknown_names_resolves_without_error(script):
    assert declare_replicated(job(script)) == job(script)
    resolved = declare_replicated(job(script, ["ddp", "nope"]))  # validate_job reports the unknown name
    assert resolved.parallel.replicated == ("ddp",)


@pytest.mark.parametrize(("hook", "registered", "fragment"), [
    ("dlrover_register_parallel_strategies", lambda register: register(lambda m, c: m, name="s", replicated="yes"),
     "replicated='yes': pass True"),
    ("dlrover_register_storages", lambda register: register(get_host().registries.storage.get("posix"), name="st",
                                                            replicated=True),
     "only parallel strategies declare it"),
])
def test_a_malformed_declaration_is_refused_naming_the_plugin_and_the_fix(hook, registered, fragment):
    plugin = type("Bad", (), {hook: staticmethod(hookimpl(specname=hook)(lambda register: registered(register)))})()
    with pytest.raises(PluginError, match=fragment), register_plugin(plugin, name="bad"):
        pass


def test_the_declarations_round_trip_with_the_spec_and_are_checked(script):
    resolved = job(script, [("checkpoint", BLOCK), "ddp"], replicated=["ddp", "checkpoint"])
    assert resolved.parallel.replicated == ("checkpoint", "ddp")  # in the strategies' order
    assert Job.from_dict(resolved.to_dict()) == resolved
    assert "replicated" not in job(script, ["ddp"]).to_dict()["parallel"]  # unresolved: as before
    with pytest.raises(JobSpecError, match="parallel.replicated"):
        Parallel(["ddp"], replicated=["fsdp"])
    with pytest.raises(JobSpecError, match="parallel.replicated"):
        Parallel(["ddp"], replicated="ddp")


@pytest.mark.parametrize("strategies", [None, ["ddp"], ["fsdp"], ["ddp", "tag"]])
@pytest.mark.parametrize("live_recovery", [True, False])
def test_the_master_and_the_worker_read_the_same_switch(script, monkeypatch, strategies, live_recovery):
    """The master's reason and the worker's ``is_live()`` both come from ``live_blocker``."""
    spec = job(script, strategies, live_recovery=live_recovery)
    master = JobMaster(spec, "job-1", store_host="h", store_factory=lambda: (1, None))
    assert master.live_why == spec.live_blocker
    monkeypatch.setenv(env_names.JOB_SPEC, json.dumps(spec.to_dict()))
    monkeypatch.setenv(env_names.MASTER_ADDR, "127.0.0.1:1")
    monkeypatch.setenv("RANK", "0")
    context.current_job.cache_clear()
    try:
        assert context.is_live() == (spec.live_blocker == "")
    finally:
        context.current_job.cache_clear()
