"""Checkpoints without dlrover (issue 16 part 4): `dlrover checkpoint ls | inspect | export`.

A real job (one node, two DDP workers) trains an `nn.Sequential` with AdamW and checkpoints
through the agent's saver and the master's commit; its checkpoint directory is exported to
each format with the CLI and loaded into a fresh model and optimizer by a subprocess that
imports only torch and safetensors. The errors a user meets (nothing committed, a step that
is not committed, a corrupt shard) are checked on the same files.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import structlog.testing
import torch
from click.testing import CliRunner

from dlrover_core import Checkpoint, CheckpointError, Failure, Job, JobState, Nodes
from dlrover_core.checkpoint.commit import write_commit
from dlrover_core.checkpoint.export import export_step, list_steps, read_step
from dlrover_core.checkpoint.layout import DTENSORS_KEY, SHARDING_KEY, encode, parse_header
from dlrover_core.checkpoint.saver import shard_path
from dlrover_core.cli import main
from dlrover_core.protocol.messages import ShardReport
from dlrover_core.storage.posix import PosixStorage
from dlrover_core.train import Checkpointer, ModelOptimizerState

STEPS = 10  # steps 0..9; persisted every 3 steps, the last one forced: 0, 3, 6, 9

#: the job's training script: DDP over 2 workers; rank 0 also torch.saves the state it
#: checkpoints at the last step (the reference a plain-torch loader compares with)
TRAIN = """
import sys

import torch

from dlrover_core import train

steps, ref = int(sys.argv[1]), sys.argv[2]
info = train.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
model, opt = train.prepare(model, lr=0.01)
ckpt = train.Checkpointer()
for step in range(steps):
    g = torch.Generator().manual_seed(100 * info.rank + step)
    x = torch.randn(8, 6, generator=g)
    loss = ((model(x) - x[:, :3]) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    state = {"model": model, "optimizer": opt, "data": {"rank": info.rank, "seen": 8 * (step + 1)}}
    ckpt.save(step, state, force=step == steps - 1)
    if step == steps - 1 and info.rank == 0:
        torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict()}, ref)
"""

#: loads an export into a fresh model and optimizer with torch / safetensors / DCP only (no
#: dlrover), compares every tensor with the reference bit for bit, takes one more step from
#: both and compares again; prints what it loaded as JSON
LOAD = """
import json
import sys

import torch

fmt, out, ref_path = sys.argv[1:4]


def fresh():
    torch.manual_seed(123)  # other weights than the trained ones
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    return model, torch.optim.AdamW(model.parameters(), lr=0.5)


model, opt = fresh()
if fmt == "torch":
    model.load_state_dict(torch.load(f"{out}/model.pt", weights_only=True))
    opt.load_state_dict(torch.load(f"{out}/optimizer.pt", weights_only=True))
    data = torch.load(f"{out}/data.pt", weights_only=True)
elif fmt == "safetensors":
    from safetensors import safe_open
    from safetensors.torch import load_file

    model.load_state_dict(load_file(f"{out}/model.safetensors"))
    with safe_open(f"{out}/optimizer.safetensors", "pt") as f:
        meta = f.metadata()
        state = {}
        for key in f.keys():
            _, index, name = key.split("/", 2)
            state.setdefault(int(index), {})[name] = f.get_tensor(key)
    for index, values in json.loads(meta["state_values"]).items():
        state.setdefault(int(index), {}).update(values)
    opt.load_state_dict({"state": state, "param_groups": json.loads(meta["param_groups"])})
    with open(f"{out}/data.json") as f:
        data = json.load(f)
else:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optimizer": optim_sd, "data": {"rank": -1, "seen": -1}}
    dcp.load(state, checkpoint_id=out)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    data = state["data"]

ref = torch.load(ref_path, weights_only=True)
twin, twin_opt = fresh()
twin.load_state_dict(ref["model"])
twin_opt.load_state_dict(ref["optimizer"])


def same(a, b, what):
    assert isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)), what


def compare(what):
    sd, ref_sd = model.state_dict(), twin.state_dict()
    assert list(sd) == list(ref_sd), (what, list(sd))
    for k in sd:
        same(sd[k], ref_sd[k], f"{what}: model {k}")
    osd, ref_osd = opt.state_dict(), twin_opt.state_dict()
    assert sorted(osd["state"]) == sorted(ref_osd["state"]) == [0, 1, 2, 3], (what, sorted(osd["state"]))
    for i, s in ref_osd["state"].items():
        assert sorted(osd["state"][i]) == sorted(s), (what, i, sorted(osd["state"][i]))
        for k, v in s.items():
            same(osd["state"][i][k], v, f"{what}: optimizer state {i} {k}")
    assert json.dumps(osd["param_groups"]) == json.dumps(ref_osd["param_groups"]), (what, osd["param_groups"])


