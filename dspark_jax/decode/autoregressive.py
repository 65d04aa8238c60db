"""Plain autoregressive generation with the target's KV cache.

This is the no-speculation baseline and the reference that greedy speculative decoding
must match token for token. It is also the batched sampler used to regenerate drafter
training data (self-distillation). Everything runs in one jitted function with fixed
shapes: prompts are right-padded to a length bucket, prefilled into cache slots, then
``lax.scan`` decodes one token per slot per step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.models.qwen3 import Qwen3, init_cache
from dspark_jax.ops.paged_attention import RaggedLayout, pages_per_sequence, resolve_backend
from dspark_jax.ops.sampling import process_logits, sample

PAGE_SIZE = 16  # positions per KV page (every prompt gets its own pages up to max_len)

FINISH_EOS = "eos"
FINISH_LENGTH = "length"  # hit max_new_tokens or the end of the cache


@dataclasses.dataclass
class GenerationOutput:
    tokens: list[list[int]]  # generated ids per prompt (EOS included when produced)
    finish_reasons: list[str]


def length_bucket(n: int, minimum: int = 16) -> int:
    """Smallest power of two >= n (and >= minimum): prompt lengths compile per bucket."""
    b = minimum
    while b < n:
        b *= 2
    return b


@partial(jax.jit, static_argnames=("model", "max_new_tokens", "max_len"))
def _generate(
    model: Qwen3,
    params,
    prompts,
    prompt_lens,
    rng,
    temperature,
    top_k,
    top_p,
    eos_id,
    *,
    max_new_tokens: int,
    max_len: int,
):
    num = prompts.shape[0]
    pages = pages_per_sequence(max_len, PAGE_SIZE)
    cache = init_cache(model.config, num * pages + 1, PAGE_SIZE)  # + the null page 0
    table = 1 + jnp.arange(num * pages, dtype=jnp.int32).reshape(num, pages)
    slots = jnp.arange(num, dtype=jnp.int32)
    logits, cache, _ = model.apply(
        {"params": params}, prompts, prompt_lens, table, cache, method=Qwen3.prefill
    )
    last = jnp.take_along_axis(logits, (prompt_lens - 1)[:, None, None], axis=1)[:, 0]

    def pick(key, lg):
        return sample(key, process_logits(lg, temperature, top_k, top_p))

    rng, key = jax.random.split(rng)
    first = pick(key, last)
    done = (first == eos_id) | (prompt_lens + 1 >= max_len)

    def step(carry, _):
        cache, token, pos, done, rng = carry
        # One row per prompt; finished rows still attend (clamped), but write nothing.
        layout = RaggedLayout(
            jnp.arange(num + 1, dtype=jnp.int32), jnp.minimum(pos + 1, max_len), table
        )
        lg, cache, _ = model.apply(
            {"params": params},
            token[:, None],
            jnp.minimum(pos, max_len - 1)[:, None],
            slots,
            cache,
            layout,
            (~done)[:, None],
            attention=resolve_backend(head_dim=model.config.head_dim),
            method=Qwen3.decode,
        )
        rng, key = jax.random.split(rng)
        nxt = pick(key, lg[:, 0])
        emitted = ~done
        nxt = jnp.where(emitted, nxt, 0)
        new_done = done | (nxt == eos_id) | (pos + 2 >= max_len)
        return (cache, nxt, pos + 1, new_done, rng), (nxt, emitted)

    carry = (cache, first, prompt_lens, done, rng)
    _, (rest, emitted) = jax.lax.scan(step, carry, None, length=max_new_tokens - 1)
    tokens = jnp.concatenate([first[:, None], rest.T], axis=1)
    counts = 1 + jnp.sum(emitted.T, axis=1)
    return tokens, counts


def generate(
    model: Qwen3,
    params,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_id: int | None = None,
    max_len: int | None = None,
) -> GenerationOutput:
    """Generate continuations for a batch of token-id prompts (one cache slot each)."""
    if not prompts:
        raise ValueError("generate() needs at least one prompt")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    cfg = model.config
    max_len = max_len or cfg.max_position_embeddings
    lens = [len(p) for p in prompts]
    for i, n in enumerate(lens):
        if n == 0:
            raise ValueError(f"prompt {i} is empty")
        if n >= max_len:
            raise ValueError(
                f"prompt {i} has {n} tokens; the cache holds {max_len} positions, so prompts "
                f"must be shorter than {max_len}"
            )
    bucket = min(length_bucket(max(lens)), max_len)
    padded = np.zeros((len(prompts), bucket), np.int32)
    for i, p in enumerate(prompts):
        padded[i, : len(p)] = p
    tokens, counts = _generate(
        model,
        params,
        jnp.asarray(padded),
        jnp.asarray(lens, jnp.int32),
        jax.random.key(seed),
        jnp.float32(temperature),
        jnp.int32(top_k),
        jnp.float32(top_p),
        jnp.int32(-1 if eos_id is None else eos_id),
        max_new_tokens=max_new_tokens,
        max_len=max_len,
    )
    tokens, counts = np.asarray(tokens), np.asarray(counts)
    out, reasons = [], []
    for i in range(len(prompts)):
        seq = tokens[i, : counts[i]].tolist()
        out.append(seq)
        reasons.append(
            FINISH_EOS if eos_id is not None and seq and seq[-1] == eos_id else FINISH_LENGTH
        )
    return GenerationOutput(out, reasons)
