"""Parallel strategies on a real 2-rank gloo world (CPU): every strategy trains to the same
loss curve as one process on the same global batch, within its precision's tolerance.

One run of tests/scripts/parallel_train.py per session (both ranks go through every case in
one process group, ~10 s on 2 cores); the tests read its results.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, SCRIPTS, communicate_all, install_dist

TAG_PLUGIN = """
    from dlrover_core import hookimpl

    def tag(model, ctx, *, value):
        model.tag = value
        ctx.on_optimizer(lambda opt: opt.param_groups[0].__setitem__("tag", value))
        return model

    @hookimpl
    def dlrover_register_parallel_strategies(register):
        register(tag, name="tag")
"""


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Run the script as ranks 0 and 1 (the store is hosted here, as an agent would);
    return each rank's results by case."""
    import torch.distributed as dist

    base = tmp_path_factory.mktemp("parallel")
    site = base / "site"
    site.mkdir()
    install_dist(site, "dlrover-plugin-tag", "dlrover_plugin_tag", TAG_PLUGIN, ep_name="tag")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True, wait_for_workers=False)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DLROVER_", "TORCHELASTIC_"))}
    procs = []
    for rank in range(2):
        procs.append(subprocess.Popen(
            [sys.executable, str(SCRIPTS / "parallel_train.py"), str(base)],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "OMP_NUM_THREADS": "1",
                 "DLROVER_ACCELERATOR": "cpu", "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])},
            cwd=base, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        ))
    communicate_all(procs, 150)
    results = [json.loads((base / f"rank{r}.json").read_text()) for r in range(2)]
    for r, res in enumerate(results):
        crashed = {k: v["crash"] for k, v in res.items() if "crash" in v}
        assert not crashed, f"rank {r}: {crashed}"
    return results


def losses(ranks, case):
    assert ranks[0][case]["losses"] == ranks[1][case]["losses"]  # both ranks saw the same global mean
    return ranks[0][case]["losses"]


def close(a, b, rtol):
    return len(a) == len(b) and all(abs(x - y) <= rtol * abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", ["ddp", "fsdp", "mesh_fsdp", "auto_roomy", "auto_tight", "plugin"])
def test_data_parallel_matches_one_process(ranks, case):
    """ddp and FSDP2 (alone, on a mesh, or chosen by auto) give one process's loss curve."""
    assert close(losses(ranks, case), ranks[0]["single"]["losses"], rtol=1e-4)


@pytest.mark.timeout(180)
def test_fsdp_shards_parameters_as_dtensors(ranks):
    fsdp = ranks[0]["fsdp"]
    assert fsdp["param_types"] == ["DTensor"] and fsdp["sharded"] and fsdp["model_type"] == "FSDPNet"
    assert ranks[0]["ddp"]["model_type"] == "DistributedDataParallel"


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("case", "plain"), [("ckpt_ddp", "ddp"), ("ckpt_fsdp", "fsdp")])
def test_activation_checkpointing_recomputes_and_matches(ranks, case, plain):
    """Each block's forward runs twice per step (forward + recomputation), losses unchanged."""
    assert ranks[0][case]["fc1_calls_per_step"] == 2 and ranks[0][plain]["fc1_calls_per_step"] == 1
    assert close(losses(ranks, case), losses(ranks, plain), rtol=1e-5)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("case", "dtype", "rtol"), [
    ("amp_bf16", "torch.bfloat16", 3e-2), ("amp_fp16", "torch.float16", 1e-2), ("amp_fp16_fsdp", "torch.float16", 1e-2),
])
def test_amp_matches_float32_within_its_precision(ranks, case, dtype, rtol):
    """Autocast runs the blocks in low precision, returns float32, and tracks the fp32 curve."""
    r = ranks[0][case]
    assert r["inner_dtypes"] == [dtype] and r["output_dtype"] == "torch.float32"
    assert close(losses(ranks, case), ranks[0]["single"]["losses"], rtol=rtol)


@pytest.mark.timeout(180)
def test_float16_gets_a_gradient_scaler_sharded_under_fsdp(ranks):
    assert ranks[0]["amp_fp16"]["scaler"] == "GradScaler"
    assert ranks[0]["amp_fp16_fsdp"]["scaler"] == "ShardedGradScaler"
    assert ranks[0]["amp_fp16"]["scale"] == 256  # no overflow: never backed off
    skips = ranks[0]["amp_fp16_skips"]  # torch's default first scale, 2**16, overflows at first
    assert skips["scale"] < 2**16 and skips["scale"] == ranks[1]["amp_fp16_skips"]["scale"]


@pytest.mark.timeout(180)
def test_mesh_groups_on_a_real_world(ranks):
    """[("data", 1), ("tensor", 2)]: ranks 0 and 1 share a tensor group; [("data", 2), ...]: a data group."""
    for r in range(2):
        assert ranks[r]["mesh_tensor"]["mesh"] == {"tensor": [0, 1], "data": [r]}
        assert ranks[r]["mesh_fsdp"]["mesh"] == {"tensor": [r], "data": [0, 1]}
    assert close(losses(ranks, "mesh_tensor"), ranks[0]["single"]["losses"], rtol=1e-4)  # ddp over a data group of 1


@pytest.mark.timeout(180)
def test_auto_chooses_from_device_memory(ranks):
    assert ranks[0]["auto_roomy"]["applied"] == ["ddp", "auto"]
    assert ranks[0]["auto_tight"]["applied"] == ["checkpoint", "fsdp", "auto"]


@pytest.mark.timeout(180)
def test_plugin_strategy_is_applied_and_hooks_the_optimizer(ranks):
    """A strategy from an installed plugin (entry point) runs in order and sees the optimizer."""
    r = ranks[1]["plugin"]
    assert r["applied"] == ["ddp", "tag"] and r["model_tag"] == "hello" and r["optimizer_tag"] == "hello"


@pytest.mark.timeout(180)
def test_errors_found_at_prepare_name_the_strategy(ranks):
    for r in range(2):
        bad = ranks[r]["mesh_bad"]
        assert bad["field"] == "parallel.strategies[0].dims" and "world size (2)" in bad["error"]
        missing = ranks[r]["ckpt_missing"]
        assert missing["field"] == "parallel.strategies[0].wrap_class" and "'Attention'" in missing["error"]
