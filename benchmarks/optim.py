"""AGD vs AdamW on two small real tasks: steps to reach AdamW's best validation loss, and time per step.

    python benchmarks/optim.py [--quick] [--json PATH] [--seeds N] [--threads N]

Requirements: the AGD plugin (``pip install -e plugins/optim_agd``) and, for the digits task,
scikit-learn (``pip install scikit-learn``; the data set ships inside it, nothing is
downloaded). Without scikit-learn the digits task is skipped and says so. Single process, CPU.

Tasks (both real data, available offline):

* ``charlm``: the byte-level GPT of ``examples/charlm`` (``model.py``, ``data.py``), small
  (2 layers, width 64, 32-byte context, no dropout), on the Python standard library's source;
  validation loss on fixed held-out batches, in nats per byte.
* ``digits``: an MLP (64-128-10, ReLU) on scikit-learn's handwritten digits (UCI, 1797 8x8
  images), 1397 train / 400 validation; validation cross-entropy in nats.

Protocol, the same for both optimizers (equal tuning budget):

1. Tune: one run per learning rate of a grid on seed 0. AdamW's grid is ``centre * 2**k``;
   AGD's is the same grid divided by 10, as AGD's authors advise ("lr: about 1/10 of AdamW's").
   The rate with the lowest validation loss seen during the run wins (a winner at a grid edge
   is flagged).
2. Evaluate: the winning rate on seeds 1..S (each seed fixes the initial weights and the data
   order, the same for both optimizers: runs are paired).
3. For each seed, the target is AdamW's best validation loss in that run; AdamW's steps are
   the step where it got there, AGD's the first evaluation at or below it; an AGD run that has
   not got there within the step budget goes on, up to twice the budget, only to count its
   steps (beyond that: not reached, inf). "Best validation loss" always means within the budget.
   Reported: the median over seeds of AGD/AdamW (below 1: AGD gets there in fewer steps) with
   a bootstrap 95% interval (10,000 resamples of the seeds), per task and pooled.
4. Time per step: both optimizers on identical models, alternating blocks of steps so that
   machine load hits both alike; median time of a full training step (forward, backward,
   optimizer) and of ``optimizer.step()`` alone.

Both use weight decay 0 (so the update rules alone are compared), betas (0.9, 0.999), a
linear warmup over the first 5% of steps, then a constant rate. AGD's delta is 1e-14 on the
transformer (the authors' advice for transformer-like models) and its default 1e-5 on the MLP.

Each optimizer runs its fastest documented implementation, every option explicit:

* AdamW (``torch.optim.AdamW``, eps 1e-8, amsgrad off): torch's default on CPU is the
  per-tensor loop (it picks ``foreach`` only for CUDA tensors), so both of its documented fast
  paths are tried, ``foreach=True`` and ``fused=True`` (fused kernels exist on CPU since torch
  2.4). Before tuning, per task, both are timed on identical models in alternating blocks
  (median ``optimizer.step()``), and the faster one is used for everything after (tuning,
  evaluation, timing). Both compute the same update; the JSON records the candidates' times
  and the choice (``tasks.<task>.adamw_implementation``).
* AGD (the plugin's ``AGD``): ``foreach=True`` (torch's ``_foreach_*`` kernels for the whole
  group; an op torch has no foreach kernel for falls back to a per-tensor loop, and the JSON
  lists any that did), ``weight_decouple=True``, ``fixed_decay=False``, ``amsgrad=False``,
  ``win=False``, ``clip=None`` (the reference implementation's defaults).

The exact keyword arguments each optimizer was built with are in the JSON
(``config.optimizers`` and ``tasks.<task>.optimizer_kwargs``).

``--quick`` (under 5 minutes on 2 cores): 3 grid points instead of 7 and 400 steps instead of
1500 / 1000; the same seeds. It prints that it is quick. The full protocol needs at least
5 evaluation seeds (``--seeds``). Nothing here is a pass/fail test.
JSON: ``command`` (the command line that produced it), ``ratios``
(``agd_steps_to_target_vs_adamw``, ``agd_step_time_vs_adamw``, ...), ``goals``, the config,
grids, tuning results, every seed's numbers, and per task the median and min-max over seeds
of best validation loss and steps to the target (``summary``) and of step times (``timing``).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples" / "charlm"))

from _results import write_result  # noqa: E402  (benchmarks/ is the script's directory)
from data import WindowSampler, load_corpus, val_batches  # noqa: E402
from model import CharLM, loss_fn  # noqa: E402

import dlrover_plugin_optim_agd  # noqa: E402
from dlrover_plugin_optim_agd import AGD  # noqa: E402

#: ratio key -> goal text
GOALS = {
    "agd_step_time_vs_adamw": "<= 1.15",
    "agd_steps_to_target_vs_adamw": "< 1 means AGD reaches AdamW's best validation loss in fewer steps",
}

#: an AGD evaluation run that has not reached AdamW's best by the step budget goes on up to
#: this multiple of it, only to count its steps to the target (beyond: "not reached", inf)
OVERRUN = 2.0

FULL = {"grid_k": [-3, -2, -1, 0, 1, 2, 3], "steps": {"charlm": 1500, "digits": 1000}}
QUICK = {"grid_k": [-2, 0, 2], "steps": {"charlm": 400, "digits": 400}}

#: Full protocol: at least this many evaluation seeds.
MIN_FULL_SEEDS = 5

#: Options both optimizers share (the update rules alone are compared).
COMMON_OPTIONS: dict[str, Any] = {"betas": (0.9, 0.999), "weight_decay": 0.0}
#: AdamW's documented fast paths (its CPU default is the per-tensor loop); the faster is used.
ADAMW_IMPLEMENTATIONS: dict[str, dict[str, Any]] = {"foreach": {"foreach": True}, "fused": {"fused": True}}
#: AdamW's options besides the implementation (torch's defaults, made explicit).
ADAMW_OPTIONS: dict[str, Any] = {"eps": 1e-8, "amsgrad": False}
#: AGD's options besides ``delta`` (per task): foreach kernels, the reference's defaults.
AGD_OPTIONS: dict[str, Any] = {"weight_decouple": True, "fixed_decay": False, "amsgrad": False, "win": False,
                               "clip": None, "foreach": True}

TASKS: dict[str, dict[str, Any]] = {
    "charlm": {"adamw_centre": 2e-3, "agd_delta": 1e-14, "batch": 16, "eval_every": {"quick": 20, "full": 50}},
    "digits": {"adamw_centre": 1e-2, "agd_delta": 1e-5, "batch": 32, "eval_every": {"quick": 5, "full": 10}},
}


# ----- tasks ---------------------------------------------------------------------------------------


class CharLMTask:
    """The charlm byte model on the stdlib's source. Batches: int64 ``[16, 32]``."""

    name = "charlm"
    block = 32

    def __init__(self) -> None:
        self.train, val = load_corpus(max_bytes=1_000_000)
        self.val = val_batches(val, block_size=self.block, batch_size=32, n_batches=8)

    def model(self, seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return CharLM(block_size=self.block, d_model=64, n_layer=2, n_head=4, dropout=0.0)

    def batches(self, seed: int):
        sampler = WindowSampler(self.train, block_size=self.block, batch_size=TASKS["charlm"]["batch"], rank=0,
                                world_size=1, seed=seed)
        while True:
            yield sampler.next_batch()

    def loss(self, model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return loss_fn(model(batch[0]), batch[1])

    @torch.no_grad()
    def val_loss(self, model: torch.nn.Module) -> float:
        return statistics.fmean(self.loss(model, b).item() for b in self.val)


class DigitsTask:
    """An MLP on scikit-learn's digits. Batches: float32 ``[32, 64]`` pixels / 16 and int64 labels."""

    name = "digits"

    def __init__(self) -> None:
        from sklearn.datasets import load_digits

        d = load_digits()
        x = torch.tensor(d.data, dtype=torch.float32) / 16.0
        y = torch.tensor(d.target, dtype=torch.int64)
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(1234))
        self.x_val, self.y_val = x[order[:400]], y[order[:400]]
        self.x_train, self.y_train = x[order[400:]], y[order[400:]]

    def model(self, seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))

    def batches(self, seed: int):
        gen = torch.Generator().manual_seed(seed)
        n, bs = len(self.y_train), TASKS["digits"]["batch"]
        while True:
            perm = torch.randperm(n, generator=gen)
            for i in range(0, n - bs + 1, bs):
                idx = perm[i : i + bs]
                yield self.x_train[idx], self.y_train[idx]

    def loss(self, model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])

    @torch.no_grad()
    def val_loss(self, model: torch.nn.Module) -> float:
        return self.loss(model, (self.x_val, self.y_val)).item()


