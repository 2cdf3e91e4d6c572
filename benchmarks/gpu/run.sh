#!/usr/bin/env bash
# benchmarks/gpu/run.sh [--cpu-tiny] OUTDIR — dlrover-core on one NVIDIA GPU, in at most 8 minutes.
#
# Needs: one NVIDIA GPU (an H200-class machine; 16 cores), /dev/shm with room for ~12 GiB
# (two Flash Checkpoint slots of 4 GiB and a 4 GiB floor buffer; DLROVER_SHM_DIR moves it),
# ~15 GiB free in the temporary directory (GPU_BENCH_SCRATCH moves it), and a Python with
#   * torch built with CUDA (NCCL included), and
#   * this repository installed with its plugins: pip install -e . -e plugins/cuda -e plugins/optim_agd
#     (`make setup` does that, with the CPU torch: then install a CUDA torch over it);
#   * matplotlib (optional: PNG plots; skipped without it).
# The Python is $PYTHON if set, else .venv/bin/python if present, else python3.
#
# It runs each part below as its own process under `timeout` (a part that fails or hangs
# does not stop the others; the whole stays within GPU_BENCH_BUDGET_S, default 465 s), and
# writes into OUTDIR:
#   detect.json        is there a usable CUDA GPU (benchmarks/gpu/detect.py)
#   env.json           dlrover doctor --json, the CUDA probe, torch/NCCL versions, nvidia-smi
#   nccl.json          a 1-rank NCCL process group: init, all_reduce, destroy, twice
#   flash.json         Flash Checkpoint of 1 and 4 GiB of GPU tensors: Checkpointer.save stall and
#                      restore vs the pinned / pageable / registered-shm copy ceilings
#   optim.json         AGD vs fused (and foreach) AdamW step time, same ~100M-parameter model
#   fsdp.json          FSDP2 fully_shard on one GPU via train.prepare: step time, peak memory
#   charlm.json        the char LM job on the GPU with its worker SIGKILLed at step 150: JobResult
#   peers.json         torch.save, DCP async_save (default, pinned, async-staged), torch.load(cuda),
#                      our storage path, on the same state (1 GiB; 4 GiB when the time left allows)
#   summary.json       every part's status (ok/failed/skipped), reason, seconds; key figures;
#                      our checkpoint against the peers (ratios); plots written
#   *.png              plots, when matplotlib imports
#   logs/<part>.log    each part's output; charlm-runs/ the job's own logs
# Each Python part documents its JSON keys in its docstring (python benchmarks/gpu/<part>.py --help).
#
# Without a CUDA GPU (CI, a laptop) it measures nothing: it prints one line saying so,
# writes summary.json saying so and exits 0. --cpu-tiny runs every part on the CPU with tiny
# sizes instead (a smoke test of the parts' code; the figures mean nothing; the char LM job
# is only planned). Exit status: 0 every part ok or skipped (or no GPU), 1 a part failed, or
# an NVIDIA GPU is here but this Python cannot use it, 2 usage.
set -u -o pipefail

usage() { sed -n '2,/^set -u/p' "$0" | sed -e 's/^# \{0,1\}//' -e '/^set -u/d'; }

tiny=0
outdir=""
for arg in "$@"; do
  case "$arg" in
    --cpu-tiny) tiny=1 ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "run.sh: unknown option $arg (usage: benchmarks/gpu/run.sh [--cpu-tiny] OUTDIR)" >&2; exit 2 ;;
    *) if [ -n "$outdir" ]; then echo "run.sh: one OUTDIR only" >&2; exit 2; fi; outdir="$arg" ;;
  esac
done
if [ -z "$outdir" ]; then
  echo "usage: benchmarks/gpu/run.sh [--cpu-tiny] OUTDIR" >&2
  exit 2
fi

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
mkdir -p "$outdir" || exit 2
outdir="$(cd "$outdir" && pwd)"
cd "$repo" || exit 2
if [ -n "${PYTHON:-}" ]; then py="$PYTHON"
elif [ -x .venv/bin/python ]; then py="$repo/.venv/bin/python"
else py="python3"
fi
here="benchmarks/gpu"
budget_s="${GPU_BENCH_BUDGET_S:-465}"
reserve_s=15  # for the summary and cleanups

