"""Self-Guide (methods-spec §3): `recipe` (guided rollouts, internal rewards, staged trust on GRPO's update, `run`)
and `config` (SelfGuideConfig, `selfguide.*`; the GRPO settings are `grpo.*`)."""