# ----- training ------------------------------------------------------------------------------------


def optimizer_kwargs(name: str, task: str, adamw_impl: str) -> dict[str, Any]:
    """The keyword arguments (all but ``lr``) ``name`` is built with on ``task``; for AdamW,
    ``adamw_impl`` is a key of :data:`ADAMW_IMPLEMENTATIONS`."""
    if name == "adamw":
        return {**COMMON_OPTIONS, **ADAMW_OPTIONS, **ADAMW_IMPLEMENTATIONS[adamw_impl]}
    return {**COMMON_OPTIONS, "delta": TASKS[task]["agd_delta"], **AGD_OPTIONS}


def make_optimizer(name: str, params: Any, lr: float, task: str, adamw_impl: str) -> torch.optim.Optimizer:
    kwargs = optimizer_kwargs(name, task, adamw_impl)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, **kwargs)
    return AGD(params, lr=lr, **kwargs)


def adamw_available() -> dict[str, str | None]:
    """Each AdamW implementation -> None if it builds and steps here, else the error."""
    out: dict[str, str | None] = {}
    for impl in ADAMW_IMPLEMENTATIONS:
        try:
            layer = torch.nn.Linear(4, 4)
            opt = make_optimizer("adamw", layer.parameters(), 1e-3, "digits", impl)
            layer(torch.randn(2, 4)).sum().backward()
            opt.step()
            out[impl] = None
        except Exception as exc:  # e.g. fused kernels missing for this device or build
            out[impl] = f"{type(exc).__name__}: {exc}"
    return out