compare("loaded")
x = torch.randn(8, 6, generator=torch.Generator().manual_seed(7))
for m, o in ((model, opt), (twin, twin_opt)):
    loss = ((m(x) - x[:, :3]) ** 2).mean()
    o.zero_grad()
    loss.backward()
    o.step()
compare("after one more step")
assert not [m for m in sys.modules if m.startswith("dlrover")]
print(json.dumps({"ok": True, "data": data, "lr": opt.param_groups[0]["lr"]}))
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """(checkpoint directory, reference file) of a real 2-worker job."""
    tmp = tmp_path_factory.mktemp("job")
    script = tmp / "train_export.py"
    script.write_text(TRAIN)
    ref = tmp / "reference.pt"
    job = Job(name="export", entrypoint=str(script), args=[str(STEPS), str(ref)],
              nodes=Nodes(min=1, max=1, nproc_per_node=2), accelerator="cpu",
              checkpoint=Checkpoint(dir=str(tmp / "ck"), memory_every_steps=1, persist_every_steps=3, keep_last=10),
              failure=Failure(max_restarts=0), log_dir=str(tmp / "runs"))
    result = job.run(progress=False)
    assert result.state == JobState.SUCCEEDED, result.reason
    assert ref.exists()
    return tmp / "ck", ref


def cli(*args: str) -> tuple[int, str, str]:
    done = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return done.exit_code, done.stdout, done.stderr


