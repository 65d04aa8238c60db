"""Models: the Qwen3 target and the drafters."""