def agd_foreach_fallbacks() -> list[str]:
    """Ops AGD ran per tensor because torch had no foreach kernel for them (logged once each)."""
    ops = getattr(sys.modules.get(AGD.__module__), "_Ops", None)
    return sorted(getattr(ops, "_logged", ()))


def train_run(task: Any, opt_name: str, lr: float, seed: int, steps: int, eval_every: int, *, adamw_impl: str,
              target: float | None = None, overrun: float = 1.0) -> dict[str, Any]:
    """Train ``steps`` steps; validation loss every ``eval_every`` steps (and at ``steps``).

    With ``target``, a run that has not reached it by ``steps`` goes on (same schedule) until
    an evaluation reaches it or ``overrun * steps`` steps have run: this only measures its
    steps to the target; ``best`` and ``best_step`` cover the first ``steps`` steps.

    Returns ``{"evals": [[step, val_loss], ...], "best": float, "best_step": int,
    "diverged": bool, "step_ms": median training-step time in ms}``.
    """
    model = task.model(seed)
    opt = make_optimizer(opt_name, model.parameters(), lr, task.name, adamw_impl)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    batches = task.batches(seed)
    evals: list[list[float]] = []
    times: list[float] = []
    diverged = False
    for step in range(1, int(overrun * steps) + 1):
        if step > steps and (target is None or steps_to(evals, target) < math.inf):
            break
        batch = next(batches)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = task.loss(model, batch)
        loss.backward()
        opt.step()
        sched.step()
        times.append(time.perf_counter() - t0)
        if not math.isfinite(loss.item()):
            diverged = True
            evals.append([step, math.inf])
            break
        if step % eval_every == 0 or step == steps:
            v = task.val_loss(model)
            evals.append([step, v if math.isfinite(v) else math.inf])
    best_step, best = min((e for e in evals if e[0] <= steps), key=lambda e: (e[1], e[0]))
    return {"evals": evals, "best": best, "best_step": int(best_step), "diverged": diverged,
            "step_ms": round(1e3 * statistics.median(times), 3)}


def steps_to(evals: list[list[float]], target: float) -> float:
    """First evaluated step whose validation loss is at or below ``target`` (inf if none)."""
    return next((s for s, v in evals if v <= target), math.inf)


