"""Parallel strategies in one process: the spec's rules, the mesh layout, auto's decisions,
and each strategy's effect on a model (the 2-rank runs are in test_parallel_dist.py)."""

from __future__ import annotations

import pytest
import structlog
import torch
import torch.nn.functional as F

from dlrover_core import Job, JobSpecError, Optimizer, Parallel, hookimpl
from dlrover_core.accelerators.base import DeviceReport
from dlrover_core.accelerators.cpu import CpuAccelerator
from dlrover_core.errors import PluginError
from dlrover_core.parallel import ParallelContext, apply_strategies, mesh_groups
from dlrover_core.parallel.auto import decide, guess_block_class, optimizer_state_tensors
from dlrover_core.plugins import get_host
from dlrover_core.train.context import WorkerInfo

MB = 2**20


class Block(torch.nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(d, 2 * d)
        self.fc2 = torch.nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(3))
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def context(world_size: int = 1, rank: int = 0, local_world_size: int | None = None, **kw) -> ParallelContext:
    info = WorkerInfo(rank=rank, local_rank=rank, world_size=world_size,
                      local_world_size=local_world_size or world_size, node_rank=0, num_nodes=1, restart_count=0,
                      round=0, job_id="", accelerator="cpu", device=torch.device("cpu"))
    return ParallelContext(info=info, optimizer=kw.pop("optimizer", Optimizer("adamw")), **kw)


@pytest.fixture
def script(workdir):
    (workdir / "train.py").write_text("print('hi')\n")
    return "train.py"


# ----- the spec: what is checked before any process starts -------------------------------

@pytest.mark.parametrize(
    ("strategies", "field", "fragment"),
    [
        (["ddp", "fsdp"], "parallel.strategies[1]", "'fsdp' conflicts with 'ddp' at [0]"),
        (["fsdp", "auto"], "parallel.strategies[1]", "'auto' conflicts with 'fsdp' at [0]"),
        (["ddp", "amp", "ddp"], "parallel.strategies[2]", "'ddp' is already at [0]"),
        (["fsdp", ("checkpoint", {"wrap_class": "Block"})], "parallel.strategies[1]", "'checkpoint' listed before 'fsdp'"),
        (["auto", ("checkpoint", {"wrap_class": "Block"})], "parallel.strategies[1]", "'auto' decides"),
        (["ddp", ("mesh", [("data", 2)])], "parallel.strategies[1]", "'mesh' listed first"),
        (["checkpoint"], "parallel.strategies[0].wrap_class", "the class of the modules to recompute"),
        ([("amp", {"dtype": "float8"})], "parallel.strategies[0].dtype", "'bfloat16' or 'float16'"),
        ([("amp", {"init_scale": 0})], "parallel.strategies[0].init_scale", "positive"),
        ([("fsdp", {"wrap_classes": "Block"})], "parallel.strategies[0]", "unknown: wrap_classes"),
        ([("fsdp", {"wrap_class": 3})], "parallel.strategies[0].wrap_class", "a module class name"),
        ([("fsdp", {"param_dtype": "int8"})], "parallel.strategies[0].param_dtype", "bfloat16"),
        ([("auto", {"shard_above": -1})], "parallel.strategies[0].shard_above", "fraction"),
        ([("mesh", [("data", 0)])], "parallel.strategies[0]", "size > 0 or -1"),
        ([("mesh", [("data", 2), ("data", 2)])], "parallel.strategies[0]", "'data' is repeated"),
        ([("mesh", [("data", -1), ("tensor", -1)])], "parallel.strategies[0]", "at most one size of -1"),
        ([("mesh", {"dims": "data"})], "parallel.strategies[0].dims", "(name, size) pairs"),
        ([("ddp", {"x": object()})], "parallel.strategies", "JSON-safe"),
    ],
)
def test_malformed_or_conflicting_strategies_are_named_when_parallel_is_built(strategies, field, fragment):
    """Conflicts, duplicates, order and built-in options fail at Parallel(...), naming the entry."""
    with pytest.raises(JobSpecError) as err:
        Parallel(strategies)
    assert err.value.field == field
    assert fragment in str(err.value)


def test_unknown_strategy_fails_at_validate_listing_the_known_ones(script):
    with pytest.raises(JobSpecError) as err:
        Job(name="demo", entrypoint=script, parallel=Parallel(["ddp", "zero3"])).validate()
    assert err.value.field == "parallel.strategies[1]"
    for name in ("amp", "auto", "checkpoint", "compile", "ddp", "fsdp", "mesh"):
        assert name in str(err.value)


