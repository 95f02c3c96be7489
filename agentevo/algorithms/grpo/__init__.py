"""GRPO / DAPO (methods-spec §3.2, §5): `recipe` (groups, outcome advantages, the clipped update, `run`; Self-Guide
trains with its PolicyTrainer) and `config` (GRPOConfig, `grpo.*`)."""