def time_steps(task: Any, configs: dict[str, tuple[str, float, str]], rounds: int,
               block: int) -> dict[str, dict[str, Any]]:
    """Median (and min-max) full-step and optimizer-step times (ms) of each of ``configs``
    (label -> ``(optimizer, lr, adamw_impl)``) on identical models, alternating blocks of
    ``block`` steps for ``rounds`` rounds (the order reversed every other round)."""
    setups = {}
    for label, (name, lr, impl) in configs.items():
        model = task.model(0)
        setups[label] = (model, make_optimizer(name, model.parameters(), lr, task.name, impl), task.batches(0))
    full: dict[str, list[float]] = {label: [] for label in configs}
    opt_only: dict[str, list[float]] = {label: [] for label in configs}
    order = list(configs)
    for r in range(rounds + 1):
        for name in order if r % 2 == 0 else order[::-1]:
            model, opt, batches = setups[name]
            for _ in range(block):
                batch = next(batches)
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                task.loss(model, batch).backward()
                t1 = time.perf_counter()
                opt.step()
                t2 = time.perf_counter()
                if r > 0:  # round 0 warms up (lazy state, allocator)
                    full[name].append(t2 - t0)
                    opt_only[name].append(t2 - t1)
    def ms(x: float) -> float:
        return round(1e3 * x, 4)

    return {name: {"step_ms": ms(statistics.median(full[name])),
                   "step_ms_min_max": [ms(min(full[name])), ms(max(full[name]))],
                   "optimizer_step_ms": ms(statistics.median(opt_only[name])),
                   "optimizer_step_ms_min_max": [ms(min(opt_only[name])), ms(max(opt_only[name]))],
                   "samples": len(full[name])} for name in full}


def choose_adamw(task: Any, available: dict[str, str | None], block: int) -> dict[str, Any]:
    """Time the AdamW implementations that work here on ``task`` (median ``optimizer.step()``,
    alternating blocks) and pick the faster; ties go to ``foreach``."""
    usable = [impl for impl, err in available.items() if err is None]
    lr = TASKS[task.name]["adamw_centre"]
    timing = (time_steps(task, {impl: ("adamw", lr, impl) for impl in usable}, rounds=4, block=block)
              if len(usable) > 1 else {})
    chosen = min(usable, key=lambda impl: (timing[impl]["optimizer_step_ms"] if timing else 0.0, impl != "foreach"))
    return {"chosen": chosen, "kwargs": ADAMW_IMPLEMENTATIONS[chosen], "candidates": timing,
            "unavailable": {impl: err for impl, err in available.items() if err is not None},
            "criterion": "median optimizer.step() time, alternating blocks on identical models (4 rounds)"}


def _spread(values: list[float]) -> dict[str, float | None]:
    """Median and min-max of ``values`` (inf: not reached; shown as None)."""
    return {"median": _r(_median(values)), "min": _r(min(values)), "max": _r(max(values))}


_BIG = 1e12  # stands for inf (a target never reached) inside quantiles, which interpolate


def _median(values: Any) -> float:
    m = float(np.median(np.minimum(np.asarray(values, dtype=float), _BIG)))
    return math.inf if m >= _BIG / 4 else m  # a midpoint with inf is inf


def bootstrap_median(values: list[float], n: int = 10_000, seed: int = 0) -> tuple[float, float, float]:
    """``(median, low, high)``: the median and its bootstrap 95% interval (2.5th and 97.5th
    percentiles of the medians of ``n`` resamples with replacement). inf stays inf."""
    a = np.minimum(np.asarray(values, dtype=float), _BIG)
    rng = np.random.default_rng(seed)
    meds = np.median(a[rng.integers(0, len(a), size=(n, len(a)))], axis=1)
    lo, hi = (float(x) for x in np.percentile(meds, [2.5, 97.5]))
    return _median(a), (math.inf if lo >= _BIG / 4 else lo), (math.inf if hi >= _BIG / 4 else hi)


def _r(x: float, nd: int = 4) -> float | None:
    return round(x, nd) if math.isfinite(x) else None


