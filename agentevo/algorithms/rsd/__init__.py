"""RSD and the baselines of its table (methods-spec §4-5).

recipe      RSD: rounds of acting, hindsight context, teacher top-k scoring, forward-KL distillation, rule search
config      RSDConfig (`rsd.*`), shared by every recipe here
context     the privileged context: precedents, lessons, reflection, future; context rules
writers     who writes lessons and reflections (a template, or the policy)
baselines   GT-SFT and GT-OPSD (gold trajectories)
bon_sft     BoN + SFT (rejection-sampling self-training)
harness     Harness@Inf (context at inference, no training)
reflexion   Reflexion (verbal retries at inference)
"""