def test_mesh_form_is_normalised_and_survives_to_dict(script):
    """("mesh", [(name, size), ...]) is stored as JSON; a Job crosses processes unchanged."""
    p = Parallel([("mesh", [("data", -1), ("tensor", 2)]), ("fsdp", {"wrap_class": ("Block", "Head")}),
                  ("amp", {"dtype": "bfloat16"})])
    assert p.strategies[0] == ("mesh", {"dims": [["data", -1], ["tensor", 2]]})
    assert p.strategies[1] == ("fsdp", {"wrap_class": ["Block", "Head"]})
    job = Job(name="demo", entrypoint=script, parallel=p)
    assert Job.from_dict(job.to_dict()) == job
    assert Parallel("auto").strategies == (("auto", {}),)


def test_dryrun_prints_the_strategies_and_the_auto_rule(script):
    """The plan names each strategy in order; for auto, the rule and the inputs prepare() will use."""
    text = str(Job(name="demo", entrypoint=script, accelerator="cpu",
                   parallel=Parallel([("mesh", [("data", -1)]), ("auto", {"shard_above": 0.4})])).dryrun())
    assert "## parallel strategies (applied in this order by train.prepare())" in text
    assert "mesh: data=-1" in text
    assert "S <= 0.4·M -> ddp" in text and "S/D <= 0.5·M -> fsdp" in text
    assert "DeviceReport.memory_mb" in text and "parallel_auto" in text
    assert "## parallel" not in str(Job(name="demo", entrypoint=script, accelerator="cpu").dryrun())


# ----- the mesh layout ---------------------------------------------------------------------

def test_mesh_groups_follow_atorch_first_listed_fastest():
    """For [("data", 2), ("tensor", 2)], ranks 0 and 1 differ in their data index."""
    assert mesh_groups([("data", 2), ("tensor", 2)]) == {"data": [[0, 1], [2, 3]], "tensor": [[0, 2], [1, 3]]}
    assert mesh_groups([("tensor", 4), ("pipeline", 2), ("data", 2)]) == {  # ATorch's own example
        "tensor": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
        "pipeline": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
        "data": [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]],
    }


@pytest.fixture
def fake_world():
    """A fake process group of any size (torch's testing backend: no peers, no traffic)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")

    def init(rank: int, world_size: int) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


def test_mesh_strategy_builds_a_device_mesh_with_that_layout(fake_world):
    """Every rank's DeviceMesh groups equal mesh_groups(): the documented mapping, for real."""
    import torch.distributed as dist

    from dlrover_core.parallel.mesh import mesh

    dims = [["data", 2], ["tensor", -1], ["pipeline", 2]]
    expected = mesh_groups([("data", 2), ("tensor", 2), ("pipeline", 2)])
    for rank in range(8):
        fake_world(rank, 8)
        ctx = context(world_size=8, rank=rank)
        model = Net()
        assert mesh(model, ctx, dims=dims) is model
        assert ctx.mesh_dims == (("data", 2), ("tensor", 2), ("pipeline", 2))
        assert ctx.data_parallel_size == 2
        for name, groups in expected.items():
            mine = [g for g in groups if rank in g]
            assert dist.get_process_group_ranks(ctx.mesh.get_group(name)) == mine[0], (rank, name)
        assert ctx.mesh["data"] is not None and ctx.data_mesh().mesh.tolist() == [g for g in expected["data"] if rank in g][0]


def test_mesh_whose_product_is_not_the_world_size_fails_at_prepare_before_any_collective():
    from dlrover_core.parallel.mesh import mesh

    with pytest.raises(JobSpecError) as err:
        mesh(Net(), context(world_size=4), dims=[["data", 2], ["tensor", 3]])
    assert err.value.field == "parallel.strategies.dims"
    assert "data=2 × tensor=3 = 6" in str(err.value) and "world size (4)" in str(err.value)
    with pytest.raises(JobSpecError, match="to divide the world size 4"):
        mesh(Net(), context(world_size=4), dims=[["data", -1], ["tensor", 3]])


