"""Decoding: logit processing, sampling and lossless speculative verification (DESIGN §5.1)."""
