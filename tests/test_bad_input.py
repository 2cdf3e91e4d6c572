"""Bad input found while trying the project: each is refused with the field and the fix, or
behaves as documented, instead of a wrong job, a loop that never ends, or a traceback.

* ``Job(args="--lr 1e-3")`` (one string) is a JobSpecError with the split to use, not nine
  one-character arguments; the same through ``Job.from_dict``; ``env`` likewise.
* ``ElasticSampler.next_batch()`` returns ``None`` once at the end of an epoch and then starts
  the next one, as its docstring says; the README's loop never waits on ``None``.
* ``dlrover run --log-dir`` that cannot be created is one line, not a traceback.
* ``dlrover run --nproc-per-node`` far above this machine's cores asks for ``--force``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from dlrover_core import Job
from dlrover_core.cli import main
from dlrover_core.errors import JobSpecError
from dlrover_core.run_command import MAX_CPU_WORKERS_PER_CORE
from dlrover_core.train import ElasticSampler

# ----- Job(args=...) ---------------------------------------------------------------------------


def test_args_as_one_string_is_refused_with_the_split_to_use():
    with pytest.raises(JobSpecError) as info:
        Job(name="j", entrypoint="json.tool", args="--lr 1e-3")
    assert info.value.field == "args"
    assert "args=['--lr', '1e-3']" in str(info.value) and "shlex.split" in str(info.value)
    with pytest.raises(JobSpecError, match="invalid args=7"):
        Job(name="j", entrypoint="json.tool", args=7)
    assert Job(name="j", entrypoint="json.tool", args=["--lr", "1e-3"]).args == ("--lr", "1e-3")
    assert Job(name="j", entrypoint="json.tool", args=("a b",)).args == ("a b",)  # one argument with a space


def test_args_and_env_from_a_dict_are_checked_the_same_way():
    """A hand-written JSON job (``Job.from_dict``) with ``"args": "--lr 1e-3"`` is refused too
    (cattrs alone would also split it into characters); so is an env that is not a mapping."""
    data = Job(name="j", entrypoint="json.tool", args=["--steps", "3"]).to_dict()
    assert Job.from_dict(data).args == ("--steps", "3")
    with pytest.raises(JobSpecError, match=r"invalid args='--lr 1e-3'.*\['--lr', '1e-3'\]"):
        Job.from_dict({**data, "args": "--lr 1e-3"})
    with pytest.raises(JobSpecError, match="invalid env='A=1'"):
        Job.from_dict({**data, "env": "A=1"})
    with pytest.raises(JobSpecError, match="invalid env='A=1'"):
        Job(name="j", entrypoint="json.tool", env="A=1")
    assert Job(name="j", entrypoint="json.tool", env=[("A", "1")]).env == {"A": "1"}


# ----- ElasticSampler at the end of an epoch -----------------------------------------------------


def test_next_batch_returns_none_once_then_starts_the_next_epoch():
    s = ElasticSampler(5, 2, shuffle=False, rank=0, world_size=1)
    assert [s.next_batch() for _ in range(4)] == [[0, 1], [2, 3], [4], None]
    assert s.next_batch() == [0, 1] and s.epoch == 1  # "keep iterating to go on"
    s.set_epoch(7)  # or choose the epoch
    assert s.next_batch() == [0, 1] and s.epoch == 7


def test_the_readme_loop_never_waits_on_none():
    """The README's loop, on 2 ranks for 3 epochs and a bit: every step has a batch on every
    rank, and every epoch is the dataset exactly once."""
    samplers = [ElasticSampler(10, 2, seed=3, rank=r, world_size=2) for r in range(2)]
    epochs: dict[int, list[int]] = {}
    for _step in range(3 * 3 + 1):  # 3 steps per epoch (4 + 4 + 2 samples)
        for sampler in samplers:
            ids = sampler.next_batch()
            if ids is None:  # the epoch ended: the next call starts the next one
                ids = sampler.next_batch()
            assert ids is not None
            epochs.setdefault(sampler.epoch, []).extend(ids)
    assert [sorted(epochs[e]) for e in (0, 1, 2)] == [list(range(10))] * 3
    assert epochs[0] != epochs[1]  # reshuffled


def test_a_loop_that_retries_on_none_gets_a_batch_at_once():
    """``while (ids := next_batch()) is None`` ends after one retry (bounded here, so that the
    old behaviour, None forever, fails instead of hanging)."""
    s = ElasticSampler(4, 2, rank=0, world_size=1, drop_last=True)
    for _ in range(2):
        s.next_batch()
    results = []
    for _ in range(3):
        results.append(s.next_batch())
        if results[-1] is not None:
            break
    assert results[0] is None and results[-1] is not None and len(results) == 2


def test_a_checkpoint_taken_at_the_epochs_end_resumes_in_the_next_epoch():
    """Saved right after the ``None`` and loaded at another world size: the next call is the
    next epoch's first step, not a second ``None``."""
    s = ElasticSampler(6, 3, seed=1, rank=0, world_size=1)
    while s.next_batch() is not None:
        pass
    state = s.state_dict()
    resumed = [ElasticSampler(6, 1, seed=1, rank=r, world_size=3) for r in range(3)]
    for r in resumed:
        r.load_state_dict(state)
    first = [r.next_batch() for r in resumed]
    assert all(b is not None and len(b) == 1 for b in first) and resumed[0].epoch == 1
    legacy = ElasticSampler(6, 3, seed=1, rank=0, world_size=1)  # a state saved before "epoch_ended" existed
    legacy.load_state_dict({k: v for k, v in state.items() if k != "epoch_ended"})
    assert legacy.next_batch() is None and legacy.next_batch() is not None


