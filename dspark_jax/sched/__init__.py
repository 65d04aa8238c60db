"""Hardware-aware verification scheduling (DESIGN §5.3): SPS profiling, Algorithm 1 (exact
prefix scheduler), dynamic top-K, and the baseline policies."""