# ----- auto --------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("state_mb", "device_mb", "dp", "choice"),
    [
        (400, 1000, 8, ("ddp",)),                  # S <= 0.5 M
        (500, 1000, 8, ("ddp",)),                  # the boundary is inclusive
        (600, 1000, 8, ("fsdp",)),                 # S > 0.5 M, S/D = 75 <= 500
        (3000, 1000, 8, ("fsdp",)),                # S/D = 375
        (6000, 1000, 8, ("checkpoint", "fsdp")),   # S/D = 750 > 500
        (3000, 1000, 4, ("checkpoint", "fsdp")),   # S/D = 750 > 500
        (3000, 1000, 1, ("checkpoint", "fsdp")),   # one process: sharding alone cannot help
        (10**9, None, 8, ("ddp",)),                # memory unknown
    ],
)
def test_auto_rule(state_mb, device_mb, dp, choice):
    """S = params + grads + optimizer state against M: ddp, fsdp, or checkpoint + fsdp."""
    d = decide(state_bytes=state_mb * MB, device_mb=device_mb, data_parallel_size=dp)
    assert d.choice == choice
    assert d.sharded_mb == pytest.approx(state_mb / dp)


def test_auto_thresholds_are_options():
    assert decide(state_bytes=600 * MB, device_mb=1000, data_parallel_size=8, shard_above=0.7).choice == ("ddp",)
    assert decide(state_bytes=600 * MB, device_mb=1000, data_parallel_size=1, checkpoint_above=0.7).choice == ("fsdp",)


def test_optimizer_state_is_sized_by_optimizer():
    assert optimizer_state_tensors(Optimizer("adamw")) == 2
    assert optimizer_state_tensors(Optimizer("sgd", lr=0.1)) == 0
    assert optimizer_state_tensors(Optimizer("sgd", lr=0.1, momentum=0.9)) == 1
    assert optimizer_state_tensors(Optimizer("agd")) == 2  # unknown: the cautious AdamW-like guess


def test_auto_measures_the_model_logs_its_decision_and_applies_it(monkeypatch):
    """Parameter, gradient and AdamW state bytes against the probe's memory shared by the node's
    workers; the decision is logged with the numbers, then checkpoint + fsdp are applied."""
    model = Net()
    n = sum(p.numel() for p in model.parameters())
    # the cpu "device" is host memory, shared by 4 local workers: M = 0.004 MiB each
    monkeypatch.setattr(CpuAccelerator, "probe", lambda self: DeviceReport(accelerator="cpu", present=True, count=1,
                                                                           memory_mb=0.016))
    ctx = context(world_size=4, local_world_size=4)
    with structlog.testing.capture_logs() as logs:
        out = apply_strategies(model, [("auto", {})], ctx)
    assert out is model
    event = next(e for e in logs if e["event"] == "parallel_auto")
    assert event["param_mb"] == pytest.approx(n * 4 / MB, abs=1e-3)
    assert event["optimizer_mb"] == pytest.approx(2 * n * 4 / MB, abs=1e-3)
    assert event["device_mb"] == pytest.approx(0.004)
    assert event["choice"] == ["checkpoint", "fsdp"]
    assert event["wrap_class"] == f"{__name__}.Block"
    assert ctx.applied == ["checkpoint", "fsdp", "auto"]  # fsdp without a process group: logged, model unchanged
    assert model.blocks[0].forward.__wrapped__ is not None


def test_auto_picks_ddp_when_the_model_fits():
    ctx = context(device_mb=10_000)
    with structlog.testing.capture_logs() as logs:
        apply_strategies(Net(), [("auto", {})], ctx)
    assert ctx.applied == ["ddp", "auto"]
    assert next(e for e in logs if e["event"] == "parallel_auto")["choice"] == ["ddp"]


def test_guess_block_class_finds_the_repeated_block():
    assert guess_block_class(Net()) == f"{__name__}.Block"
    assert guess_block_class(torch.nn.Linear(2, 2)) is None


# ----- each strategy's effect ----------------------------------------------------------------

def test_amp_runs_the_forward_in_low_precision_and_returns_float32():
    """bfloat16 autocast inside, float32 outputs, float32 parameters with unchanged names."""
    model = Net()
    names = [n for n, _ in model.named_parameters()]
    seen = []
    model.blocks[0].fc1.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    out = apply_strategies(model, Parallel([("amp", {"dtype": "bfloat16"})]).strategies, context())
    y = out(torch.randn(4, 8))
    assert seen == [torch.bfloat16] and y.dtype == torch.float32
    assert [n for n, _ in out.named_parameters()] == names
    assert {p.dtype for p in out.parameters()} == {torch.float32}
    y.sum().backward()
    assert model.head.weight.grad.dtype == torch.float32