def test_drop_last_with_a_dataset_smaller_than_one_step_is_refused():
    """Every epoch would be empty: next_batch would return None forever."""
    with pytest.raises(ValueError, match=r"every epoch is empty.*world_size \(2\) x batch_size \(4\) = 8"):
        ElasticSampler(7, 4, rank=0, world_size=2, drop_last=True)
    short = ElasticSampler(7, 4, rank=1, world_size=2)  # without drop_last: one short step per epoch
    assert len(short.next_batch()) == 3 and short.next_batch() is None
    assert ElasticSampler(1, 4, rank=1, world_size=2).next_batch() == []  # fewer samples than ranks


# ----- dlrover run -------------------------------------------------------------------------------


@pytest.fixture
def script(tmp_path, monkeypatch) -> str:
    monkeypatch.chdir(tmp_path)
    Path("train.py").write_text("print('trained')\n")
    return "train.py"


def test_run_with_a_log_dir_that_cannot_be_created_is_one_line(script, tmp_path):
    (tmp_path / "a-file").write_text("")
    result = CliRunner().invoke(main, ["run", "--log-dir", "a-file/runs", "--accelerator", "cpu", script])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    lines = result.output.strip().splitlines()
    assert lines == ["Error: cannot create the log directory 'a-file/runs': Not a directory; "
                     "pass --log-dir with a directory you can write to"], result.output
    assert not (tmp_path / "dlrover-runs").exists()


def test_submit_with_a_log_dir_that_cannot_be_created_is_one_line(script, tmp_path):
    (tmp_path / "a-file").write_text("")
    Path("job.py").write_text("from dlrover_core import Job\n"
                              "job = Job(name='j', entrypoint='train.py', log_dir='a-file/runs')\n")
    result = CliRunner().invoke(main, ["submit", "job.py"])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert result.output.strip().splitlines() == [
        "Error: cannot create the log directory 'a-file/runs': Not a directory; "
        "pass a Job(log_dir=...) in job.py with a directory you can write to"]


def test_nproc_per_node_far_above_the_cores_asks_for_force(script, monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    limit = MAX_CPU_WORKERS_PER_CORE * 2
    result = CliRunner().invoke(main, ["run", "--dryrun", "--accelerator", "cpu", "--nproc-per-node", "64", script])
    assert result.exit_code == 2, result.output
    assert (f"--nproc-per-node 64 starts 64 cpu workers, more than {MAX_CPU_WORKERS_PER_CORE} per core of this "
            f"machine's 2 cores ({limit})") in result.output
    assert f"Use --nproc-per-node {limit} or fewer" in result.output and "--force" in result.output
    # every simulated node runs here: 2 nodes x 5 workers = 10 > 8
    result = CliRunner().invoke(main, ["run", "--dryrun", "--accelerator", "cpu", "--simulate-nodes", "2",
                                       "--nproc-per-node", "5", script])
    assert result.exit_code == 2 and "5 per node x 2 nodes" in result.output, result.output
    assert "--nproc-per-node 4 or fewer" in result.output
    # at the limit, or with --force, the plan is printed
    ok = CliRunner().invoke(main, ["run", "--dryrun", "--accelerator", "cpu", "--nproc-per-node", str(limit), script])
    assert ok.exit_code == 0 and "# plan: scheduler=local" in ok.output, ok.output
    forced = CliRunner().invoke(main, ["run", "--dryrun", "--force", "--accelerator", "cpu", "--nproc-per-node", "64",
                                       script])
    assert forced.exit_code == 0 and "# plan: scheduler=local" in forced.output, forced.output