def load_plainly(fmt: str, out: Path, ref: Path) -> dict:
    """Run LOAD in a fresh interpreter; its JSON line."""
    done = subprocess.run([sys.executable, "-c", LOAD, fmt, str(out), str(ref)], capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("fmt", ["torch", "safetensors", "dcp"])
def test_an_export_loads_into_a_fresh_model_and_optimizer_with_plain_torch(trained, tmp_path, fmt):
    """`dlrover checkpoint export CK --to FMT OUT` of a real job's newest committed step
    (rank 0's shard of a DDP state) loads with torch / safetensors / DCP alone into a fresh
    nn.Sequential and AdamW: every tensor equals the state the script had at that step,
    bit for bit, the optimizer's hyperparameters too, and one more step gives the same
    parameters and optimizer state as a model restored from the script's own torch.save."""
    ck, ref = trained
    out = tmp_path / f"export-{fmt}"
    code, stdout, stderr = cli("checkpoint", "export", str(ck), "--to", fmt, str(out))
    assert code == 0, stdout + stderr
    assert stdout.startswith(f"step {STEPS - 1} -> {out} ({fmt}): ")
    expected = {"torch": {"model.pt", "optimizer.pt", "data.pt"},
                "safetensors": {"model.safetensors", "optimizer.safetensors", "data.json"},
                "dcp": {".metadata", "__0_0.distcp"}}[fmt]
    assert {p.name for p in out.iterdir()} == expected
    loaded = load_plainly(fmt, out, ref)
    assert loaded == {"ok": True, "data": {"rank": 0, "seen": 8 * STEPS}, "lr": 0.01}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ls_lists_every_committed_step_with_its_shards_checked(trained):
    """`ls --json`: the steps persisted every 3 steps and the forced last one, each saved
    by 2 ranks, with a CRC32 that matches; the table says the same."""
    ck, _ = trained
    code, stdout, _ = cli("checkpoint", "ls", str(ck), "--json")
    assert code == 0
    steps = json.loads(stdout)
    assert [s["step"] for s in steps] == [0, 3, 6, 9]
    assert [s["latest"] for s in steps] == [False, False, False, True]
    for s in steps:
        assert s["world_size"] == 2 and s["valid"] and s["time"] > 0
        assert [(sh["rank"], sh["ok"]) for sh in s["shards"]] == [(0, True), (1, True)]
        assert all(isinstance(sh["crc32"], int) for sh in s["shards"])
        assert s["bytes"] == sum((ck / sh["file"]).stat().st_size for sh in s["shards"])
    code, stdout, _ = cli("checkpoint", "ls", str(ck))
    assert code == 0 and "9 (latest)" in stdout and stdout.count("ok, CRC ok") == 4


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_inspect_shows_the_model_tensors_the_optimizer_and_each_ranks_entries(trained):
    ck, _ = trained
    code, stdout, _ = cli("checkpoint", "inspect", str(ck), "--step", "6", "--json")
    assert code == 0
    info = json.loads(stdout)
    assert (info["step"], info["world_size"], info["rank"]) == (6, 2, 0)
    assert info["metadata"]["format"] == "dlrover-state/1" and sorted(info["metadata"]["files"]) == ["0", "1"]
    model, optim, data = info["entries"]
    assert (model["key"], model["kind"], model["export_as"]) == ("model", "model", "model")
    assert model["tensors"] == {
        "0.weight": {"shape": [16, 6], "dtype": "float32", "bytes": 384},
        "0.bias": {"shape": [16], "dtype": "float32", "bytes": 64},
        "2.weight": {"shape": [3, 16], "dtype": "float32", "bytes": 192},
        "2.bias": {"shape": [3], "dtype": "float32", "bytes": 12},
    }
    assert optim["kind"] == "optimizer" and optim["params"] == 4 and optim["keyed_by"] == "index"
    assert optim["state_keys"] == ["exp_avg", "exp_avg_sq", "step"]
    assert optim["param_groups"][0]["lr"] == 0.01 and optim["param_groups"][0]["params"] == 4
    assert data == {"key": "data", "kind": "other", "export_as": "data", "bytes": 0,
                    "value": {"rank": 0, "seen": 56}}
    code, stdout, _ = cli("checkpoint", "inspect", str(ck), "--step", "6", "--rank", "1", "--json")
    assert code == 0 and json.loads(stdout)["entries"][2]["value"] == {"rank": 1, "seen": 56}
    code, stdout, _ = cli("checkpoint", "inspect", str(ck))
    assert code == 0 and "step 9  world size 2" in stdout and "0.weight" in stdout and "exp_avg_sq" in stdout
    code, _, stderr = cli("checkpoint", "inspect", str(ck), "--rank", "2")
    assert code == 1 and "rank 2 is out of range: step 9 was saved by ranks 0..1" in stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_docs_recipe_for_reading_a_shard_by_hand_works(trained, monkeypatch):
    """docs/checkpoint-format.md's Python blocks compile, and its by-hand reader (CRC check,
    safetensors, the tree's inverse) restores the job's newest step into a fresh model and
    optimizer equal to the script's own state."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "checkpoint-format.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    for i, block in enumerate(blocks):
        compile(block, f"docs/checkpoint-format.md python block {i}", "exec")
    (by_hand,) = [b for b in blocks if "def unflatten" in b]
    ck, ref = trained
    monkeypatch.chdir(ck.parent)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
    exec(by_hand, {"model": model, "optimizer": optimizer})
    expected = torch.load(ref, weights_only=True)
    for k, v in expected["model"].items():
        assert torch.equal(model.state_dict()[k], v)
    assert optimizer.param_groups[0]["lr"] == 0.01
    assert torch.equal(optimizer.state_dict()["state"][2]["exp_avg"], expected["optimizer"]["state"][2]["exp_avg"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_step_that_is_not_committed_is_refused_listing_the_committed_ones(trained, tmp_path):
    ck, _ = trained
    (ck / "step_0000000010").mkdir()  # a step directory without a commit: a crash mid-save
    (ck / "step_0000000010" / "rank_00000-round0.safetensors").write_bytes(b"torn")
    try:
        for step in ("4", "10"):
            code, stdout, stderr = cli("checkpoint", "export", str(ck), "--step", step, "--to", "torch",
                                       str(tmp_path / "out"))
            assert code == 1, stdout
            assert f"step {step} is not committed" in stderr and "committed steps: 0, 3, 6, 9" in stderr
        assert not (tmp_path / "out").exists()
        assert [s.step for s in list_steps(PosixStorage(str(ck)))] == [0, 3, 6, 9]
    finally:
        shutil.rmtree(ck / "step_0000000010")


def _flip_byte_in_data(path: Path) -> None:
    data = bytearray(path.read_bytes())
    _, _, start = parse_header(bytes(data))
    data[start + 5] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_corrupt_shard_is_named_with_its_crc_mismatch(trained, tmp_path):
    """A flipped byte in rank 0's shard of the newest step: `ls` marks that step damaged,
    names the file and the CRC mismatch, and exits 1; `export` of that step refuses the
    same way and writes nothing; an older step still exports."""
    ck = tmp_path / "ck"
    shutil.copytree(trained[0], ck)
    meta = json.loads((ck / "step_0000000009" / "checkpoint.json").read_text())
    shard = ck / "step_0000000009" / meta["shards"]["0"]["file"]
    _flip_byte_in_data(shard)
    code, stdout, _ = cli("checkpoint", "ls", str(ck), "--json")
    assert code == 1
    steps = {s["step"]: s for s in json.loads(stdout)}
    assert [s["valid"] for s in steps.values()] == [True, True, True, False]
    bad = steps[9]["shards"][0]
    assert not bad["ok"] and bad["file"] == f"step_0000000009/{shard.name}"
    assert "does not match the committed" in bad["error"] and shard.name in bad["error"]
    code, stdout, stderr = cli("checkpoint", "export", str(ck), "--to", "torch", str(tmp_path / "out"))
    assert code == 1
    assert f"step 9 rank 0: step_0000000009/{shard.name}: CRC32" in stderr and "does not match" in stderr
    assert not (tmp_path / "out").exists()
    code, stdout, stderr = cli("checkpoint", "export", str(ck), "--step", "6", "--to", "torch", str(tmp_path / "out"))
    assert code == 0, stderr
    assert torch.load(tmp_path / "out" / "data.pt", weights_only=True) == {"rank": 0, "seen": 56}
    # without reading the shards, ls sees only whether each file is there
    (ck / "step_0000000003" / json.loads((ck / "step_0000000003" / "checkpoint.json").read_text())
     ["shards"]["1"]["file"]).unlink()
    code, stdout, _ = cli("checkpoint", "ls", str(ck), "--no-verify", "--json")
    assert code == 1
    steps = {s["step"]: s for s in json.loads(stdout)}
    assert [s["valid"] for s in steps.values()] == [True, False, True, True]
    assert steps[3]["shards"][1]["error"].endswith(": missing") and steps[3]["shards"][0]["bytes"] > 0


# ----- without a job -------------------------------------------------------------------------


def test_nothing_committed_is_a_clear_error(tmp_path):
    """An empty directory, and one whose only step never got its commit."""
    code, _, stderr = cli("checkpoint", "export", str(tmp_path), "--to", "torch", str(tmp_path / "out"))
    assert code == 1 and "no committed step" in stderr and "no 'latest' marker" in stderr
    code, stdout, _ = cli("checkpoint", "ls", str(tmp_path))
    assert code == 0 and "no committed step" in stdout
    (tmp_path / "step_0000000003").mkdir()
    (tmp_path / "step_0000000003" / "rank_00000-round0.safetensors").write_bytes(encode({"state": {}}))
    with pytest.raises(CheckpointError, match="no committed step"):
        read_step(PosixStorage(str(tmp_path)))
    code, _, stderr = cli("checkpoint", "inspect", str(tmp_path / "nope"))
    assert code == 1 and "no such checkpoint directory" in stderr


def test_export_refuses_a_directory_that_is_not_empty(tmp_path):
    Checkpointer(str(tmp_path / "ck"), persist_every_steps=1).save(1, {"w": torch.ones(2)})
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not an empty directory"):
        export_step(PosixStorage(str(tmp_path / "ck")), tmp_path / "out", to="torch")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]


def _trained_pair(model: torch.nn.Module) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    for i in range(2):
        model(torch.randn(4, 6, generator=torch.Generator().manual_seed(i))).sum().backward()
        opt.step()
        opt.zero_grad()
    return opt


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_model_optimizer_state_exports_as_plain_model_and_optimizer(tmp_path):
    """`train.ModelOptimizerState` keys the optimizer by parameter name: `torch` writes it
    keyed by index (what `optimizer.load_state_dict` takes), `dcp` keyed by name (what
    `get_state_dict` gives and `dcp.load` fills)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    opt = _trained_pair(model)
    Checkpointer(str(tmp_path / "ck"), persist_every_steps=1).save(4, {"train": ModelOptimizerState(model, opt)})
    storage = PosixStorage(str(tmp_path / "ck"))
    assert export_step(storage, tmp_path / "t", to="torch")["files"] == ["model.pt", "optimizer.pt"]
    fresh = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1.0)
    fresh.load_state_dict(torch.load(tmp_path / "t" / "model.pt", weights_only=True))
    osd = torch.load(tmp_path / "t" / "optimizer.pt", weights_only=True)
    assert osd["param_groups"][0]["params"] == [0, 1, 2, 3]
    fresh_opt.load_state_dict(osd)
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    for i, s in opt.state_dict()["state"].items():
        for k, v in s.items():
            assert torch.equal(fresh_opt.state_dict()["state"][i][k], v)

    export_step(storage, tmp_path / "d", to="dcp")
    fresh = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1.0)
    msd, fosd = get_state_dict(fresh, fresh_opt)
    dcp.load({"model": msd, "optimizer": fosd}, checkpoint_id=str(tmp_path / "d"))
    set_state_dict(fresh, fresh_opt, model_state_dict=msd, optim_state_dict=fosd)
    assert fresh_opt.param_groups[0]["lr"] == 0.02
    assert torch.equal(fresh_opt.state_dict()["state"][3]["exp_avg"], opt.state_dict()["state"][3]["exp_avg"])