def run_task(task: Any, mode: dict[str, Any], seeds: list[int], console: Console,
             available: dict[str, str | None]) -> dict[str, Any]:
    cfg = TASKS[task.name]
    steps, eval_every = mode["steps"][task.name], cfg["eval_every"][mode["name"]]
    block = 20 if task.name == "charlm" else 100
    adamw_choice = choose_adamw(task, available, block)
    impl = adamw_choice["chosen"]
    console.log(f"{task.name}: AdamW {impl} (" + ", ".join(
        f"{k} {v['optimizer_step_ms']:.3f} ms" for k, v in adamw_choice["candidates"].items()) + " per optimizer step)")
    centre = cfg["adamw_centre"]
    grids = {"adamw": [centre * 2.0**k for k in mode["grid_k"]], "agd": [centre / 10 * 2.0**k for k in mode["grid_k"]]}
    tuning: dict[str, list[dict[str, Any]]] = {}
    chosen: dict[str, float] = {}
    edge: dict[str, bool] = {}
    for name, grid in grids.items():
        tuning[name] = []
        for lr in grid:
            res = train_run(task, name, lr, 0, steps, eval_every, adamw_impl=impl)
            tuning[name].append({"lr": lr, "best_val": _r(res["best"]), "best_step": res["best_step"],
                                 "diverged": res["diverged"]})
            console.log(f"{task.name} tune {name} lr={lr:.3g}: best val {res['best']:.4f} at step {res['best_step']}")
        i = min(range(len(grid)), key=lambda j: tuning[name][j]["best_val"] if tuning[name][j]["best_val"] is not None else math.inf)
        chosen[name], edge[name] = grid[i], i in (0, len(grid) - 1)
    per_seed = []
    for seed in seeds:
        runs = {"adamw": train_run(task, "adamw", chosen["adamw"], seed, steps, eval_every, adamw_impl=impl)}
        target = runs["adamw"]["best"]
        runs["agd"] = train_run(task, "agd", chosen["agd"], seed, steps, eval_every, adamw_impl=impl, target=target,
                                overrun=OVERRUN)
        adamw_steps, agd_steps = runs["adamw"]["best_step"], steps_to(runs["agd"]["evals"], target)
        per_seed.append({
            "seed": seed, "target_val": _r(target), "adamw_steps": adamw_steps,
            "agd_steps": agd_steps if math.isfinite(agd_steps) else None,
            "ratio": _r(agd_steps / adamw_steps),
            "adamw_best_val": _r(runs["adamw"]["best"]), "agd_best_val": _r(runs["agd"]["best"]),
            "adamw_step_ms": runs["adamw"]["step_ms"], "agd_step_ms": runs["agd"]["step_ms"],
            "evals": {name: [[st, _r(v)] for st, v in runs[name]["evals"]] for name in runs},
        })
        console.log(f"{task.name} seed {seed}: AdamW best {target:.4f} at step {adamw_steps}; AGD reached it at "
                    f"{agd_steps if math.isfinite(agd_steps) else 'never'} (best {runs['agd']['best']:.4f})")
    ratios = [s["ratio"] if s["ratio"] is not None else math.inf for s in per_seed]
    med, lo, hi = bootstrap_median(ratios)
    timing = time_steps(task, {name: (name, chosen[name], impl) for name in ("adamw", "agd")}, rounds=6, block=block)
    summary = {name: {"best_val": _spread([s[f"{name}_best_val"] if s[f"{name}_best_val"] is not None else math.inf
                                           for s in per_seed]),
                      "steps_to_target": _spread([s[f"{name}_steps"] if s[f"{name}_steps"] is not None else math.inf
                                                  for s in per_seed])}
               for name in ("adamw", "agd")}
    summary["agd_vs_adamw_steps_ratio"] = _spread(ratios)
    return {
        "steps": steps, "eval_every": eval_every, "agd_delta": cfg["agd_delta"], "batch": cfg["batch"],
        "adamw_implementation": adamw_choice,
        "optimizer_kwargs": {name: _jsonable(optimizer_kwargs(name, task.name, impl)) for name in ("adamw", "agd")},
        "agd_foreach_fallback_ops": agd_foreach_fallbacks(),
        "grids": grids, "tuning": tuning, "chosen_lr": chosen, "chosen_at_grid_edge": edge, "per_seed": per_seed,
        "summary": summary,
        "steps_ratio": {"median": _r(med), "ci95": [_r(lo), _r(hi)],
                        "not_reached": sum(1 for s in per_seed if s["agd_steps"] is None),
                        "reached_after_budget": sum(1 for s in per_seed if (s["agd_steps"] or 0) > steps)},
        "timing": timing,
        "step_time_ratio": _r(timing["agd"]["step_ms"] / timing["adamw"]["step_ms"]),
        "optimizer_step_time_ratio": _r(timing["agd"]["optimizer_step_ms"] / timing["adamw"]["optimizer_step_ms"]),
        "_ratios_raw": ratios,
    }


