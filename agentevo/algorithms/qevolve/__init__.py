"""Q-Evolve (methods-spec §2): `recipe` (the numbered steps, `run`) and `config` (QEvolveConfig, `qevolve.*`)."""
