"""Studies: one folder per study (studies/README.md); each imports moe_rl, nothing imports a study."""
