#!/usr/bin/env bash
# The paper's CIFAR-10 schedule on one GPU: CE and LCCN (library defaults) at asymmetric 0.5
# and symmetric 0.5, PreAct ResNet-32 on all 50,000 training JPEGs (5% held out as the noisy
# validation split), batch 128, SGD lr 0.5 / 0.1 / 0.01 split at 1/3 and 2/3 of the run, the
# first third CE pre-training, wd 5e-4, seed 0, torch.compile(mode="reduce-overhead").
# The four runs share the GPU, one process each; each LCCN run starts from the state its CE
# run writes after the pre-training (--pretrain-out / --pretrain-from), so the pre-training is
# shared as in the CPU benchmark and runs once per setting.
#
#   bash benchmarks/gpu_paper_cifar.sh DATA_DIR OUT_DIR [EPOCHS [bench_cifar.py options...]]
#
# DATA_DIR holds cifar10-jpeg.tar.gz. EPOCHS defaults to the paper's 120; a shorter run scales
# the milestones, the pre-training and the warm-up (20,000 steps at 120 epochs) with it. Any
# further options go to every bench_cifar.py run and override the ones above (e.g.
# --compile off for the eager step, --ramp-epochs 6.5 for the ramp of the 39-epoch runs
# recorded in benchmarks/results/gpu.md; --restart for the paper's code's protocol: LCCN
# starts from CE's final weights and runs all EPOCHS again). When one run fails the others
# are stopped (needs bash 4.3+ for wait -n).
# Per-epoch lines go to OUT_DIR/<setting>-<method>.log, results to OUT_DIR/*.json.
set -euo pipefail
cd "$(dirname "$0")/.."
data=${1:?DATA_DIR}; out=${2:?OUT_DIR}; epochs=${3:-120}
PY=${PYTHON:-python3}
mkdir -p "$out"
p=$((epochs / 3)); m2=$((2 * epochs / 3)); warm=$((20000 * epochs / 120))
echo "paper CIFAR-10 schedule: $epochs epochs ($p CE), milestones $p $m2, warm-up $warm steps"
# the states the CE runs hand to the LCCN runs (STATE_DIR keeps them, e.g. to carry CE's final
# state to a later session with --restart --methods lccn --pretrain-from STATE_DIR/<setting>.pt)
if [ -n "${STATE_DIR:-}" ]; then state=$STATE_DIR; mkdir -p "$state"; else state=$(mktemp -d); fi
pids=()
stop() { [ ${#pids[@]} -eq 0 ] || kill "${pids[@]}" 2>/dev/null || true; }
# background runs ignore Ctrl-C in a script: stop them on any exit; drop a temporary state dir
trap 'stop; [ -n "${STATE_DIR:-}" ] || rm -rf "$state"' EXIT
trap 'exit 130' INT TERM
for s in asym0.5 sym0.5; do
  rm -f "$state/$s.pt" "$state/$s.pt.partial"  # an earlier run's state must not be taken
  for m in ce lccn; do
    if [ "$m" = ce ]; then hand=(--pretrain-out "$state/$s.pt"); else hand=(--pretrain-from "$state/$s.pt"); fi
    PYTHONUNBUFFERED=1 "$PY" benchmarks/bench_cifar.py --device cuda --data "$data" \
      --settings "$s" --seeds 0 --train-size 50000 --model preact_resnet32 --threads 2 \
      --epochs "$epochs" --pretrain-epochs "$p" --milestones "$p" "$m2" \
      --lr 0.5 --lr-values 0.5 0.1 0.01 --warmup-steps "$warm" --methods "$m" \
      --compile reduce-overhead "${hand[@]}" \
      --tag="-gpu-$m" --out "$out" "${@:4}" > "$out/$s-$m.log" 2>&1 &
    pids+=($!)
  done
done
rc=0
for _ in "${pids[@]}"; do
  if ! wait -n; then
    rc=1
    echo "a run failed (see $out/*.log); stopping the others" >&2
    stop
    wait || true
    break
  fi
done
exit $rc
