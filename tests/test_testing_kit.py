"""The test kit for plugin authors (dlrover_core.testing): in-memory storage and recording
scheduler, the storage contract, register_plugin, and the pytest fixtures."""

from __future__ import annotations

import contextlib
import os
import types
import uuid
from pathlib import Path

import attrs
import pytest
import torch

from dlrover_core import Checkpoint, JobSpecError, JobState, Nodes, PluginError, SchedulerError, hookimpl
from dlrover_core.master.__main__ import _relauncher
from dlrover_core.plugins import PluginHost, get_host
from dlrover_core.protocol import NodeRelaunch
from dlrover_core.scheduler_backend import Capabilities, SchedulerOption
from dlrover_core.storage.posix import PosixStorage
from dlrover_core.testing import (
    TESTING_PLUGIN,
    InMemoryStorage,
    RecordingScheduler,
    StorageContract,
    fresh_host,
    register_plugin,
)
from dlrover_core.testing import pytest_plugin as kit_pytest_plugin
from dlrover_core.testing.scheduler import RecordingRequest
from dlrover_core.train import Checkpointer

# ----- the storage contract ----------------------------------------------------------------


class TestInMemoryStorage(StorageContract):
    @pytest.fixture
    def storage(self):
        yield InMemoryStorage(f"kit-{uuid.uuid4().hex}")
        InMemoryStorage.reset()


class TestPosixStorage(StorageContract):
    """The contract is the one the built-in posix storage meets."""

    @pytest.fixture
    def storage(self, tmp_path):
        return PosixStorage(str(tmp_path / "ck"))


class TornStorage(PosixStorage):
    """Writes straight to the final name: what the contract exists to catch."""

    name = "torn"

    @contextlib.contextmanager
    def open_write(self, path):
        final = self._path(path)
        final.parent.mkdir(parents=True, exist_ok=True)
        with open(final, "wb") as f:
            yield f


@pytest.mark.parametrize("check", ["test_storage_file_is_invisible_until_the_write_completes",
                                   "test_storage_interrupted_write_publishes_nothing",
                                   "test_storage_interrupted_commit_keeps_the_previous_step"])
def test_contract_fails_a_storage_that_publishes_torn_files(tmp_path, check):
    with pytest.raises(AssertionError):
        getattr(StorageContract(), check)(TornStorage(str(tmp_path / "ck")))


def test_checkpointer_on_memory_storage_commits_atomically(dlrover_host, monkeypatch, log_events):
    """A Checkpointer on the kit's storage saves and restores; a commit interrupted after the
    shards are written leaves the previous step as the one that loads."""
    url = "kit-checkpointer"
    ck = Checkpointer(url, storage="memory", memory_every_steps=0, persist_every_steps=1)
    model = torch.nn.Linear(3, 1)
    torch.nn.init.constant_(model.weight, 1.0)
    assert ck.save(1, {"model": model})

    def interrupted(self, step):
        raise OSError("crashed before the marker")

    monkeypatch.setattr(InMemoryStorage, "commit", interrupted)
    torch.nn.init.constant_(model.weight, 2.0)
    ck.save(2, {"model": model})
    monkeypatch.undo()
    assert "step_0000000002/rank_00000-round0.safetensors" in ck.storage.list()
    target = torch.nn.Linear(3, 1)
    restored = Checkpointer(url, storage="memory").load({"model": target})
    assert restored.step == 1 and torch.equal(target.weight, torch.ones(1, 3))
    assert [e["step"] for e in log_events if e["event"] == "checkpoint_commit_failed"] == [2]


# ----- the recording scheduler -------------------------------------------------------------


