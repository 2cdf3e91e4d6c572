"""``benchmarks/gpu/run.sh``, the one-GPU benchmark script, checked where there is no GPU.

Without a GPU the script measures nothing and says so; ``--cpu-tiny`` runs every part's code
on the CPU with tiny sizes, so a broken part fails here and not on a rented GPU; every part
parses ``--help``; a part stopped by ``timeout`` still leaves its JSON and is reported failed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks" / "gpu"
RUN_SH = BENCH / "run.sh"
PARTS = ["env", "nccl", "flash", "optim", "fsdp", "charlm", "peers"]
SCRIPTS = ["detect.py", "env_info.py", "nccl_pg.py", "flash_ckpt.py", "ckpt_peers.py", "optim_step.py",
           "fsdp_step.py", "charlm_chaos.py", "summarize.py"]


def _has_gpu() -> bool:
    if shutil.which("nvidia-smi"):
        return True
    import torch

    return torch.cuda.is_available()


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHON": sys.executable, "GPU_BENCH_SCRATCH": str(tmp_path / "scratch"), **extra}
    env.pop("DLROVER_SHM_DIR", None)
    return env


def _shm_segments() -> set[str]:
    shm = Path("/dev/shm")
    return {p.name for p in shm.glob("dlrover-gpubench-*")} if shm.is_dir() else set()


def _run_sh(tmp_path: Path, *args: str, timeout_s: float, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(RUN_SH), *args], capture_output=True, text=True, timeout=timeout_s,
                          env=_env(tmp_path, **env), cwd=tmp_path)


@pytest.mark.timeout(60)
@pytest.mark.skipif(_has_gpu(), reason="this machine has an NVIDIA GPU: run.sh would measure it (minutes)")
def test_without_a_gpu_the_script_says_so_in_one_line_and_exits_0(tmp_path):
    """Where there is no CUDA GPU, run.sh OUTDIR prints one line saying there is none and that
    nothing was measured, exits 0 and writes a summary.json that says the same, every part skipped."""
    out = tmp_path / "out"
    proc = _run_sh(tmp_path, str(out), timeout_s=50)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout
    assert "no CUDA GPU" in lines[0] and "nothing was measured" in lines[0]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mode"] == "no-gpu" and summary["measured"] is False
    assert "no CUDA GPU" in summary["message"]
    assert list(summary["parts"]) == PARTS
    assert {row["status"] for row in summary["parts"].values()} == {"skipped"}
    assert all("no CUDA GPU" in row["reason"] for row in summary["parts"].values())
    assert summary["figures"] == {} and summary["plots"] == []
    assert not list(out.glob("*.png"))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("script", SCRIPTS)
def test_every_part_imports_and_parses_help(script):
    """Each part imports and answers --help (a syntax error fails here)."""
    proc = subprocess.run([sys.executable, str(BENCH / script), "--help"], capture_output=True, text=True,
                          timeout=50, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout


def test_every_python_file_of_the_script_compiles():
    """Every .py file under benchmarks/gpu compiles."""
    files = sorted(BENCH.glob("*.py"))
    assert {f.name for f in files} >= {*SCRIPTS, "_common.py"}
    for f in files:
        compile(f.read_text(), str(f), "exec")


@pytest.mark.timeout(30)
def test_run_sh_is_valid_bash_and_explains_itself():
    """run.sh parses as bash, and --help prints its header: what it needs and what it writes."""
    assert subprocess.run(["bash", "-n", str(RUN_SH)], capture_output=True).returncode == 0
    proc = subprocess.run(["bash", str(RUN_SH), "--help"], capture_output=True, text=True, timeout=20)
    assert proc.returncode == 0
    for needed in ("torch built with CUDA", "plugins/cuda", "plugins/optim_agd", "summary.json", "--cpu-tiny"):
        assert needed in proc.stdout
    bad = subprocess.run(["bash", str(RUN_SH)], capture_output=True, text=True, timeout=20)
    assert bad.returncode == 2 and "usage" in bad.stderr


@pytest.mark.timeout(150)
def test_cpu_tiny_runs_every_part_on_the_cpu(tmp_path):
    """run.sh --cpu-tiny runs each part's code on the CPU with tiny sizes: every part is ok
    (the char LM job only planned), its figures are there, the snapshot restores bit-exact,
    the CUDA-only rows say why they were skipped, and nothing is left in /dev/shm or scratch."""
    out = tmp_path / "out"
    shm_before = _shm_segments()
    proc = _run_sh(tmp_path, "--cpu-tiny", str(out), timeout_s=140)
    summary = json.loads((out / "summary.json").read_text())
    assert proc.returncode == 0, proc.stdout + proc.stderr + json.dumps(summary["parts"], indent=1)
    assert summary["mode"] == "cpu-tiny" and summary["measured"] is False
    parts = summary["parts"]
    assert list(parts) == PARTS
    assert {n: r["status"] for n, r in parts.items()} == {**{n: "ok" for n in PARTS}, "charlm": "skipped"}
    assert "dry run" in parts["charlm"]["reason"]
    charlm = json.loads((out / "charlm.json").read_text())
    assert "examples/charlm/train.py" in charlm["plan"] and "DLROVER_ACCELERATOR=cpu" in charlm["plan"]
    for name in PARTS:
        assert parts[name]["seconds"] > 0 and parts[name]["timeout_s"] > 0
        assert (out / "logs" / f"{name}.log").exists()

    f = summary["figures"]
    assert f["env"]["doctor_auto"] and f["env"]["torch"]
    assert f["nccl"]["backend"] == "gloo" and f["nccl"]["init_s"] > 0 and f["nccl"]["reinit_s"] > 0
    flash = f["flash"]["8MiB"]
    assert flash["bit_exact"] is True
    assert flash["ours_stall_s"] > 0 and flash["ours_reported_stall_s"] > 0 and flash["restore_memory_s"] > 0
    assert flash["d2h_shm_gbps"] > 0 and flash["d2h_pageable_gbps"] > 0
    assert flash["d2h_pinned_gbps"] is None  # CUDA only
    flash_rows = json.loads((out / "flash.json").read_text())["sizes"]["8MiB"]
    assert "needs CUDA" in flash_rows["d2h_pinned"]["skipped"]
    peers = f["peers"]["8MiB"]
    for key in ("torch_save_s", "torch_load_s", "ours_storage_save_s", "ours_storage_load_s", "dcp_async_block_s",
                "dcp_async_total_s"):
        assert peers[key] > 0, key
    assert f["optim"]["agd_step_ms"] > 0 and f["optim"]["adamw_fused_step_ms"] > 0
    assert f["optim"]["agd_vs_adamw_fused"] > 0
    fsdp = json.loads((out / "fsdp.json").read_text())["variants"]
    assert fsdp["fsdp"]["sharded"] and not fsdp["plain"]["sharded"]
    assert f["fsdp"]["fsdp_step_ms"] > 0
    cmp = summary["comparisons"]["8MiB"]
    assert cmp["stall_vs_torch_save"] > 0 and cmp["restore_memory_vs_torch_load"] > 0

    if importlib.util.find_spec("matplotlib") is not None:
        assert summary["plots"] and all((out / p).stat().st_size > 0 for p in summary["plots"])
    else:
        assert summary["plots_skipped"] == "matplotlib is not installed"
    assert _shm_segments() <= shm_before
    scratch = tmp_path / "scratch"
    assert not scratch.exists() or not list(scratch.iterdir())


@pytest.mark.timeout(60)
def test_parts_that_do_not_fit_the_budget_are_skipped(tmp_path):
    """With a budget too small for anything, every part is skipped with the reason and the
    script still writes its summary and exits 0."""
    out = tmp_path / "out"
    proc = _run_sh(tmp_path, "--cpu-tiny", str(out), timeout_s=50, GPU_BENCH_BUDGET_S="20")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert {r["status"] for r in summary["parts"].values()} == {"skipped"}
    assert all("no time left" in r["reason"] for r in summary["parts"].values())


@pytest.mark.timeout(60)
def test_a_part_stopped_by_timeout_keeps_its_json_and_is_reported_failed(tmp_path):
    """A part killed by `timeout` (SIGTERM) writes what it had, marked failed; the summary says
    it timed out; a part that died without JSON is failed with its log's last line; a part
    never run is skipped."""
    slow = tmp_path / "slow.py"
    slow.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(BENCH)!r})
        import _common as c

        def body(args, result, deadline):
            result["figures"]["measured_before_the_kill"] = 1
            print("ready", flush=True)
            time.sleep(60)

        sys.exit(c.run("slow", c.parser(None).parse_args(), body))
    """))
    out = tmp_path / "out"
    (out / "logs").mkdir(parents=True)
    # timeout(1) with a limit the part reaches only once it runs its body: a loaded machine can
    # take seconds to import what the part imports, and a SIGTERM before its handler is set
    # leaves no JSON, which this test is not about. SIGALRM is timeout's own clock going off
    # (coreutils timeout.c: it then signals the command and exits 124).
    # (-k 30: the part's SIGTERM handler writes its JSON; on a loaded machine that can take
    # seconds to be scheduled, and timeout's SIGKILL would then leave none)
    proc = subprocess.Popen(["timeout", "-k", "30", "45", sys.executable, str(slow), "--device", "cpu",
                             "--out", str(out / "slow.json")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        os.kill(proc.pid, signal.SIGALRM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 124, stdout + stderr
    assert (out / "slow.json").exists(), stdout + stderr
    data = json.loads((out / "slow.json").read_text())
    assert data["status"] == "failed" and "terminated" in data["reason"]
    assert data["figures"] == {"measured_before_the_kill": 1}

    (out / "logs" / "crash.log").write_text("Traceback ...\nMemoryError: out of host memory\n")
    (out / ".parts.tsv").write_text("slow\t124\t3.05\t3\t\ncrash\t1\t0.5\t40\t\n")
    spec = importlib.util.spec_from_file_location("gpu_summarize", BENCH / "summarize.py")
    summarize = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(summarize)
    s = summarize.summarize(out, mode="gpu", parts=["slow", "crash", "never"], message="m", budget_s=465,
                            total_s=10, make_plots=False)
    assert s["parts"]["slow"]["status"] == "failed"
    assert s["parts"]["slow"]["reason"].startswith("timed out after 3 s")
    assert s["figures"]["slow"] == {"measured_before_the_kill": 1}
    assert s["parts"]["crash"]["status"] == "failed" and "MemoryError" in s["parts"]["crash"]["reason"]
    assert s["parts"]["never"]["status"] == "skipped"
    assert s["counts"] == {"ok": 0, "failed": 2, "skipped": 1}
    assert json.loads((out / "summary.json").read_text())["counts"] == s["counts"]
