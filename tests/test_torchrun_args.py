"""torchrun's command line translated without click (``dlrover_core.torchrun``): tables of
torchrun argument sets and the Job fields, host plans and agent environments they give, and the
arguments refused with the flag they name. ``tests/test_torchrun_compat.py`` runs the same
command lines under torchrun and ``dlrover run`` side by side; these check the translation alone,
in milliseconds."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import attrs
import click
import pytest

from dlrover_core import env, run_command
from dlrover_core.errors import DLRoverError, JobSpecError
from dlrover_core.signals import SIGNALS_ENV
from dlrover_core.torchrun import (
    REJECTED_FLAGS,
    TorchrunArgs,
    TorchrunArgumentError,
    agent_environment,
    check_supported,
    failure_policy,
    host_plan,
    job_name,
    local_path,
    nproc_per_node,
    parse_rdzv_conf,
    stop_signals,
    to_job,
)

NO_ENV: dict[str, str] = {}


def _job(**flags):
    args = TorchrunArgs(entrypoint=flags.pop("entrypoint", "train.py"), **flags)
    return to_job(args, check_supported(args), workdir="/w", environ=NO_ENV)


def _get(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


#: (torchrun's flags, the Job fields they give). Fields not named keep the Job's defaults.
JOBS = [
    ({}, {"name": "train", "entrypoint": "train.py", "args": (), "nodes.min": 1, "nodes.max": 1,
          "nodes.nproc_per_node": 1, "nodes.node_unit": 1, "accelerator": "auto", "failure.max_restarts": 3,
          "failure.heartbeat_interval_s": None, "failure.heartbeat_timeout_s": None, "env": {}, "workdir": "/w"}),
    ({"args": ("--lr", "1e-3")}, {"args": ("--lr", "1e-3")}),
    ({"nnodes": "2"}, {"nodes.min": 2, "nodes.max": 2}),
    ({"nnodes": "2:4", "node_unit": 2}, {"nodes.min": 2, "nodes.max": 4, "nodes.node_unit": 2}),
    ({"nproc_per_node": "8"}, {"nodes.nproc_per_node": 8}),
    ({"nproc_per_node": "auto"}, {"nodes.nproc_per_node": "auto"}),
    ({"nproc_per_node": "gpu"}, {"nodes.nproc_per_node": "auto"}),
    ({"nproc_per_node": "xpu"}, {"nodes.nproc_per_node": "auto"}),
    ({"simulate_nodes": "3"}, {"nodes.min": 3, "nodes.max": 3}),
    ({"simulate_nodes": "1:3", "nproc_per_node": "2"}, {"nodes.min": 1, "nodes.max": 3, "nodes.nproc_per_node": 2}),
    ({"rdzv_conf": "join_timeout=90, last_call_timeout=5"}, {"nodes.join_timeout_s": 90.0, "nodes.last_call_s": 5.0}),
    ({"max_restarts": 0}, {"failure.max_restarts": 0}),
    ({"monitor_interval": 2.0}, {"failure.heartbeat_interval_s": 2.0, "failure.heartbeat_timeout_s": 30.0}),
    ({"monitor_interval": 5.0}, {"failure.heartbeat_interval_s": 5.0, "failure.heartbeat_timeout_s": 50.0}),
    ({"rdzv_conf": "keep_alive_interval=2,keep_alive_max_attempt=4"},
     {"failure.heartbeat_interval_s": 2.0, "failure.heartbeat_timeout_s": 8.0}),
    ({"rdzv_conf": "heartbeat=3"}, {"failure.heartbeat_interval_s": 3.0, "failure.heartbeat_timeout_s": 30.0}),
    # keep_alive_max_attempt alone: missed heartbeats of the automatic interval (0.5 s at this size)
    ({"rdzv_conf": "keep_alive_max_attempt=10"}, {"failure.heartbeat_interval_s": None,
                                                  "failure.heartbeat_timeout_s": 5.0}),
    ({"shutdown_timeout": 3.0}, {"failure.stop_grace_s": 3.0}),
    ({"role": "trainer"}, {"env": {"ROLE_NAME": "trainer"}}),
    ({"role": "default"}, {"env": {}}),
    ({"rdzv_id": "Job 1!"}, {"name": "job-1"}),
    ({"rdzv_id": "none"}, {"name": "train"}),
    ({"run_id": "r-7", "rdzv_id": "job1"}, {"name": "r-7"}),
    ({"entrypoint": "pkg.train_mod", "module": True}, {"name": "train-mod", "entrypoint": "pkg.train_mod"}),
    ({"accelerator": "cpu"}, {"accelerator": "cpu"}),
    ({"numa_binding": "socket"}, {"nodes.numa_binding": "socket"}),
    ({"virtual_local_rank": True}, {"nodes.virtual_local_rank": True}),
    ({"checkpoint_dir": "s3://bucket/ck", "log_dir": "runs"},
     {"checkpoint.dir": "s3://bucket/ck", "log_dir": str(Path("runs").resolve())}),
    ({"start_method": "fork", "run_path": True, "tee": "3"}, {"entrypoint": "train.py"}),  # accepted, no effect
    ({}, {"parallel.strategies": (("ddp", {}),)}),
    ({"parallel": "fsdp"}, {"parallel.strategies": (("fsdp", {}),)}),
    ({"parallel": " ddp, amp "}, {"parallel.strategies": (("ddp", {}), ("amp", {}))}),
    ({"parallel": '[["mesh", [["data", 2], ["replicate", 2]]], ["fsdp", {"wrap_class": "Block"}]]'},
     {"parallel.strategies": (("mesh", {"dims": [["data", 2], ["replicate", 2]]}), ("fsdp", {"wrap_class": "Block"}))}),
]


@pytest.mark.parametrize(("flags", "fields"), JOBS, ids=[repr(f) for f, _ in JOBS])
def test_torchrun_arguments_give_these_job_fields(flags, fields):
    job = _job(**flags)
    assert {name: _get(job, name) for name in fields} == fields


def test_relative_directories_are_made_absolute_and_urls_kept():
    job = _job(checkpoint_dir="ck", log_dir="lg")
    assert job.checkpoint.dir == str(Path("ck").resolve()) and job.log_dir == str(Path("lg").resolve())
    assert local_path("s3://b/c") == "s3://b/c" and Path(local_path("x")).is_absolute()


def test_the_shutdown_timeout_falls_back_to_torchs_variable():
    """unset: TORCH_ELASTIC_SHUTDOWN_TIMEOUT, as torchrun reads it; the flag wins over it."""
    assert failure_policy(3, None, {}, None, nodes=1, environ={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "7"}).stop_grace_s == 7.0
    assert failure_policy(3, None, {}, 2.0, nodes=1, environ={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "7"}).stop_grace_s == 2.0
    with pytest.raises(TorchrunArgumentError) as caught:
        failure_policy(3, None, {}, None, nodes=1, environ={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "soon"})
    assert caught.value.flag == "--shutdown-timeout"


def test_cpu_counts_the_cores_this_process_may_use():
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert nproc_per_node("cpu") == cores


@pytest.mark.parametrize(("text", "name"), [("train.py", "train"), ("a/b/My_Script.py", "my-script"),
                                            ("pkg.sub.mod", "mod"), ("pkg.mod:main", "mod"), ("!!!", "job"),
                                            ("x" * 60, "x" * 40)])
def test_job_names(text, name):
    assert job_name(text) == name


#: (torchrun's flags, the flag named, or None: a usage error of the line as a whole).
REFUSED = [
    ({"logs_specs": "x"}, None),
    ({"duplicate_stdout_filters": "x"}, None),
    ({"duplicate_stderr_filters": "x"}, None),
    ({"event_log_handler": "console"}, None),
    ({"rdzv_backend": "etcd"}, None),
    ({"module": True, "no_python": True}, None),
    ({"rdzv_conf": "join_timeout"}, "--rdzv-conf"),
    ({"rdzv_conf": "store_type=file"}, "--rdzv-conf"),
    ({"entrypoint": "train.py", "module": True}, "ENTRYPOINT"),
    ({"simulate_nodes": "2", "nnodes": "2"}, None),
    ({"simulate_nodes": "2", "rdzv_endpoint": "h:1"}, None),
    ({"simulate_nodes": "2", "node_rank": 0}, None),
    ({"nproc_per_node": "0"}, "--nproc-per-node"),
    ({"nproc_per_node": "many"}, "--nproc-per-node"),
    ({"max_restarts": -1}, "--max-restarts"),
    ({"parallel": "ddp,fsdp"}, "--parallel"),
    ({"parallel": "[fsdp"}, "--parallel"),
    ({"parallel": '[["mesh", "data"]]'}, "--parallel"),
    ({"parallel": "fsdp,"}, "--parallel"),
]


@pytest.mark.parametrize(("flags", "flag"), REFUSED, ids=[repr(f) for f, _ in REFUSED])
def test_refused_arguments_name_their_flag(flags, flag):
    with pytest.raises(TorchrunArgumentError) as caught:
        _job(**flags)
    assert caught.value.flag == flag
    assert isinstance(caught.value, DLRoverError) and isinstance(caught.value, ValueError)


def test_every_rejected_flag_says_why():
    for flag, why in REJECTED_FLAGS.items():
        dest = flag[2:].replace("-", "_")
        with pytest.raises(TorchrunArgumentError, match=f"{flag} is not supported: "):
            check_supported(TorchrunArgs(entrypoint="t.py", **{dest: "x"}))
        assert why


def test_a_sharded_parallel_flag_makes_the_job_live_sharded():
    """``--parallel fsdp`` is what decides a sharded job's recovery (its state is not replicated)."""
    assert _job(parallel="fsdp").parallel.first_unreplicated() == "fsdp"
    assert _job().parallel.first_unreplicated() is None


