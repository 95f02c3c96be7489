#!/usr/bin/env bash
# The powered Q-Evolve study's missing arms (issue 19) in one device call on a lent GPU: per seed 0-2 a BC start
# (the demo's config), Q-Evolve one round, its five one-round ablations on the same round-1 data, ETO and QLASS
# from the same start, all evaluated greedily on the study's 200 held-out games; then `agentevo compare` against
# each run's own BC (--baseline-point bc) and the ablations against the full method (paired by seed and task).
# Runs go in parallel (PAR at a time, default 6: the machines have 16 cores; each run starts up to 32 JVMs) under one
# wall-clock budget (BUDGET seconds, default 540, inside the 600 s a device call may run); a run that does not finish
# in time is listed as such and left out of the tables, never half-read. Not yet run on a GPU.
#
#   bash bench/device_check.sh prepare                                   # here: the wheels the GPU image lacks
#   device run: bash docs/studies/qevolve_cookingworld_powered/scripts/device_study.sh   carry [".whl"], timeout_s 600
#   bash docs/studies/qevolve_cookingworld_powered/scripts/device_study.sh --dry   # here: CPU, smoke size, 1 seed
#
# Results under $OUT (default /tmp/device-out): compare/ (tables + plot), runs/NAME/{report.md,metrics.jsonl,
# config.yaml,state.json} per finished run, logs/NAME.log and status.tsv (name, exit status, seconds).
set -uo pipefail
cd "$(dirname "$0")/../../../.."
DRY=0; [ "${1:-}" = --dry ] && DRY=1
OUT=${OUT:-/tmp/device-out}; mkdir -p "$OUT/logs" "$OUT/runs"
. bench/device_env.sh
R=${RUNS:-/tmp/qe-study-runs}; mkdir -p "$R"
BUDGET=${BUDGET:-540}; PAR=${PAR:-6}; START=$(date +%s)
SEEDS=(0 1 2)
QE=(--config configs/study/qevolve_cookingworld.yaml --set qevolve.n_iters=1)
ETO=(--config configs/study/eto_cookingworld.yaml)
QLASS=(--config configs/study/qlass_cookingworld.yaml)
BC=(--config configs/demo_twx_bc.yaml)
COMMON=(--output-dir "$R" --quiet)
if [ $DRY = 1 ]; then  # smoke size: a few tasks, one seed, one thread; checks the script, not the study
  SEEDS=(0); PAR=2
  SMALL=(--set env.n_train=6 --set env.n_dev=2 --set env.n_test=4 --set model.torch_threads=1)
  BC+=("${SMALL[@]}" --set optim.epochs=1)
  QE+=("${SMALL[@]}" --set qevolve.n_self_per_task=1 --set qevolve.critic_steps=2 --set qevolve.policy_epochs=1.0)
  ETO+=("${SMALL[@]}" --set env.n_train=4 --set eto.n_iters=1 --set eto.epochs=1)
  QLASS+=("${SMALL[@]}" --set env.n_train=4 --set qlass.n_tree_tasks=2 --set qlass.epochs=1)
fi
ABLATIONS=("wo-rr qevolve.rr=false" "wo-wiql qevolve.wiql=false" "wo-gae qevolve.pr=q_minus_v"
           "wo-pi qevolve.pi=none" "wo-pi-awr qevolve.pi=awr")
echo "== $(date +%T) device_study: seeds ${SEEDS[*]}, budget ${BUDGET}s, $PAR at a time"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
$PY -c "import torch; print('torch', torch.__version__, '| cuda', torch.cuda.is_available())"

AE=("$PY" -c "from agentevo.cli import entry; entry()")  # the agentevo CLI (no console script there)
left() { echo $((BUDGET - ($(date +%s) - START))); }
job() {  # NAME ARGS...: one agentevo train, bounded by what is left of the budget; status.tsv gets its exit status
  local name=$1 t0; shift; t0=$(date +%s)
  local budget; budget=$(left)
  if [ "$budget" -le 10 ]; then printf '%s\tskipped\t0\n' "$name" >> "$OUT/status.tsv"; return; fi
  OMP_NUM_THREADS=1 timeout "$budget" "${AE[@]}" train "$@" "${COMMON[@]}" \
    --name "$name" > "$OUT/logs/$name.log" 2>&1
  local rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" >> "$OUT/status.tsv"
  if [ $rc = 0 ]; then
    mkdir -p "$OUT/runs/$name"; cp "$R/$name"/{report.md,metrics.jsonl,config.yaml,state.json} "$OUT/runs/$name/" 2>/dev/null
  fi
}
stage() {  # run the queued jobs PAR at a time; "NAME|ARG ARG ..." per line on stdin (no spaces inside an ARG)
  local line
  while IFS= read -r line; do
    while [ "$(jobs -rp | wc -l)" -ge "$PAR" ]; do wait -n; done
    # shellcheck disable=SC2086
    job ${line%%|*} ${line#*|} &
  done
  wait
}
ok() { grep -q "^$1"$'\t'"0"$'\t' "$OUT/status.tsv" 2>/dev/null; }

echo "== $(date +%T) BC starts"
for s in "${SEEDS[@]}"; do echo "bc-s$s|${BC[*]} --set seed=$s"; done | stage
echo "== $(date +%T) Q-Evolve, ETO, QLASS (left: $(left)s)"
for s in "${SEEDS[@]}"; do
  ok "bc-s$s" || continue
  W="--set seed=$s --set bc.warm_start_from=$R/bc-s$s"
  echo "qe-s$s|${QE[*]} $W"; echo "eto-s$s|${ETO[*]} $W"; echo "qlass-s$s|${QLASS[*]} $W"
done | stage
echo "== $(date +%T) ablations on each seed's round-1 data (left: $(left)s)"
for s in "${SEEDS[@]}"; do
  ok "qe-s$s" || continue
  for a in "${ABLATIONS[@]}"; do
    set -- $a
    # ablations after the critic (pr, pi) reuse Q-Evolve's fitted round-1 critic; w/o RR and w/o W-IQL fit their own
    reuse=""; case $2 in qevolve.pr=*|qevolve.pi=*) reuse="--set qevolve.round1_critic_from=$R/qe-s$s";; esac
    echo "qe-$1-s$s|${QE[*]} --set seed=$s --set bc.warm_start_from=$R/bc-s$s --set $2 --set qevolve.round1_data_from=$R/qe-s$s $reuse"
  done
done | stage

echo "== $(date +%T) compare (left: $(left)s)"
cat "$OUT/status.tsv"
finished() { for n in "$@"; do ok "$n" && echo "$R/$n"; done; }
arms=(qe eto qlass qe-wo-rr qe-wo-wiql qe-wo-gae qe-wo-pi qe-wo-pi-awr)
mapfile -t all < <(for a in "${arms[@]}"; do finished $(for s in "${SEEDS[@]}"; do echo "$a-s$s"; done); done)
if [ ${#all[@]} -gt 0 ]; then
  "${AE[@]}" compare "${all[@]}" --baseline-point bc --split test \
    --out "$OUT/compare/vs-bc" 2>&1 | tail -30
  mapfile -t qe < <(for a in qe qe-wo-rr qe-wo-wiql qe-wo-gae qe-wo-pi qe-wo-pi-awr; do
    finished $(for s in "${SEEDS[@]}"; do echo "$a-s$s"; done); done)
  [ ${#qe[@]} -gt 1 ] && "${AE[@]}" compare "${qe[@]}" --baseline qe --split test \
    --out "$OUT/compare/ablations-vs-qe" 2>&1 | tail -30
fi
echo "== $(date +%T) done ($(( $(date +%s) - START ))s)"
