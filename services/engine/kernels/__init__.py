"""Hand-written kernels, each with the torch path it replaces kept as the fallback and the reference."""
