"""Single-device MoE building blocks: no process groups, no collectives, no lightning."""
