"""Write ``summary.json`` (and PNG plots when matplotlib imports) from the parts' JSON files.

    python benchmarks/gpu/summarize.py OUTDIR --mode gpu|cpu-tiny|no-gpu|gpu-unusable
        --parts env,nccl,... [--message LINE] [--budget-s S] [--total-s S] [--no-plots]

``run.sh`` calls it last (and alone, without a GPU). Standard library only (matplotlib
optional), so it runs wherever ``python3`` does.

``summary.json``::

    mode        gpu (measured on a CUDA GPU) | cpu-tiny (the parts' code run on the CPU with
                tiny sizes: a smoke test, the figures mean nothing) | no-gpu | gpu-unusable
    measured    true only in gpu mode with at least one part ok
    message     one line: what happened
    machine     what detect.py found (GPUs, torch, CUDA)
    parts       {name: {status: ok|failed|skipped, reason, seconds, timeout_s, rc, json, log}}
    counts      {ok, failed, skipped}
    figures     {part: that part's "figures"}
    comparisons {size: ratios across parts: our Flash Checkpoint stall and restore against
                 the pinned copy ceiling, torch.save, DCP async_save, torch.load}
    plots       the PNG files written (``plots_skipped``: why none)

A part's status comes from its JSON, overridden by how its process ended: killed by
``timeout`` (exit 124 or 137) is ``failed`` ("timed out after N s"), no JSON is ``failed``
with the last line of its log, and ``run.sh`` can mark a part ``skipped`` before running it
(no time left in the budget).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any


def _load(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _last_line(path: Path) -> str:
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "no log"
    return lines[-1][-300:] if lines else "empty log"


def _runs(tsv: Path) -> dict[str, dict[str, Any]]:
    """run.sh's record of each part: ``name, rc, seconds, timeout_s, note``."""
    out: dict[str, dict[str, Any]] = {}
    if not tsv.exists():
        return out
    for line in tsv.read_text().splitlines():
        fields = line.split("\t")
        if len(fields) < 4:
            continue
        name, rc, seconds, timeout_s = fields[:4]
        out[name] = {"rc": int(rc) if rc.lstrip("-").isdigit() else None, "seconds": float(seconds or 0),
                     "timeout_s": float(timeout_s or 0), "note": fields[4] if len(fields) > 4 else ""}
    return out


def part_status(name: str, run: dict[str, Any] | None, data: dict[str, Any] | None, outdir: Path,
                default_reason: str) -> dict[str, Any]:
    row: dict[str, Any] = {"status": "skipped", "reason": default_reason, "seconds": None, "timeout_s": None,
                           "rc": None, "json": None, "log": None}
    if run is None:
        return row
    row.update(seconds=round(run["seconds"], 2), timeout_s=run["timeout_s"], rc=run["rc"])
    if run["note"].startswith("skipped:"):
        row["reason"] = run["note"].removeprefix("skipped:").strip()
        return row
    log = outdir / "logs" / f"{name}.log"
    row["log"] = str(log.relative_to(outdir)) if log.exists() else None
    if data is not None:
        row["json"] = f"{name}.json"
    if run["rc"] in (124, 137):
        partial = " (partial results in its JSON)" if data is not None else ""
        row.update(status="failed", reason=f"timed out after {run['timeout_s']:.0f} s{partial}")
    elif data is None:
        row.update(status="failed", reason=f"exit {run['rc']} and no JSON; last log line: {_last_line(log)}")
    else:
        row.update(status=data.get("status", "failed"), reason=data.get("reason"))
        if run["rc"] != 0 and row["status"] == "ok":
            row.update(status="failed", reason=f"exit {run['rc']}")
    return row


def _ratio(a: Any, b: Any) -> float | None:
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or not b:
        return None
    return float(f"{a / b:.4g}")


