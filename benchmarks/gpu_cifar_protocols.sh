#!/usr/bin/env bash
# Sizing the CPU fidelity benchmark (benchmarks/results/cifar.md) on one GPU machine: the
# CPU protocol's model (cnn_wide) and schedule shapes, CE vs LCCN (library defaults, and
# --ramp-epochs 0), all three noise settings, run as parallel processes (one CPU thread
# each). The arithmetic is the CPU benchmark's; only the device differs, so a protocol
# chosen here is then run on the CPU for the record.
#
#   bash benchmarks/gpu_cifar_protocols.sh DATA_DIR OUT_DIR
#
# Protocols (all: SGD lr 0.1, x0.1 at each milestone, batch 128, 5% noisy validation):
#   a   20,000 images, 24 epochs, 8 CE, milestones 16 21   (the current CPU protocol)
#   b   10,000 images, 48 epochs, 16 CE, milestones 32 42  (same images x epochs as a)
#   c   10,000 images, 48 epochs, 8 CE, milestones 32 42
set -euo pipefail
cd "$(dirname "$0")/.."
data=${1:?DATA_DIR}; out=${2:?OUT_DIR}
PY=${PYTHON:-python3}
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 2)" \
  || { echo "gpu_cifar_protocols: no CUDA device" >&2; exit 2; }
mkdir -p "$out" /tmp/lccn-cifar10-cache
"$PY" -c "from pipeline.data.cifar_memory import load_cifar10 as f; f('$data/cifar10-jpeg.tar.gz', cache_dir='/tmp/lccn-cifar10-cache')"
declare -A proto=(
  [a]="--train-size 20000 --epochs 24 --pretrain-epochs 8 --milestones 16 21"
  [b]="--train-size 10000 --epochs 48 --pretrain-epochs 16 --milestones 32 42"
  [c]="--train-size 10000 --epochs 48 --pretrain-epochs 8 --milestones 32 42"
)
run() {  # protocol seed extra-tag extra-args...
  local p=$1 seed=$2 tag=$3; shift 3
  for s in asym0.5 sym0.5 idn0.4; do
    OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 "$PY" benchmarks/bench_cifar.py --device cuda \
      --data "$data" --settings "$s" --seeds "$seed" --threads 1 ${proto[$p]} \
      --tag="-$p$tag" --out "$out" "$@" > "$out/$s-$p$tag-seed$seed.log" 2>&1 &
  done
}
run a 0 ""
run b 0 ""
run b 1 ""
run b 0 "-ramp0" --ramp-epochs 0
run c 0 ""
wait
for p in a b c; do "$PY" benchmarks/bench_cifar.py --report --out "$out" --tag="-$p" || true; done
"$PY" benchmarks/bench_cifar.py --report --out "$out" --tag="-b-ramp0" || true