def test_values_a_job_field_refuses_are_job_spec_errors():
    with pytest.raises(JobSpecError):
        _job(nnodes="0")
    with pytest.raises(ValueError):
        _job(rdzv_conf="join_timeout=soon")


def test_rdzv_conf():
    assert parse_rdzv_conf("") == {}
    assert parse_rdzv_conf(" join_timeout = 5 ,, is_host=1") == {"join_timeout": "5", "is_host": "1"}


def _plan(**flags):
    args = TorchrunArgs(entrypoint="train.py", **flags)
    conf = check_supported(args)
    return host_plan(to_job(args, conf, workdir="/w", environ=NO_ENV), args, conf, port=lambda: 4242)


#: (torchrun's flags, the host plan: endpoint, node rank, standalone, rdzv id).
PLANS = [
    ({}, ("127.0.0.1:4242", 0, True, "")),
    ({"standalone": True, "rdzv_endpoint": "h:1", "rdzv_id": "j"}, ("127.0.0.1:4242", 0, True, "j")),
    ({"nnodes": "2", "node_rank": 1, "master_addr": "n0"}, ("n0:29500", 1, False, "")),
    ({"nnodes": "2", "node_rank": 0, "master_addr": "n0", "master_port": 1234}, ("n0:1234", 0, False, "")),
    ({"master_port": 1234}, ("127.0.0.1:1234", 0, False, "")),  # one node with a port: not standalone
    ({"nnodes": "2:4", "rdzv_backend": "c10d", "rdzv_endpoint": "n0:29400", "rdzv_id": "job1"},
     ("n0:29400", None, False, "job1")),
    ({"nnodes": "2", "rdzv_backend": "c10d", "rdzv_endpoint": "n0", "node_rank": 1}, ("n0", None, False, "")),
    ({"nnodes": "2", "rdzv_backend": "static", "rdzv_endpoint": "n0:7", "node_rank": 1}, ("n0:7", 1, False, "")),
    ({"nnodes": "2", "rdzv_backend": "c10d", "rdzv_endpoint": "n0", "rdzv_conf": "is_host=true"},
     ("n0", None, False, "")),
]