def _jsonable(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in kwargs.items()}


# ----- report ---------------------------------------------------------------------------------------


def _fmt_ratio(r: dict[str, Any]) -> str:
    def f(x: float | None) -> str:
        return "inf" if x is None else f"{x:.2f}"

    return f"{f(r['median'])} [{f(r['ci95'][0])}, {f(r['ci95'][1])}]"


def print_table(doc: dict[str, Any], console: Console) -> None:
    table = Table(title=f"AGD vs AdamW ({doc['mode']} mode; {len(doc['config']['seeds'])} seeds, "
                        f"{len(doc['config']['grid_k'])}-point lr grids)")
    for col in ("task", "optimizer", "lr grid", "chosen lr", "best val (median)", "steps to target (median)",
                "AGD/AdamW steps [95% CI]", "ms/step", "AGD/AdamW time (opt.step only)"):
        table.add_column(col, justify="left" if col in ("task", "optimizer") else "right", overflow="fold")
    for name, t in doc["tasks"].items():
        if "skipped" in t:
            table.add_row(name, "-", "-", "-", "-", "-", f"skipped: {t['skipped']}", "-", "-")
            continue
        for opt in ("adamw", "agd"):
            grid = t["grids"][opt]
            best_vals = [s[f"{opt}_best_val"] for s in t["per_seed"]]
            steps = [s["adamw_steps"] if opt == "adamw" else s["agd_steps"] for s in t["per_seed"]]
            steps_f = [x if x is not None else math.inf for x in steps]
            med_steps = _median(steps_f)
            table.add_row(
                name, f"AdamW ({t['adamw_implementation']['chosen']})" if opt == "adamw" else "AGD (foreach)",
                f"{grid[0]:.2g}..{grid[-1]:.2g}", f"{t['chosen_lr'][opt]:.3g}" + (" (edge)" if t["chosen_at_grid_edge"][opt] else ""),
                f"{statistics.median(v for v in best_vals if v is not None):.4f}",
                "never" if math.isinf(med_steps) else f"{med_steps:.0f}",
                _fmt_ratio(t["steps_ratio"]) if opt == "agd" else "",
                f"{t['timing'][opt]['step_ms']:.2f}",
                f"{t['step_time_ratio']:.2f} ({t['optimizer_step_time_ratio']:.2f})" if opt == "agd" else "",
            )
    console.print(table)
    r = doc["ratios"]
    console.print(f"agd_steps_to_target_vs_adamw = {r['agd_steps_to_target_vs_adamw']} "
                  f"(95% CI {r['agd_steps_to_target_vs_adamw_ci95']}; winner: {r['steps_winner']}); "
                  f"agd_step_time_vs_adamw = {r['agd_step_time_vs_adamw']} (goal {GOALS['agd_step_time_vs_adamw']})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="3-point grids and 400 steps (under 5 minutes on 2 cores)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--seeds", type=int, default=5, help="evaluation seeds (1..N; seed 0 tunes); default 5")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--tasks", default="charlm,digits", help="comma-separated subset of: charlm, digits")
    a = p.parse_args(argv)
    if not a.quick and a.seeds < MIN_FULL_SEEDS:
        p.error(f"the full protocol needs --seeds >= {MIN_FULL_SEEDS} (got {a.seeds}); use --quick for fewer")
    argv_used = list(argv if argv is not None else sys.argv[1:])
    console = Console(width=max(150, Console().width))
    torch.set_num_threads(a.threads)
    mode = {"name": "quick" if a.quick else "full", **(QUICK if a.quick else FULL)}
    seeds = list(range(1, a.seeds + 1))
    if a.quick:
        steps = ", ".join(f"{k} {v}" for k, v in mode["steps"].items())
        full_steps = ", ".join(f"{k} {v}" for k, v in FULL["steps"].items())
        console.print(f"[bold]QUICK mode[/bold]: {len(mode['grid_k'])}-point lr grids (full: {len(FULL['grid_k'])}), "
                      f"steps {steps} (full: {full_steps}), {len(seeds)} seeds: indicative numbers only.")
    t_start = time.perf_counter()
    load_before = os.getloadavg()
    available = adamw_available()
    if all(err is not None for err in available.values()):
        console.print(f"[red]no AdamW implementation works here[/red]: {available}")
        return 1
    tasks: dict[str, Any] = {}
    raw: list[float] = []
    for name in a.tasks.split(","):
        if name == "digits":
            try:
                task: Any = DigitsTask()
            except ImportError:
                tasks[name] = {"skipped": "scikit-learn is not installed (pip install scikit-learn)"}
                console.print(f"[yellow]digits skipped[/yellow]: {tasks[name]['skipped']}")
                continue
        elif name == "charlm":
            task = CharLMTask()
        else:
            p.error(f"unknown task {name!r}")
        tasks[name] = run_task(task, mode, seeds, console, available)
        raw += tasks[name].pop("_ratios_raw")
    med, lo, hi = bootstrap_median(raw) if raw else (math.nan, math.nan, math.nan)
    done = [t for t in tasks.values() if "skipped" not in t]
    step_time = statistics.median(t["step_time_ratio"] for t in done) if done else math.nan
    ratios = {
        "agd_steps_to_target_vs_adamw": _r(med),
        "agd_steps_to_target_vs_adamw_ci95": [_r(lo), _r(hi)],
        "steps_winner": "AGD" if med < 1 else ("AdamW" if med > 1 else "tie"),
        "agd_step_time_vs_adamw": _r(step_time),
        "agd_optimizer_step_time_vs_adamw": _r(statistics.median(t["optimizer_step_time_ratio"] for t in done)) if done else None,
    }
    for name, t in tasks.items():
        if "skipped" not in t:
            ratios[f"{name}_agd_steps_to_target_vs_adamw"] = t["steps_ratio"]["median"]
            ratios[f"{name}_agd_step_time_vs_adamw"] = t["step_time_ratio"]
    doc = {
        "command": shlex.join(["python", "benchmarks/optim.py", *argv_used]),
        "python_executable": sys.executable,
        "mode": mode["name"],
        "config": {"grid_k": mode["grid_k"], "grid": "AdamW: centre * 2**k; AGD: centre / 10 * 2**k",
                   "steps": mode["steps"], "tuning_seed": 0, "seeds": seeds, "threads": a.threads,
                   "betas": [0.9, 0.999], "weight_decay": 0.0, "warmup": "linear over the first 5% of steps",
                   "tasks": {k: {"adamw_centre": v["adamw_centre"], "agd_delta": v["agd_delta"], "batch": v["batch"]}
                             for k, v in TASKS.items()},
                   "optimizers": {
                       "adamw": {"class": "torch.optim.AdamW", "options": _jsonable({**COMMON_OPTIONS, **ADAMW_OPTIONS}),
                                 "implementations_tried": ADAMW_IMPLEMENTATIONS, "implementations_unavailable":
                                 {k: v for k, v in available.items() if v is not None},
                                 "implementation": {k: t["adamw_implementation"]["chosen"] for k, t in tasks.items()
                                                    if "skipped" not in t},
                                 "chosen_by": "per task, the faster median optimizer.step() before tuning"},
                       "agd": {"class": "dlrover_plugin_optim_agd.AGD", "version": dlrover_plugin_optim_agd.__version__,
                               "options": _jsonable({**COMMON_OPTIONS, **AGD_OPTIONS}),
                               "delta": {k: v["agd_delta"] for k, v in TASKS.items()}},
                   },
                   "target": "per seed: AdamW's best validation loss in that run",
                   "bootstrap": "10000 resamples of the per-seed ratios; median; 2.5/97.5 percentiles"},
        "machine": {"cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__, "load_average_before": [round(x, 2) for x in load_before],
                    "load_average_after": [round(x, 2) for x in os.getloadavg()]},
        "wall_s": round(time.perf_counter() - t_start, 1),
        "ratios": ratios,
        "goals": GOALS,
        "tasks": tasks,
    }
    print_table(doc, console)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        write_result(a.json, doc)
    console.print(f"done in {doc['wall_s']} s" + (f"; JSON in {a.json}" if a.json else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