# name script cap_s (the order they run in; peers last: it fits its sizes into what is left)
parts=(
  "env env_info.py 40"
  "nccl nccl_pg.py 45"
  "flash flash_ckpt.py 110"
  "optim optim_step.py 45"
  "fsdp fsdp_step.py 60"
  "charlm charlm_chaos.py 120"
  "peers ckpt_peers.py 150"
)
names="$(for p in "${parts[@]}"; do set -- $p; printf '%s,' "$1"; done)"
names="${names%,}"

# a fresh OUTDIR view: nothing from an earlier run is mistaken for this one's
mkdir -p "$outdir/logs"
rm -f "$outdir/.parts.tsv" "$outdir/summary.json" "$outdir/detect.json" "$outdir"/*.png
for p in "${parts[@]}"; do set -- $p; rm -f "$outdir/$1.json" "$outdir/logs/$1.log"; done

t_start=$(date +%s.%N)
elapsed() { awk -v a="$t_start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }

detect_line="$(timeout -k 5 60 "$py" "$here/detect.py" --out "$outdir/detect.json" 2>"$outdir/logs/detect.log")"
detect_rc=$?
[ -n "$detect_line" ] || detect_line="could not ask $py about the GPU (detect.py exit $detect_rc; see $outdir/logs/detect.log)"

summarize() {  # mode message
  "$py" "$here/summarize.py" "$outdir" --mode "$1" --parts "$names" --message "$2" \
    --budget-s "$budget_s" --total-s "$(elapsed)"
}

if [ "$tiny" = 0 ] && [ "$detect_rc" != 0 ]; then
  if [ "$detect_rc" = 2 ]; then
    msg="$detect_line: nothing was measured; $outdir/summary.json says so"
    summarize no-gpu "$msg" >/dev/null 2>>"$outdir/logs/summarize.log"
    echo "$msg"
    exit 0
  fi
  msg="$detect_line: nothing was measured (needs torch with CUDA: see benchmarks/gpu/run.sh's header)"
  summarize gpu-unusable "$msg" >/dev/null 2>>"$outdir/logs/summarize.log"
  echo "$msg" >&2
  exit 1
fi

if [ "$tiny" = 1 ]; then
  mode="cpu-tiny"; device="cpu"; extra=(--tiny)
  echo "cpu-tiny: every part on the CPU with tiny sizes (a smoke test; figures mean nothing); $detect_line"
else
  mode="gpu"; device="cuda"; extra=()
  echo "$detect_line; budget ${budget_s} s; results in $outdir"
fi

i=0
for p in "${parts[@]}"; do
  set -- $p
  name="$1"; script="$2"; cap="$3"
  i=$((i + 1))
  left=$(awk -v b="$budget_s" -v e="$(elapsed)" -v r="$reserve_s" 'BEGIN { printf "%d", b - e - r }')
  if [ "$left" -lt 20 ]; then
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "" 0 0 "skipped: no time left in the ${budget_s} s budget" >>"$outdir/.parts.tsv"
    echo "[$i/${#parts[@]}] $name: skipped (no time left in the ${budget_s} s budget)"
    continue
  fi
  t=$(( cap < left ? cap : left ))
  args=(--out "$outdir/$name.json" --device "$device" --budget-s $((t - 8)) "${extra[@]}")
  if [ "$name" = charlm ] && [ "$tiny" = 1 ]; then args+=(--dryrun); fi
  echo "[$i/${#parts[@]}] $name (at most $t s)"
  p_start=$(date +%s.%N)
  timeout -k 5 "$t" "$py" "$here/$script" "${args[@]}" >"$outdir/logs/$name.log" 2>&1
  rc=$?
  secs=$(awk -v a="$p_start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.2f", b - a }')
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$secs" "$t" "" >>"$outdir/.parts.tsv"
  tail -n 1 "$outdir/logs/$name.log" | sed 's/^/    /'
done

# belt and braces: a part killed by timeout cannot have cleaned up after itself
rm -f "${DLROVER_SHM_DIR:-/dev/shm}"/dlrover-gpubench-* 2>/dev/null

summarize "$mode" "$mode run: see parts and figures" 2>>"$outdir/logs/summarize.log"
failed=$("$py" -c 'import json, sys; print(json.load(open(sys.argv[1]))["counts"]["failed"])' "$outdir/summary.json" 2>/dev/null || echo 1)
echo "done in $(elapsed) s; $outdir/summary.json"
[ "$failed" = 0 ]