def test_amp_float16_scales_gradients_and_skips_overflowing_steps():
    """float16 gets a GradScaler: loss.backward() is unchanged, the optimizer's step unscales,
    and a step whose gradients overflow is skipped while the scale backs off."""
    torch.manual_seed(0)
    model = Net()
    ctx = context()
    model = apply_strategies(model, Parallel([("amp", {"dtype": "float16", "init_scale": 1024})]).strategies, ctx)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ctx.finish(opt)
    x = torch.randn(4, 8)
    model(x).sum().backward()
    unscaled = model.head.weight.grad.clone() / 1024
    before = model.head.weight.detach().clone()
    opt.step()
    assert torch.allclose(model.head.weight, before - 0.1 * unscaled, rtol=1e-3, atol=1e-5)
    assert opt._dlrover_loss_scale.scaler.get_scale() == 1024
    opt.zero_grad()
    (model(x).sum() * 1e30).backward()  # overflows in float16
    before = model.head.weight.detach().clone()
    opt.step()
    assert torch.equal(model.head.weight, before)
    assert opt._dlrover_loss_scale.scaler.get_scale() == 512


def test_activation_checkpointing_recomputes_blocks_and_keeps_gradients():
    torch.manual_seed(0)
    plain = Net()
    torch.manual_seed(0)
    model = apply_strategies(Net(), Parallel([("checkpoint", {"wrap_class": "Block"})]).strategies, context())
    calls = []
    model.blocks[1].fc1.register_forward_hook(lambda *a: calls.append(1))
    x = torch.randn(4, 8)
    model(x).pow(2).sum().backward()
    plain(x).pow(2).sum().backward()
    assert len(calls) == 2  # forward, and the recomputation in backward
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, atol=1e-6), name


def test_amp_and_checkpoint_survive_deepcopy():
    """A copied model (an EMA, say) runs its own parameters, still under autocast and recomputation."""
    import copy

    model = apply_strategies(Net(), Parallel([("checkpoint", {"wrap_class": "Block"}), ("amp", {"dtype": "bfloat16"})])
                             .strategies, context())
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
    seen = []
    twin.blocks[0].fc1.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    x = torch.randn(2, 8)
    assert torch.equal(twin(x), torch.zeros(2, 1)) and not torch.equal(model(x), torch.zeros(2, 1))
    assert seen == [torch.bfloat16]


def test_wrap_class_that_no_module_has_is_named_with_the_classes_there_are():
    with pytest.raises(JobSpecError) as err:
        apply_strategies(Net(), Parallel(["amp", ("checkpoint", {"wrap_class": "mypkg.Attention"})]).strategies, context())
    assert err.value.field == "parallel.strategies[1].wrap_class"
    assert "Block, Linear, ModuleList, Net" in str(err.value)


def test_dotted_wrap_class_matches_that_class_only():
    model = apply_strategies(Net(), [("checkpoint", {"wrap_class": f"{__name__}.Block"})], context())
    assert all(hasattr(b.forward, "__wrapped__") for b in model.blocks)
    assert not hasattr(model.head.forward, "__wrapped__")


def test_compile_is_accepted_and_compiles_in_place():
    """torch.compile through nn.Module.compile: same object and parameter names (nothing is
    compiled until the first forward, which this test does not run: slow on cpu)."""
    model = Net()
    names = [n for n, _ in model.named_parameters()]
    out = apply_strategies(model, Parallel([("compile", {"mode": "default", "dynamic": False})]).strategies, context())
    assert out is model and model._compiled_call_impl is not None
    assert [n for n, _ in out.named_parameters()] == names


def test_ddp_and_fsdp_leave_a_one_process_model_alone():
    model = Net()
    assert apply_strategies(model, [("ddp", {})], context()) is model


class TagPlugin:
    """A third-party strategy: tags the model and, once built, the optimizer."""

    @staticmethod
    def tag(model, ctx, *, value):
        model.tag = value
        ctx.on_optimizer(lambda opt: opt.param_groups[0].__setitem__("tag", value))
        return model

    @hookimpl
    def dlrover_register_parallel_strategies(self, register):
        register(self.tag, name="tag")
        register(lambda model, ctx: None, name="broken")


def test_a_plugin_strategy_is_accepted_by_job_and_applied_in_order(script):
    get_host().register(TagPlugin(), name="tagger", distribution="dlrover-plugin-tagger")
    p = Parallel(["amp", ("tag", {"value": "x"})])
    Job(name="demo", entrypoint=script, parallel=p)  # the name is known now
    ctx = context()
    model = apply_strategies(Net(), p.strategies, ctx)
    assert ctx.applied == ["amp", "tag"] and model.tag == "x"
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ctx.finish(opt)
    assert opt.param_groups[0]["tag"] == "x"
    with pytest.raises(PluginError, match="'broken' .*dlrover-plugin-tagger.* returned None"):
        apply_strategies(Net(), [("broken", {})], context())
