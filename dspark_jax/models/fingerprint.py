"""A short identifier of a target's *weights* (not only its shapes).

Two targets of one architecture (the bundled one retrained, a fine-tune of a Qwen3) have
the same config, so a drafter or a distillation dataset made for one would load against the
other and silently lose its acceptance. The fingerprint tells them apart: SHA-256 over a
strided sample of the token-embedding rows and the final norm, rounded to bfloat16 first so
that a float32 and a bfloat16 export of the same checkpoint agree. The sample keeps it
cheap for a 151936 x 4096 table (at most 1024 rows are hashed).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import numpy as np

__all__ = ["FINGERPRINT_ROWS", "weights_fingerprint"]

FINGERPRINT_ROWS = 1024  # embedding rows hashed, evenly strided over the vocabulary


def _bf16_bytes(x) -> bytes:
    import ml_dtypes

    a = np.asarray(x)
    if a.dtype != ml_dtypes.bfloat16:
        a = a.astype(np.float32).astype(ml_dtypes.bfloat16)  # round to nearest even
    return np.ascontiguousarray(a).tobytes()


def weights_fingerprint(params: Mapping) -> str:
    """16 hex digits identifying a Qwen3 parameter tree (``embed_tokens`` / ``norm``)."""
    try:
        embedding = params["embed_tokens"]["embedding"]
        norm = params["norm"]["scale"]
    except (KeyError, TypeError) as e:
        raise ValueError(
            "weights_fingerprint needs a Qwen3 parameter tree with embed_tokens/embedding "
            f"and norm/scale; missing {e}"
        ) from None
    stride = max(1, int(np.shape(embedding)[0]) // FINGERPRINT_ROWS)
    h = hashlib.sha256()
    h.update(repr(tuple(np.shape(embedding))).encode())
    h.update(_bf16_bytes(np.asarray(embedding)[::stride]))
    h.update(_bf16_bytes(norm))
    return h.hexdigest()[:16]