@pytest.mark.parametrize(("flags", "plan"), PLANS, ids=[repr(f) for f, _ in PLANS])
def test_where_the_agent_finds_the_job_master(flags, plan):
    got = _plan(**flags)
    assert (got.endpoint, got.node_rank, got.standalone, got.rdzv_id) == plan
    assert got.log_dir == got.job.log_dir


@pytest.mark.parametrize("flags", [
    {"standalone": True, "nnodes": "2"},
    {"nnodes": "2:3"},
    {"nnodes": "2"},
    {"nnodes": "2", "rdzv_backend": "c10d"},
    {"nnodes": "2", "rdzv_backend": "c10d", "rdzv_endpoint": "n0", "rdzv_conf": "is_host=false"},
], ids=repr)
def test_host_plans_refused(flags):
    with pytest.raises(TorchrunArgumentError) as caught:
        _plan(**flags)
    assert caught.value.flag is None


def test_a_malformed_endpoint_is_refused():
    with pytest.raises(JobSpecError, match="--rdzv-endpoint"):
        _plan(nnodes="2", rdzv_backend="c10d", rdzv_endpoint="n0:http")


def _environment(nproc="4", **flags):
    args = TorchrunArgs(entrypoint="train.py", nproc_per_node=nproc, **flags)
    return agent_environment(args, nproc_per_node(nproc), environ=NO_ENV,
                             interface=lambda addr: {"10.0.0.5": "eth1"}.get(addr))


