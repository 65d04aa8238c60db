"""The engine's own decode round (``SpeculativeDecoder.lower_round``) compiled ahead of
time for a mesh: draft -> schedule -> packed verify -> commit, state laid out by
``SpeculativeDecoder.state_shardings``."""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from dspark_jax import sharding as shd
from dspark_jax.aot.memory import abstract_tree, memory_fields, per_device_bytes, with_fit
from dspark_jax.aot.topology import compiler_info
from dspark_jax.ops.flash_attention import compile_platform


# ----------------------------------------------------------------------------------------
# Serving round
# ----------------------------------------------------------------------------------------
def compile_serve_round(
    target_config,
    drafter_config,
    mesh,
    slots: int,
    max_len: int,
    budget: int | None = None,
    device_memory_gb: float | None = None,
    scheduler: str = "fixed",
    dtype: str = "bfloat16",
    attention: str = "auto",
    page_size: int = 16,
) -> tuple[dict[str, Any], Any]:
    """Compile one fused decode round (draft → schedule → packed verify → commit) of
    ``SpeculativeDecoder`` for ``slots`` request slots, a ``max_len`` KV cache and verify
    budget ``budget`` (default: all drafts, ``R·γ``), with bf16 weights and cache.

    Target weights follow the rules table (embed over ``fsdp``, heads/MLP/vocab over
    ``tensor``); the paged KV pool (every slot at ``max_len``, pages of ``page_size``) and
    the drafter's paged context are split over KV heads (``tensor``) and, with data
    replicas, into one pool per replica (``data``: each replica runs ``slots / data`` slots
    and verifies ``budget`` rows of its own). ``attention`` ``auto`` resolves for the
    mesh's platform (the TPU kernel for a TPU topology).
    """
    from dspark_jax.decode.step import SpeculativeDecoder, StepConfig
    from dspark_jax.models.drafters import init_drafter_params, make_drafter
    from dspark_jax.models.qwen3 import Qwen3
    from dspark_jax.ops.paged_attention import resolve_backend

    tcfg = target_config.replace(dtype=dtype, param_dtype=dtype, remat="none")
    target = Qwen3(tcfg)
    drafter = None if drafter_config is None else make_drafter(drafter_config, tcfg)
    key = jax.eval_shape(lambda: jax.random.PRNGKey(0))  # abstract: see the module docstring
    platform = compile_platform(mesh.devices.flat[0].platform)
    with jax.set_mesh(mesh), shd.rules_context(mesh), platform:
        t_boxed = jax.eval_shape(
            lambda k: target.init(k, jnp.zeros((1, 8), jnp.int32))["params"], key
        )
        t_params, _ = abstract_tree(t_boxed, mesh)
        d_params = None
        if drafter is not None:
            d_boxed = jax.eval_shape(lambda k: init_drafter_params(drafter, k), key)
            d_params, _ = abstract_tree(d_boxed, mesh)
        dec = SpeculativeDecoder(
            target,
            t_params,
            drafter,
            d_params,
            StepConfig(
                num_slots=slots,
                max_len=max_len,
                scheduler=scheduler,
                page_size=page_size,
                attention=resolve_backend(attention, mesh.devices.flat[0].platform, tcfg.head_dim),
            ),
            # On the mesh, as the engine runs it: data replicas, if any, each run their
            # own block of slots and page pool (decode.replicas).
            mesh=mesh,
        )
        budget = dec.full_budget if budget is None else int(budget)
        state = jax.eval_shape(dec.init_state)
        rep = NamedSharding(mesh, PartitionSpec())
        # The decoder's own state layout (SpeculativeDecoder.state_shardings), not a copy.
        state = jax.tree.map(
            lambda leaf, s: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=s),
            state,
            dec.state_shardings(mesh),
        )
        sps = jax.ShapeDtypeStruct((dec.table_len,), jnp.float32, sharding=rep)
        params = (t_params, d_params, sps)
        t0 = time.perf_counter()
        lowered = dec.lower_round(state, budget, params)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
    report = {
        "kind": "serve_round",
        **compiler_info(mesh),
        "mesh": dict(mesh.shape),
        "num_devices": int(mesh.size),
        "slots": int(slots),
        "max_len": int(max_len),
        "budget": int(budget),
        "gamma": int(dec.gamma),
        "dtype": dtype,
        "attention": dec.attention,
        "page_size": int(page_size),
        "lower_s": round(t1 - t0, 2),
        "compile_s": round(t2 - t1, 2),
        "per_device": {
            "target_bytes": per_device_bytes(t_params),
            "drafter_bytes": per_device_bytes(d_params) if d_params is not None else 0,
            "kv_cache_bytes": per_device_bytes(state.cache),
            "state_bytes": per_device_bytes(state),
        },
        "memory": memory_fields(compiled),
    }
    return with_fit(report, device_memory_gb), compiled