def comparisons(figures: dict[str, Any]) -> dict[str, Any]:
    """Our Flash Checkpoint against the ceilings and the peers, per state size both measured."""
    flash, peers = figures.get("flash") or {}, figures.get("peers") or {}
    out = {}
    for size, f in flash.items():
        if not isinstance(f, dict):
            continue
        p = peers.get(size) or {}
        stall, restore = f.get("ours_stall_s"), f.get("restore_memory_s")
        out[size] = {
            "stall_s": stall,
            "stall_vs_pinned_ceiling": f.get("stall_vs_pinned_ceiling"),
            "stall_vs_torch_save": _ratio(stall, p.get("torch_save_s")),
            "stall_vs_dcp_async_save": _ratio(stall, p.get("dcp_async_block_s")),
            "stall_vs_dcp_async_save_pinned": _ratio(stall, p.get("dcp_async_pinned_block_s")),
            "stall_vs_ours_storage_save": _ratio(stall, p.get("ours_storage_save_s")),
            "restore_memory_s": restore,
            "restore_vs_h2d_pinned": f.get("restore_vs_h2d_pinned"),
            "restore_memory_vs_torch_load": _ratio(restore, p.get("torch_load_s")),
            "restore_storage_vs_torch_load": _ratio(p.get("ours_storage_load_s"), p.get("torch_load_s")),
            "meets_goal_80pct_of_pinned": f.get("meets_goal"),
        }
    return out


# ----- plots ---------------------------------------------------------------------------------


def _bars(ax: Any, groups: list[str], series: dict[str, list[Any]], ylabel: str, log: bool = False) -> bool:
    """Grouped bars; ``None`` values are left out. Returns whether anything was drawn."""
    names = [n for n, vals in series.items() if any(isinstance(v, (int, float)) for v in vals)]
    if not names or not groups:
        return False
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [g + (i - (len(names) - 1) / 2) * width for g in range(len(groups))]
        vals = [v if isinstance(v, (int, float)) else 0 for v in series[name]]
        ax.bar(xs, vals, width, label=name)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.legend(fontsize=7)
    return True


def plots(outdir: Path, figures: dict[str, Any], title: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    flash, peers = figures.get("flash") or {}, figures.get("peers") or {}
    optim, fsdp = figures.get("optim") or {}, figures.get("fsdp") or {}
    sizes = [s for s in flash if isinstance(flash[s], dict)]
    written = []

    def save(fig: Any, name: str) -> None:
        fig.suptitle(title, fontsize=8)
        fig.tight_layout()
        fig.savefig(outdir / name, dpi=110)
        written.append(name)

    def col(src: dict[str, Any], key: str, groups: list[str]) -> list[Any]:
        return [(src.get(g) or {}).get(key) for g in groups]

    fig, ax = plt.subplots(figsize=(7, 4))
    if _bars(ax, sizes, {"ours (Checkpointer.save)": col(flash, "ours_stall_s", sizes),
                         "pinned D2H copy (ceiling)": col(flash, "d2h_pinned_s", sizes),
                         "torch.save": col(peers, "torch_save_s", sizes),
                         "DCP async_save": col(peers, "dcp_async_block_s", sizes),
                         "DCP async_save, pinned stager": col(peers, "dcp_async_pinned_block_s", sizes),
                         "ours to storage (no agent)": col(peers, "ours_storage_save_s", sizes)},
             "training stall of one save, s (log)", log=True):
        ax.set_title("checkpoint save: time the training loop waits")
        save(fig, "save_stall.png")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    if _bars(ax, sizes, {"ours from memory": col(flash, "restore_memory_s", sizes),
                         "ours from storage": col(peers, "ours_storage_load_s", sizes),
                         "torch.load(map_location=cuda)": col(peers, "torch_load_s", sizes),
                         "pinned H2D copy (ceiling)": col(flash, "h2d_pinned_s", sizes)},
             "restore into the live model, s (log)", log=True):
        ax.set_title("restore host -> device")
        save(fig, "restore.png")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    if _bars(ax, sizes, {"ours": col(flash, "ours_gbps", sizes),
                         "pinned": col(flash, "d2h_pinned_gbps", sizes),
                         "pageable malloc": col(flash, "d2h_pageable_gbps", sizes),
                         "pageable shm": col(flash, "d2h_shm_gbps", sizes),
                         "shm + cudaHostRegister": col(flash, "d2h_shm_registered_gbps", sizes)},
             "device to host, GB/s"):
        ax.set_title("snapshot bandwidth: ours against copies into each kind of host memory")
        save(fig, "d2h_bandwidth.png")
    plt.close(fig)

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 4))
    drew = _bars(a1, ["optimizer.step()"], {"AGD": [optim.get("agd_step_ms")],
                                            "AdamW fused": [optim.get("adamw_fused_step_ms")],
                                            "AdamW foreach": [optim.get("adamw_foreach_step_ms")]}, "ms")
    drew |= _bars(a2, ["train step"], {"plain": [fsdp.get("plain_step_ms")], "FSDP2": [fsdp.get("fsdp_step_ms")],
                                       "FSDP2 bf16": [fsdp.get("fsdp_bf16_step_ms")]}, "ms")
    if drew:
        a1.set_title(f"AGD vs AdamW ({(optim.get('params') or 0) / 1e6:.3g}M params)")
        a2.set_title(f"FSDP2 on one device ({(fsdp.get('params') or 0) / 1e6:.3g}M params)")
        save(fig, "optim_fsdp.png")
    plt.close(fig)
    return written