def test_dcp_export_refuses_an_index_keyed_optimizer_it_cannot_name(tmp_path):
    """A model with float buffers (BatchNorm) has more entries than parameters: the
    optimizer's indices cannot be named, so `dcp` refuses and says what works; `torch`
    exports it."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.BatchNorm1d(4))
    opt = _trained_pair(model)
    Checkpointer(str(tmp_path / "ck"), persist_every_steps=1).save(2, {"model": model, "optimizer": opt})
    storage = PosixStorage(str(tmp_path / "ck"))
    with pytest.raises(CheckpointError, match=r"cannot name the parameters of optimizer 'optimizer'.*"
                                              r"ModelOptimizerState.*--to torch"):
        export_step(storage, tmp_path / "d", to="dcp")
    assert not (tmp_path / "d").exists()
    export_step(storage, tmp_path / "t", to="torch")
    torch.optim.AdamW(model.parameters()).load_state_dict(torch.load(tmp_path / "t" / "optimizer.pt"))


def _with_metadata(data: bytes, **changes: str) -> bytes:
    """A dlrover shard's bytes with ``__metadata__`` fields replaced (the data unchanged)."""
    entries, metadata, start = parse_header(data)
    text = json.dumps({**entries, "__metadata__": {**metadata, **changes}}, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data[start:]


def test_dtensor_shards_of_every_rank_are_assembled_into_full_tensors(tmp_path):
    """A step saved by 2 ranks, each holding half of a DTensor's rows (their global offsets
    in DCP_SHARDING_INFO) beside a replicated bias: the export has the whole tensor."""
    full = torch.arange(8 * 3, dtype=torch.float32).view(8, 3)
    bias = torch.tensor([1.0, 2.0, 3.0])
    storage = PosixStorage(str(tmp_path / "ck"))
    shards = {}
    for rank in range(2):
        piece = full[4 * rank : 4 * rank + 4].clone()
        data = encode({"state": {"model": {"w": piece, "b": bias}}}, step=5, rank=rank, world_size=2)
        data = _with_metadata(data, **{
            DTENSORS_KEY: json.dumps(["state/model/w"]),
            SHARDING_KEY: json.dumps({"state/model/w": {"saved_offsets": [4 * rank, 0]},
                                      "state/model/b": {"saved_offsets": [0]}})})
        path = shard_path(5, rank, 0)
        storage.write_bytes(path, data)
        _, _, start = parse_header(data)
        shards[rank] = ShardReport(node_id=0, rank=rank, step=5, world_size=2, round=0, file=path.split("/")[1],
                                   crc32=zlib.crc32(data[start:]), bytes=len(data) - start)
    write_commit(storage, step=5, world_size=2, round_index=0, shards=shards)
    with structlog.testing.capture_logs() as logs:
        saved = read_step(storage)
    assert {"event": "checkpoint_shards_assembled", "log_level": "info", "step": 5, "world_size": 2, "keys": 1} in logs
    assert saved.assembled == ("state/model/w",)
    assert torch.equal(saved.state["model"]["w"], full) and torch.equal(saved.state["model"]["b"], bias)
    export_step(storage, tmp_path / "out", to="safetensors")
    from safetensors.torch import load_file

    assert torch.equal(load_file(str(tmp_path / "out" / "model.safetensors"))["w"], full)
    _flip_byte_in_data(tmp_path / "ck" / shard_path(5, 1, 0))
    with pytest.raises(CheckpointError, match=r"step 5 rank 1: .*rank_00001-round0.safetensors: CRC32 .* does not match"):
        read_step(storage)


def test_the_cli_help_names_the_formats():
    code, stdout, _ = cli("checkpoint", "export", "--help")
    assert code == 0 and "torch" in stdout and "safetensors" in stdout and "dcp" in stdout
    code, stdout, _ = cli("checkpoint", "--help")
    assert code == 0 and all(c in stdout for c in ("ls", "inspect", "export"))