def test_recording_scheduler_records_plans_and_starts_nothing(dlrover_host, make_job, tmp_path):
    job = make_job(scheduler="recording", nodes=2)
    plan = job.dryrun()
    assert RecordingScheduler.dryruns == [plan] and RecordingScheduler.submitted == []
    assert plan.processes == () and '"scheduler": "recording"' in plan.files["job.json"]
    result = job.run(progress=False)
    assert result.state == JobState.SUCCEEDED
    (submitted,) = RecordingScheduler.submitted
    assert submitted.job == job and result.job_id == submitted.job_id
    assert [h.job_id for h in RecordingScheduler.cancelled] == [submitted.job_id]  # wait() always cleans up
    assert len(RecordingScheduler.dryruns) == 2  # run() dry-runs first


def test_recording_scheduler_final_state_and_capabilities(dlrover_host, make_job):
    RecordingScheduler.final_state = JobState.FAILED
    result = make_job(scheduler="recording").run(progress=False)
    assert result.state == JobState.FAILED and "final_state=FAILED" in result.reason

    class RigidScheduler(RecordingScheduler):
        name = "rigid"
        capabilities = Capabilities(elastic=False)

    plugin = types.SimpleNamespace(dlrover_register_schedulers=hookimpl(lambda register: register(RigidScheduler)))
    with register_plugin(plugin, name="rigid"):
        with pytest.raises(JobSpecError, match="does not run elastic jobs"):
            make_job(scheduler="rigid", nodes=Nodes(min=1, max=2)).dryrun()


class QueueScheduler(RecordingScheduler):
    """A recording scheduler with options, as a backend author declares them."""

    name = "queue"
    options = (
        SchedulerOption(name="queue", type=str, default="default", env="DLROVER_QUEUE", help="the queue to submit to"),
        SchedulerOption(name="priority", type=int, default=0, help="higher runs first"),
        SchedulerOption(name="tags", type=list, default=(), env="DLROVER_QUEUE_TAGS", help="labels of the job"),
    )


@pytest.fixture
def queue_scheduler(dlrover_host):
    plugin = types.SimpleNamespace(dlrover_register_schedulers=hookimpl(lambda register: register(QueueScheduler)))
    with register_plugin(plugin, name="queue"):
        yield QueueScheduler


def test_options_are_validated_naming_the_option(queue_scheduler, make_job):
    """An unknown option names the known ones; a value of the wrong type names the type; a
    scheduler without options says so. Job.validate() (and so dryrun, run, make_job) refuses
    them before anything is planned."""
    with pytest.raises(JobSpecError, match=r"scheduler_options\['prio'\]=3: an option of scheduler 'queue': "
                                           r"priority, queue, tags") as info:
        make_job(scheduler="queue", scheduler_options={"prio": 3})
    assert (info.value.field, info.value.value) == ("scheduler_options['prio']", 3)
    with pytest.raises(JobSpecError, match=r"scheduler_options\['priority'\]='high': an int"):
        make_job(scheduler="queue", scheduler_options={"priority": "high"})
    with pytest.raises(JobSpecError, match=r"scheduler_options\['priority'\]=True: an int"):
        QueueScheduler.check_options({"priority": True})  # a bool is not a number here
    with pytest.raises(JobSpecError, match=r"scheduler_options\['tags'\]='a,b': a list\[str\]"):
        QueueScheduler.check_options({"tags": "a,b"})
    with pytest.raises(JobSpecError, match="scheduler 'recording' takes no options"):
        make_job(scheduler="recording", scheduler_options={"queue": "gpu"})
    assert QueueScheduler.dryruns == []


