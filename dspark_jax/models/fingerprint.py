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

from dspark_jax.distributed import to_host

__all__ = [
    "FINGERPRINT_ROWS",
    "checkpoint_files_fingerprint",
    "fingerprint_from_sample",
    "sample_stride",
    "weights_fingerprint",
]

FINGERPRINT_ROWS = 1024  # embedding rows hashed, evenly strided over the vocabulary


def _bf16_bytes(x) -> bytes:
    import ml_dtypes

    a = np.asarray(x)
    if a.dtype != ml_dtypes.bfloat16:
        a = a.astype(np.float32).astype(ml_dtypes.bfloat16)  # round to nearest even
    return np.ascontiguousarray(a).tobytes()


def sample_stride(vocab_size: int) -> int:
    """The stride of the embedding rows the fingerprint hashes."""
    return max(1, int(vocab_size) // FINGERPRINT_ROWS)


def fingerprint_from_sample(embedding_shape, sampled_rows, norm) -> str:
    """The fingerprint from its inputs alone: the embedding table's shape, its rows
    ``[::sample_stride(vocab)]`` and the final norm (so a reader of the checkpoint files
    can compute it without the whole table, ``convert.hf_mesh.hf_dir_fingerprint``)."""
    h = hashlib.sha256()
    h.update(repr(tuple(int(n) for n in embedding_shape)).encode())
    h.update(_bf16_bytes(sampled_rows))
    h.update(_bf16_bytes(norm))
    return h.hexdigest()[:16]


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
    shape = np.shape(embedding)
    # A jax.Array is sliced on its devices; on a mesh over several processes, where each
    # process holds only some rows, the sample is gathered (dspark_jax.distributed).
    rows = to_host(embedding, slice(None, None, sample_stride(shape[0])))
    return fingerprint_from_sample(shape, rows, to_host(norm))


WEIGHT_FILE_SUFFIXES = (".safetensors", ".bin", ".msgpack", ".npz", ".json")
FILE_SAMPLES, SAMPLE_BYTES = 16, 1 << 16  # per file: 16 windows of 64 KiB, both ends included


def checkpoint_files_fingerprint(path) -> str:
    """16 hex digits identifying the checkpoint *files* in directory ``path`` as this
    host sees them: their names, sizes and SHA-256 over 16 evenly spaced 64 KiB windows
    of each (the first and last included). Every process of a multi-host server reads its
    own copy of the weights, and each holds only its devices' share once loaded, so a host
    with another checkpoint can only be caught from its files: the processes compare this
    at start (``serve.py``). A few MiB are read whatever the checkpoint's size."""
    import os

    h = hashlib.sha256()
    names = sorted(
        name
        for name in os.listdir(path)
        if name.endswith(WEIGHT_FILE_SUFFIXES) and os.path.isfile(os.path.join(path, name))
    )
    for name in names:
        file = os.path.join(path, name)
        size = os.path.getsize(file)
        h.update(f"{name}\0{size}\0".encode())
        last = max(0, size - SAMPLE_BYTES)
        starts = sorted({last * i // (FILE_SAMPLES - 1) for i in range(FILE_SAMPLES)})
        with open(file, "rb") as f:
            for start in starts:
                f.seek(start)
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()[:16]