# ----- main ----------------------------------------------------------------------------------


def summarize(outdir: Path, *, mode: str, parts: list[str], message: str, budget_s: float | None,
              total_s: float | None, make_plots: bool = True) -> dict[str, Any]:
    detect = _load(outdir / "detect.json") or {}
    runs = _runs(outdir / ".parts.tsv")
    default_reason = {"no-gpu": "no CUDA GPU on this machine", "gpu-unusable": "torch cannot use the GPU"}.get(
        mode, "not run")
    rows, figures = {}, {}
    for name in parts:
        data = _load(outdir / f"{name}.json") if name in runs else None
        rows[name] = part_status(name, runs.get(name), data, outdir, default_reason)
        if data and data.get("figures"):
            figures[name] = data["figures"]
    counts = {s: sum(1 for r in rows.values() if r["status"] == s) for s in ("ok", "failed", "skipped")}
    summary: dict[str, Any] = {
        "schema": 1, "script": "benchmarks/gpu/run.sh", "mode": mode,
        "measured": mode == "gpu" and counts["ok"] > 0, "message": message,
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "budget_s": budget_s, "total_s": total_s,
        "machine": {k: detect.get(k) for k in ("devices", "device_count", "torch", "torch_cuda", "nvidia_smi_gpus",
                                               "cuda_visible_devices", "python")},
        "parts": rows, "counts": counts, "figures": figures, "comparisons": comparisons(figures),
        "plots": [], "plots_skipped": None,
    }
    if mode == "cpu-tiny":
        summary["note"] = "cpu-tiny: the parts' code ran on the CPU with tiny sizes; the figures mean nothing"
    if not make_plots:
        summary["plots_skipped"] = "--no-plots"
    elif not figures:
        summary["plots_skipped"] = "nothing measured"
    elif importlib.util.find_spec("matplotlib") is None:
        summary["plots_skipped"] = "matplotlib is not installed"
    else:
        try:
            gpu = ", ".join(sorted(set(detect.get("devices") or []))) or mode
            summary["plots"] = plots(outdir, figures, f"dlrover-core benchmarks/gpu — {gpu}")
        except Exception as exc:  # a plot is a nicety: never lose the summary for it
            summary["plots_skipped"] = f"plotting failed: {type(exc).__name__}: {exc}"
    tmp = outdir / ".summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    tmp.replace(outdir / "summary.json")
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("outdir")
    p.add_argument("--mode", required=True, choices=("gpu", "cpu-tiny", "no-gpu", "gpu-unusable"))
    p.add_argument("--parts", required=True, help="the parts' names, comma-separated, in run order")
    p.add_argument("--message", default="")
    p.add_argument("--budget-s", type=float, default=None)
    p.add_argument("--total-s", type=float, default=None)
    p.add_argument("--no-plots", action="store_true")
    a = p.parse_args(argv)
    outdir = Path(a.outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    s = summarize(outdir, mode=a.mode, parts=[x for x in a.parts.split(",") if x], message=a.message,
                  budget_s=a.budget_s, total_s=a.total_s, make_plots=not a.no_plots)
    c = s["counts"]
    if a.mode in ("gpu", "cpu-tiny"):
        print(f"summary: {c['ok']} ok, {c['failed']} failed, {c['skipped']} skipped"
              + (f"; plots: {', '.join(s['plots'])}" if s["plots"] else f"; no plots ({s['plots_skipped']})"))
        for name, row in s["parts"].items():
            if row["status"] != "ok":
                print(f"  {name}: {row['status']}: {row['reason']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