def test_an_option_set_in_the_job_wins_over_its_variable_and_shows_in_the_dry_run(queue_scheduler, make_job,
                                                                                 monkeypatch):
    """Resolved options: the Job's value, else the variable, else the default; the plan
    carries them and its text shows each with where it came from."""
    monkeypatch.setenv("DLROVER_QUEUE", "from-env")
    monkeypatch.setenv("DLROVER_QUEUE_TAGS", "a, b")
    plan = make_job(scheduler="queue").dryrun()
    assert (plan.option("queue"), plan.option("priority"), plan.option("tags")) == ("from-env", 0, ("a", "b"))
    plan = make_job(scheduler="queue", scheduler_options={"queue": "gpu", "priority": 5}).dryrun()
    assert [(o.name, o.value, o.source) for o in plan.options] == [
        ("queue", "gpu", "job"), ("priority", 5, "job"), ("tags", ("a", "b"), "$DLROVER_QUEUE_TAGS")]
    text = str(plan)
    assert '    queue="gpu"  (job)\n    priority=5  (job)\n    tags=["a", "b"]  ($DLROVER_QUEUE_TAGS)' in text
    monkeypatch.setenv("DLROVER_QUEUE_TAGS", "")  # empty: unset
    assert make_job(scheduler="queue").dryrun().option("tags") == ()


def test_a_variable_that_does_not_parse_names_itself(queue_scheduler, make_job, monkeypatch):
    class Typed(QueueScheduler):
        options = (SchedulerOption(name="slots", type=int, default=1, env="DLROVER_QUEUE_SLOTS"),)

    monkeypatch.setenv("DLROVER_QUEUE_SLOTS", "many")
    with pytest.raises(JobSpecError, match=r"DLROVER_QUEUE_SLOTS='many': a whole number: it is the fallback of "
                                           r"scheduler_options\['slots'\]"):
        Typed.resolve_options({})
    assert Typed.resolve_options({"slots": 4})[0].value == 4  # the Job's value: the variable is not read


def test_submit_executes_the_typed_request_of_its_own_dryrun(dlrover_host, make_job):
    """dryrun's plan carries the backend's typed request; submit writes plan.txt and refuses a
    plan whose request another backend made."""
    plan = make_job(scheduler="recording").dryrun()
    assert isinstance(plan.request, RecordingRequest) and plan.request.job_json == plan.files["job.json"]
    handle = RecordingScheduler().submit(plan)
    assert (Path(plan.log_dir) / "plan.txt").read_text() == str(plan) + "\n"
    assert handle.job_id == plan.job_id
    foreign = attrs.evolve(plan, request={"job.json": plan.files["job.json"]})
    with pytest.raises(SchedulerError, match="cannot submit this plan"):
        RecordingScheduler().submit(foreign)


def test_the_masters_relaunch_request_reaches_the_backend_with_what_it_replaces(dlrover_host, make_job, tmp_path):
    """The master asks the job's backend for a node with a NodeRelaunch: the node id, the node
    it replaces and why; the backend gets it whole."""
    job = make_job(scheduler="recording", nodes=2)
    relaunch = _relauncher(job, "job-1", tmp_path / "runs" / "job-1")
    relaunch(NodeRelaunch(node_id=2, replaces=0, reason="node 0 excluded: straggler", attempt=0))
    ((handle, request),) = RecordingScheduler.relaunched
    assert (handle.job_id, handle.scheduler) == ("job-1", "recording")
    assert (request.node_id, request.replaces, request.reason) == (2, 0, "node 0 excluded: straggler")


def test_status_is_the_masters_answer_mapped_by_the_protocol(dlrover_host, make_job):
    RecordingScheduler.final_state = JobState.FAILED
    run = make_job(scheduler="recording", nodes=3).submit()
    status = run.status()
    assert (status.state, status.max_nodes, status.step) == (JobState.FAILED, 3, -1)


# ----- register_plugin and fresh_host ------------------------------------------------------


class MirrorStorage(PosixStorage):
    name = "mirror"


class MirrorPlugin:
    @hookimpl
    def dlrover_register_storages(self, register):
        register(MirrorStorage)


def test_register_plugin_is_undone_after_the_block(dlrover_host):
    with register_plugin(MirrorPlugin(), name="mirror", distribution="dlrover-plugin-mirror") as info:
        assert info.backends == {"storage": ["mirror"]} and info.hooks == ["dlrover_register_storages"]
        assert get_host().registries.storage.entry("mirror").distribution == "dlrover-plugin-mirror"
    assert "mirror" not in get_host().registries.storage
    assert "mirror" not in get_host().plugins