#: (torchrun's flags, the agent's environment besides TORCHELASTIC_SIGNALS_TO_HANDLE).
ENVIRONMENTS = [
    ({}, {}),
    ({"redirects": "3"}, {env.CONSOLE_LOCAL_RANKS: ""}),
    ({"redirects": "0:3,2:1"}, {env.CONSOLE_LOCAL_RANKS: "1,3"}),
    ({"redirects": "0:0"}, {}),
    ({"local_ranks_filter": "0,2"}, {env.CONSOLE_LOCAL_RANKS: "0,2"}),
    ({"local_ranks_filter": "0,1,2,3"}, {}),
    ({"redirects": "1:3", "local_ranks_filter": "0,1"}, {env.CONSOLE_LOCAL_RANKS: "0"}),
    ({"nproc": "auto"}, {}),
    ({"no_python": True}, {env.WORKER_EXEC: "1"}),
    ({"local_addr": "10.0.0.5"}, {"GLOO_SOCKET_IFNAME": "eth1"}),
    ({"tee": "0:3"}, {}),
]


@pytest.mark.parametrize(("flags", "expected"), ENVIRONMENTS, ids=[repr(f) for f, _ in ENVIRONMENTS])
def test_the_agents_environment(flags, expected):
    got = _environment(**flags)
    assert got.pop(SIGNALS_ENV) == "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    assert got == expected


def test_a_gloo_interface_already_chosen_is_kept():
    args = TorchrunArgs(entrypoint="t.py", local_addr="10.9.9.9")
    assert "GLOO_SOCKET_IFNAME" not in agent_environment(args, 1, environ={"GLOO_SOCKET_IFNAME": "lo"},
                                                         interface=lambda addr: None)


@pytest.mark.parametrize(("flags", "flag"), [
    ({"tee": "x"}, "--tee"),
    ({"redirects": "a:b"}, "--redirects"),
    ({"local_ranks_filter": "one"}, "--local-ranks-filter"),
    ({"nproc": "auto", "redirects": "1"}, None),
    ({"nproc": "auto", "local_ranks_filter": "0"}, None),
    ({"local_addr": "10.9.9.9"}, "--local-addr"),
], ids=repr)
def test_agent_environments_refused(flags, flag):
    with pytest.raises(TorchrunArgumentError) as caught:
        _environment(**flags)
    assert caught.value.flag == flag


def test_stop_signals():
    assert stop_signals("SIGTERM,SIGINT,SIGTERM") == (signal.SIGTERM, signal.SIGINT)
    for bad in ("SIGKILL", "SIGNOPE"):
        with pytest.raises(TorchrunArgumentError) as caught:
            stop_signals(bad)
        assert caught.value.flag == "--signals-to-handle"


def test_the_commands_defaults_are_the_translations():
    """`dlrover run` with only a script parses into TorchrunArgs' defaults, so the two cannot
    drift apart."""
    ctx = click.Context(run_command.run)
    defaults = {p.name: p.get_default(ctx) for p in run_command.run.params if isinstance(p, click.Option)}
    for field in attrs.fields(TorchrunArgs):
        if field.name in ("entrypoint", "args"):
            continue
        assert defaults[field.name] == field.default, field.name
    assert set(defaults) - {f.name for f in attrs.fields(TorchrunArgs)} == {"dryrun", "progress", "force"}
