#!/usr/bin/env bash
# Every method on the CPU fidelity protocol (benchmarks/bench_cifar_methods.py), one run per
# setting, seed and method, as parallel one-thread processes on one GPU machine; the slow
# two-network methods start first. Runs still going after LIMIT seconds are stopped (their
# logs say how far they got); the report covers the finished ones.
#
#   [METHODS="lccn lccn_star"] [EXTRA="--outlier-prior 0.5"] \
#       bash benchmarks/gpu_cifar_methods.sh DATA_DIR OUT_DIR [SEEDS] [LIMIT]
set -uo pipefail
cd "$(dirname "$0")/.."
data=${1:?DATA_DIR}; out=${2:?OUT_DIR}; seeds=${3:-0}; limit=${4:-3000}
PY=${PYTHON:-python3}
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 2)" \
  || { echo "gpu_cifar_methods: no CUDA device" >&2; exit 2; }
mkdir -p "$out"
"$PY" -c "from pipeline.data.cifar_memory import load_cifar10 as f; import tempfile, os; f('$data/cifar10-jpeg.tar.gz', cache_dir=os.path.join(tempfile.gettempdir(), 'lccn-cifar10-cache'))" || exit 1
jobs=()
for m in ${METHODS:-divide_lccn dividemix lccn lccn_star lccn_plus ce bootstrap forward sadapt trevision}; do
  for seed in $seeds; do
    for s in asym0.5 sym0.5 idn0.4 open0.3; do jobs+=("$s $seed $m"); done
  done
done
printf '%s\n' "${jobs[@]}" | timeout "$limit" xargs -P "$(nproc)" -L 1 bash -c \
  'OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 '"$PY"' benchmarks/bench_cifar_methods.py --device cuda \
     --data '"$data"' --settings "$0" --seeds "$1" --methods "$2" --threads 1 \
     --train-size 20000 --epochs 24 --pretrain-epochs 8 --milestones 16 21 '"${EXTRA:-}"' \
     --out '"$out"' > '"$out"'/"$0-seed$1-$2.log" 2>&1 || echo "failed: $0 $1 $2"'
echo "xargs rc=$?"
pkill -f bench_cifar_methods.py && echo "stopped the runs still going after ${limit}s"
"$PY" benchmarks/bench_cifar_methods.py --report --out "$out"