def test_register_plugin_puts_back_what_it_replaced(dlrover_host):
    with register_plugin(MirrorPlugin(), name="mirror", distribution="v1"):
        with register_plugin(MirrorPlugin(), name="mirror", distribution="v2"):
            assert get_host().registries.storage.entry("mirror").distribution == "v2"
        assert get_host().registries.storage.entry("mirror").distribution == "v1"


def test_register_plugin_fails_loudly_on_a_broken_plugin(dlrover_host, log_events):
    class Broken:
        @hookimpl
        def dlrover_register_storages(self, register):
            register(object)  # not a storage

    with pytest.raises(PluginError, match="malformed storage"):
        with register_plugin(Broken(), name="broken"):
            pass
    assert "broken" not in get_host().plugins
    with register_plugin(Broken(), name="broken", check=False) as info:  # to test how a host reports it
        assert info.errors and "malformed storage" in info.errors[0]
    assert any(e["event"] == "plugin_register_failed" and e["plugin"] == "broken" for e in log_events)


def test_register_plugin_refuses_a_name_conflict(dlrover_host):
    class Posix2:
        @hookimpl
        def dlrover_register_storages(self, register):
            register(PosixStorage)

    with pytest.raises(PluginError, match="more than one plugin: dlrover-core and dlrover-plugin-posix2"):
        with register_plugin(Posix2(), name="posix2", distribution="dlrover-plugin-posix2"):
            pass


def test_register_plugin_accepts_a_module():
    module = types.ModuleType("dlrover_plugin_inline")
    module.dlrover_register_storages = hookimpl(lambda register: register(MirrorStorage))
    with register_plugin(module) as info:
        assert info.name == "dlrover_plugin_inline"
        assert "mirror" in get_host().registries.storage


def test_fresh_host_is_process_wide_and_restored():
    outer = get_host()
    with fresh_host() as host:
        assert get_host() is host and host is not outer
        host.registries  # noqa: B018 - run the register hooks
        assert host.plugins[TESTING_PLUGIN].backends == {"storage": ["memory"], "scheduler": ["recording"]}
        assert all(p.builtin for p in host.plugins.values())  # no installed plugin
    assert get_host() is outer
    with fresh_host(testing_backends=False) as host:
        assert "memory" not in host.registries.storage


# ----- the pytest fixtures -----------------------------------------------------------------


def test_pytest_plugin_is_loaded_through_its_entry_point(pytestconfig):
    assert pytestconfig.pluginmanager.get_plugin("dlrover") is kit_pytest_plugin


def test_dlrover_host_fixture_is_the_process_wide_host(dlrover_host):
    assert get_host() is dlrover_host
    assert dlrover_host.registries.storage.names() == ["memory", "posix"]
    assert "recording" in dlrover_host.registries.scheduler


def test_make_job_puts_every_path_under_tmp_path(make_job, tmp_path):
    job = make_job()
    assert job.name == "test-job" and job.accelerator == "cpu"
    for path in (job.entrypoint, job.workdir, job.log_dir, job.checkpoint.dir):
        assert os.path.commonpath([path, str(tmp_path)]) == str(tmp_path)
    other = make_job(name="other", checkpoint=Checkpoint(dir="elsewhere", keep_last=1), args=["--steps", "3"])
    assert (other.name, other.checkpoint.keep_last, other.args) == ("other", 1, ("--steps", "3"))
    with pytest.raises(JobSpecError, match="checkpoint.storage"):
        make_job(checkpoint=Checkpoint(storage="nowhere"))


def test_log_events_captures_structlog_events_as_dicts(log_events):
    host = PluginHost(load_entry_points=False)
    host.register(types.SimpleNamespace(dlrover_register_gpus=hookimpl(lambda register: None)), name="typo")
    (event,) = [e for e in log_events if e["event"] == "plugin_rejected"]
    assert event["plugin"] == "typo" and event["log_level"] == "warning"
