"""The speculative decode step (DESIGN §5.2): draft -> schedule -> packed verify -> commit.

State per slot ``r`` (all fixed-shape arrays, passed in and returned):

* ``seq_len[r]``: number of committed tokens whose keys/values are in the target cache.
  The anchor (the last committed token, not yet run through the target) sits at position
  ``seq_len[r]``; the drafter's context is every position ``< seq_len[r]``.
* ``anchor[r]``: that token. ``ctx_feats``: the drafter's context, every draft layer's
  K/V of each committed position ``t < seq_len[r]`` in pages of the slot's page table
  (computed once, when the position is committed, from the target's tap or final hidden
  states; for EAGLE-3/MTP-1, whose state ``t`` pairs position t with token ``t+1``, once
  that token is committed). ``ctx_query[r]`` (EAGLE-3/MTP-1): the slot's last context
  state, the first query of its next draft.

A round for R slots with verify budget K (one compiled function per K):

1. Draft ``[R, G]`` tokens, their draft distributions and confidences.
2. Schedule: survival ``a = cumprod(c)`` -> per-slot prefix lengths ``l[r]`` (a mask, never
   a shape). Lengths are capped by the room left in the cache and by ``max_new`` so no
   write goes past ``max_len``.
3. Packed verify: the anchor and the ``l[r]`` admitted drafts of every slot are packed
   into a buffer of ``R + K`` rows (row = one token, with its slot and position). The
   target runs ``Qwen3.decode`` on ``[R + K, 1]``: projections, MLP and LM head cost
   ``O(R + K)``, not ``O(R·(G+1))``.

   Attention: the target's K/V live in a page pool (``ops.paged_attention``; each slot's
   page-table row ``page_table[r]`` is set at prefill). The packed rows' K/V are written
   into their pages in place, then ragged paged attention reads each slot's pages only up
   to its length (``StepConfig.attention``: the TPU kernel reads them once for all the
   slot's rows; the XLA reference gathers them per row).
4. Accept (greedy or rejection sampling), commit by lengths only (rejected cache entries
   stay and are overwritten later), append the drafter's K/V of committed positions to
   the drafter context.

Random streams: every slot has its own key (``slot_keys[r]``, key data), set at prefill
from the request's seed and split once per round the slot is active: a request's draws
(first token, drafts, acceptance uniforms, residual/bonus token) come from its own stream
only, whatever else shares the rounds (``request_key_data`` turns a seed into key data).
A *coupled* slot (``coupled[r]``, chosen at prefill) instead keeps its key fixed and draws
the token at sequence position ``t`` with the noise of ``fold_in(key, t)``, in the drafter
and in verification alike (``verify.verify_coupled``): its output is the target's own
Gumbel-max sample for that key, identical whatever the scheduler, the verify budget or
the other slots (up to floating-point ties of the target's logits).

A round is two pure pieces: ``plan`` (steps 1-2: drafts, survival, capped lengths) and
``commit`` (steps 3-4, compiled per K). ``round`` fuses them in one executable. The
synchronous Algorithm-1 path (``prefix`` with several buckets, see ``Runner``) runs them as
two executables instead: the host reads ``Σ l`` from the plan, picks the smallest compiled
bucket ``K >= Σ l`` and verifies the *same* drafts in it, so pruning saves real compute
(the lengths never depend on the tokens they admit, so the bucket choice stays exact).

This module holds the decoder: its compiled functions, the state's layout and the host
API. The computation is in one module per piece: ``decode.plan_step`` (steps 1-2),
``decode.commit_step`` (steps 3-4: packing, verify, commit), ``decode.prefill_step``,
``decode.keys`` (random streams), ``decode.logprobs``, ``decode.profiling`` (SPS) and
``decode.replicas`` (data replicas: every step per replica).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from dspark_jax.decode import replicas as replicas_lib
from dspark_jax.decode.commit_step import commit_step
from dspark_jax.decode.keys import slot_position_keys
from dspark_jax.decode.logprobs import target_logprobs
from dspark_jax.decode.pages import full_pool_pages
from dspark_jax.decode.plan_step import draft, plan_step, schedule
from dspark_jax.decode.prefill_step import prefill_step
from dspark_jax.decode.profiling import plain_step_fn, profile_step_fns

# The step's data (re-exported here, where callers have always found it).
from dspark_jax.decode.state import (  # noqa: F401
    FINISH_EOS,
    FINISH_LENGTH,
    FINISH_NAMES,
    FINISH_NONE,
    SCHEDULER_MODES,
    DecodeState,
    Plan,
    PrefillOutput,
    RoundOutput,
    StepConfig,
    request_key_data,
)
from dspark_jax.models.drafter_io import resolve_estimator
from dspark_jax.models.qwen3 import Qwen3, init_cache
from dspark_jax.ops.paged_attention import (
    NULL_PAGE,
    page_locations,
    pages_per_sequence,
    resolve_backend,
)
from dspark_jax.sharding import logical_to_spec, place_host_tree

Array = jax.Array


def _state_only(state):
    return (state,)


class SpeculativeDecoder:
    """Jitted prefill and decode rounds for a target + drafter pair.

    ``drafter`` may be ``None`` (plain decoding through the same machinery: every round
    verifies only the anchor). ``sts_temperatures`` and ``sts_biases`` (``[G]`` each, from
    ``eval.calibration.load_sts``) calibrate confidences as ``σ(z / T + b)``, where ``z``
    is the estimate ``survival_estimator`` names (``models.drafter_io.SURVIVAL_ESTIMATORS``):
    the confidence head's logit, or ``logit(max_v q_k(v))`` of the draft distribution
    (None: the head where the drafter has one, else the draft probability). ``sts``: an
    ``STS`` (``LoadedDrafter.calibration``) in place of the three; only it carries an
    isotonic fit's step maps.
    """

    def __init__(
        self,
        target: Qwen3,
        target_params,
        drafter,
        drafter_params,
        config: StepConfig,
        sps_table: Array | None = None,
        sts_temperatures=None,
        sts_biases=None,
        mesh=None,
        survival_estimator: str | None = None,
        sts=None,
    ):
        sts_knots = None
        if sts is not None:
            if sts_temperatures is not None or sts_biases is not None:
                raise ValueError("pass sts= or sts_temperatures=/sts_biases=, not both")
            sts_temperatures, sts_biases = sts.temperatures, sts.biases
            sts_knots = sts.knots
            if survival_estimator is not None and survival_estimator != sts.estimator:
                raise ValueError(
                    f"survival_estimator {survival_estimator!r} but the STS calibrates "
                    f"{sts.estimator!r}"
                )
            survival_estimator = sts.estimator
        has_head = drafter is not None and bool(drafter.config.has_confidence)
        self.survival_estimator = resolve_estimator(survival_estimator, has_head)
        self.target = target
        self.drafter = drafter
        self.config = config
        # On a device mesh (``decode.mesh``): the parameters are placed by the logical-axis
        # rules (already-placed ones stay put), the state by ``state_shardings``, and every
        # executable is traced under the mesh and the rules table (the kernels run per
        # device under ``shard_map``) and returns its state in that same layout, so a round
        # never meets a new input layout and compiles once per bucket.
        self.mesh = mesh
        # Data replicas (decode.replicas): D blocks of R/D slots, each with its own page
        # pool of num_pages/D pages; every step runs per replica. One replica: no change.
        self.replicas = replicas_lib.replica_count(mesh)
        # A mesh over several processes (hosts): every process reads each output the host
        # loop needs, and a process can read only its own devices' shards, so the outputs
        # are gathered onto every device (a few KiB per round: tokens, counts, survivals).
        # One process keeps them where they are (device_get gathers them on the host).
        self.spans_processes = mesh is not None and any(
            d.process_index != jax.process_index() for d in mesh.devices.flat
        )
        if config.num_slots % self.replicas:
            raise ValueError(
                f"--data {self.replicas} needs a slot count it divides (each replica owns "
                f"R/{self.replicas} slots); got {config.num_slots} slots"
            )
        self.replica_slots = config.num_slots // self.replicas
        if mesh is not None:
            from dspark_jax.decode import mesh as mesh_lib

            target_params = mesh_lib.place_params(
                target_params, mesh_lib.target_layout(target.config, mesh), "target"
            )
            if drafter is not None:
                drafter_params = mesh_lib.place_params(
                    drafter_params, mesh_lib.drafter_layout(drafter, mesh), "drafter"
                )
        self.target_params = target_params
        self.drafter_params = drafter_params
        tcfg = target.config
        if config.max_len > tcfg.max_position_embeddings:
            raise ValueError(
                f"max_len {config.max_len} exceeds the target's max_position_embeddings "
                f"{tcfg.max_position_embeddings}"
            )
        if drafter is None:
            self.gamma, self.taps, self.kind, self.query_dim = 1, None, "none", 0
            self.has_confidence, self.kv_cache, self.next_token_states = False, False, False
        else:
            dcfg = drafter.config
            if drafter.target.vocab_size != tcfg.vocab_size or (
                drafter.target.hidden_size != tcfg.hidden_size
            ):
                raise ValueError(
                    "drafter was built for a different target: vocab/hidden "
                    f"{drafter.target.vocab_size}/{drafter.target.hidden_size} vs target "
                    f"{tcfg.vocab_size}/{tcfg.hidden_size}"
                )
            self.kind = dcfg.kind
            self.gamma = dcfg.draft_len
            self.taps = tuple(dcfg.taps) if dcfg.uses_taps else None
            # Every drafter keeps each slot's context as its layers' K/V rows in pages,
            # computed once when a position is committed: drafting never re-projects the
            # whole context (before, EAGLE-3 and MTP-1 re-ran their layer over it each round).
            self.kv_cache = True
            self.next_token_states = dcfg.next_token_states
            self.query_dim = dcfg.query_width(tcfg)
            self.has_confidence = dcfg.has_confidence
        # Every drafter has survivals (a drafter without a confidence head gets the
        # draft-probability estimate), so only plain decoding lacks them.
        if config.scheduler in ("threshold", "prefix", "topk") and drafter is None:
            raise ValueError(
                f"scheduler {config.scheduler!r} needs a drafter; without one use 'none'"
            )
        g = self.gamma
        # SPS(B) of one replica (each is one server of Algorithm 1): B = 0 … R/D·(G+1).
        self.table_len = self.replica_slots * (g + 1) + 1
        # The paged cache: its pool, and the backend of the verify attention. The drafter's
        # context K/V share the target's page table and a draft writes its block's K/V past
        # the context (ops.paged_attention.block_attention; EAGLE-3 its chain's), so a
        # slot's pages cover γ positions past max_len (decode.pages).
        self.draft_positions = g if self.kv_cache else 0
        positions = config.max_len + self.draft_positions
        self.pages_per_seq = pages_per_sequence(positions, config.page_size)
        self.full_pool = full_pool_pages(config.num_slots, positions, config.page_size)
        # With replicas: the pool is D pools of ``replica_pages`` (each with its null page);
        # ``num_pages`` counts them all (a page table's entries are replica-local).
        d = self.replicas
        replica_full = full_pool_pages(self.replica_slots, positions, config.page_size)
        self.replica_pages = replica_full if config.num_pages is None else config.num_pages // d
        if self.replica_pages < 2:
            raise ValueError(
                f"a page pool of {config.num_pages} pages over {d} data replicas leaves "
                f"{self.replica_pages} per replica; each needs >= 2 (page 0 is its null page)"
            )
        self._replica_full_pool = replica_full
        self.full_pool = d * replica_full
        self.num_pages = d * self.replica_pages
        self.attention = resolve_backend(config.attention, head_dim=tcfg.head_dim)
        self._sps = None
        self.plain_sps: float | None = None  # plain rounds per second (set_sps_table)
        # Host (NumPy) arrays: nothing concrete may be created on the device here, so the
        # same constructor serves ahead-of-time compilation for a TPU topology the host
        # does not have (jit places them as constants of the executables).
        temps = np.ones((g,), np.float32) if sts_temperatures is None else sts_temperatures
        self.sts_temperatures = np.asarray(temps, np.float32)
        if self.sts_temperatures.shape != (g,):
            raise ValueError(f"STS temperatures must have shape [{g}], got {temps!r}")
        biases = np.zeros((g,), np.float32) if sts_biases is None else sts_biases
        self.sts_biases = np.asarray(biases, np.float32)
        if self.sts_biases.shape != (g,):
            raise ValueError(f"STS biases must have shape [{g}], got {biases!r}")
        # Isotonic step maps ([G, 2, J], NaN rows: none at that position) or None.
        self.sts_knots = None if sts_knots is None else np.asarray(sts_knots, np.float32)
        if self.sts_knots is not None and self.sts_knots.shape[:2] != (g, 2):
            raise ValueError(f"STS knots must have shape [{g}, 2, J], got {self.sts_knots.shape}")
        # Parameters (and the SPS table) are passed as arguments, not closed over, so they
        # are not baked into the executables as constants and a re-profiled table needs no
        # recompilation; the state is donated so caches update in place.
        self._state_shardings = None if mesh is None else self.state_shardings(mesh)
        pin = self._pinned
        if self.replicas > 1:
            self._replica_specs = replicas_lib.state_specs(
                jax.eval_shape(functools.partial(self._empty_state, 0)), self.kv_cache
            )
            round_fn, plan_fn = self._round_replicas, self._plan_replicas
            commit_fn, prefill_fn = self._commit_replicas, self._prefill_replicas
            plain_fn = self._plain_replicas
        else:
            round_fn, plan_fn = self._round_impl, self._plan_impl
            commit_fn, prefill_fn = self._commit_impl, self._prefill_impl
            plain_fn = self._plain_impl
        self._round = jax.jit(pin(round_fn, "round"), static_argnums=(2,), donate_argnums=(1,))
        # A plain round (no drafter call, the anchors alone verified): what the draft-aware
        # policy runs when drafting would not pay (decode.policy).
        self._plain = jax.jit(pin(plain_fn, "plain_round"), donate_argnums=(1,))
        # The plan returns the state too: a DSpark/DFlash draft writes its block K/V into
        # the paged drafter context in place (donated, like every round).
        self._plan = jax.jit(pin(plan_fn, "plan"), static_argnums=(2,), donate_argnums=(1,))
        self._commit = jax.jit(pin(commit_fn, "commit"), static_argnums=(3,), donate_argnums=(1,))
        self._prefill = jax.jit(pin(prefill_fn, "prefill"), donate_argnums=(1,))
        # A state edited on the host, put back in the layout the rounds return (on a mesh,
        # the specs jit gives its outputs, which is what the next call is keyed on).
        self._relayout_state = jax.jit(pin(_state_only, "relayout"), donate_argnums=(0,))
        self._params = (target_params, drafter_params, np.zeros((self.table_len,), np.float32))
        if sps_table is not None:
            self.set_sps_table(sps_table)

    # -- SPS table --------------------------------------------------------------------
    @property
    def sps_table(self) -> Array | None:
        """``SPS(B)`` indexed by ``B = 0 … R·(G+1)`` (``None`` until set)."""
        return self._sps

    def set_sps_table(self, table) -> None:
        """Install a profiled table (an ``SPSTable`` or a dense array indexed by ``B``).

        It is an argument of the compiled rounds, so changing it never recompiles. An
        ``SPSTable`` with a plain round's time also sets ``plain_sps`` (else None: the
        draft-aware policy then always drafts).
        """
        plain = getattr(table, "plain_sps", None)
        if hasattr(table, "as_array"):
            table = table.as_array(self.table_len)
        arr = jnp.asarray(table, jnp.float32)
        if self.mesh is not None:  # beside the parameters, replicated
            from jax.sharding import NamedSharding, PartitionSpec

            arr = place_host_tree(np.asarray(arr), NamedSharding(self.mesh, PartitionSpec()))
        if arr.ndim != 1 or arr.shape[0] < self.table_len:
            raise ValueError(
                f"SPS table has shape {arr.shape}; need a 1-D table with >= {self.table_len} "
                f"entries (B = 0 … R·(G+1) for R={self.config.num_slots}, G={self.gamma})"
            )
        self._sps = arr[: self.table_len]
        self._params = (self._params[0], self._params[1], self._sps)
        self.plain_sps = plain

    def _require_table(self) -> None:
        if self.config.scheduler in ("prefix", "topk") and self._sps is None:
            raise ValueError(
                f"scheduler {self.config.scheduler!r} needs an SPS table: pass sps_table= or "
                "call set_sps_table (see profile_step_fns / dspark_jax.sched.sps)"
            )

    # -- state ------------------------------------------------------------------------
    def init_state(self, seed: int = 0) -> DecodeState:
        """Every slot free; on a mesh, laid out by ``state_shardings``."""
        state = self._empty_state(seed)
        if self.mesh is None or isinstance(state.seq_len, jax.core.Tracer):  # eval_shape
            return state
        return self._relayout(state)

    def _empty_state(self, seed: int) -> DecodeState:
        c, r = self.config, self.config.num_slots
        return DecodeState(
            cache=init_cache(self.target.config, self.num_pages, c.page_size),
            page_table=jnp.asarray(self.static_page_rows(np.arange(r))),
            ctx_feats=jnp.zeros(self.ctx_shape, self.target.config.compute_dtype),
            ctx_query=jnp.zeros((r, self.query_dim), self.target.config.compute_dtype),
            seq_len=jnp.zeros((r,), jnp.int32),
            anchor=jnp.zeros((r,), jnp.int32),
            active=jnp.zeros((r,), bool),
            remaining=jnp.zeros((r,), jnp.int32),
            temperature=jnp.zeros((r,), jnp.float32),
            top_k=jnp.zeros((r,), jnp.int32),
            top_p=jnp.ones((r,), jnp.float32),
            slot_keys=jnp.asarray(
                np.stack([request_key_data(seed, s) for s in range(r)]), jnp.uint32
            ),
            coupled=jnp.zeros((r,), bool),
        )

    # Logical axes of the paged pools: the target's KV pool and a DSpark/DFlash drafter's
    # paged context (which shares its page table) are split over KV heads, never over
    # pages, since a page may belong to any slot.
    _POOL_AXES = ("cache_layers", "cache_pages", "cache_page_len", "cache_kv_heads", None)

    def state_shardings(self, mesh) -> DecodeState:
        """The ``NamedSharding`` of every field of the decode state on ``mesh``: the one
        layout of the state, for the serving round compiled ahead of time
        (``aot.compile_serve_round``) and the roofline. The pools per
        ``_POOL_AXES``; every per-slot field (``[R, ...]``) over the batch axes
        (``cache_slots``); a dimension the mesh does not divide stays whole
        (``sharding.logical_to_spec``)."""
        from jax.sharding import NamedSharding, PartitionSpec

        def one(path, leaf):
            name = getattr(path[0], "name", None)
            if name == "cache" or (name == "ctx_feats" and self.kv_cache):
                # Split by KV heads, not by entries of the combined axis: keys and values
                # interleave there (ops.paged_attention), so a split that does not divide
                # the heads would put a head's K and V on different devices.
                heads = leaf.shape[:3] + (leaf.shape[3] // 2,) + leaf.shape[4:]
                spec = used_axes(logical_to_spec(self._POOL_AXES, heads, mesh))
                if self.replicas > 1:  # D pools, one per data replica (decode.replicas)
                    spec = PartitionSpec(spec[0], replicas_lib.DATA, *spec[2:])
                return NamedSharding(mesh, spec)
            names = ("cache_slots",) + (None,) * (leaf.ndim - 1) if leaf.ndim else ()
            return NamedSharding(mesh, used_axes(logical_to_spec(names, leaf.shape, mesh)))

        def used_axes(spec):
            # Axes of size 1 dropped: the layout a round returns its state in, so the next
            # call sees the same input shardings (P(('data', 'fsdp')) on a data-1 mesh would
            # come back as P() and compile the round again).
            def keep(axis):
                axes = () if axis is None else ((axis,) if isinstance(axis, str) else axis)
                axes = tuple(a for a in axes if mesh.shape[a] > 1)
                return None if not axes else (axes[0] if len(axes) == 1 else axes)

            return PartitionSpec(*map(keep, spec))

        return jax.tree_util.tree_map_with_path(
            one, jax.eval_shape(functools.partial(self._empty_state, 0))
        )

    def _relayout(self, state: DecodeState) -> DecodeState:
        with self.mesh_context():
            return self._relayout_state(state)[0]

    def _pinned(self, impl, name: str):
        """``impl`` (which returns ``(state, ...)``) with its returned state constrained to
        ``state_shardings`` on a mesh, named ``name`` (compile logs and profiles say
        jit(round), not pinned)."""

        def pinned(*args):
            state, *rest = impl(*args)
            if self.mesh is not None:
                state = jax.lax.with_sharding_constraint(state, self._state_shardings)
            if self.spans_processes:
                rest = jax.lax.with_sharding_constraint(
                    rest, jax.sharding.NamedSharding(self.mesh, P())
                )
            return (state, *rest)

        pinned.__name__ = pinned.__qualname__ = name
        return pinned

    # -- data replicas (decode.replicas): each step run per replica ----------------------
    def _per_replica(self, fn, in_specs, out_specs):
        return replicas_lib.run_per_replica(fn, self.mesh, in_specs, out_specs)

    def _round_replicas(self, params, state, budget, limits):
        def fn(p, s, lim):
            return self._round_impl(p, s, budget, lim[0])

        specs, rows = self._replica_specs, P(replicas_lib.DATA)
        return self._per_replica(fn, (P(), specs, rows), (specs, rows))(params, state, limits)

    def _plan_replicas(self, params, state, budget, limits):
        def fn(p, s, lim):
            return self._plan_impl(p, s, budget, lim[0])

        specs, rows = self._replica_specs, P(replicas_lib.DATA)
        return self._per_replica(fn, (P(), specs, rows), (specs, rows))(params, state, limits)

    def _commit_replicas(self, params, state, plan, budget):
        def fn(p, s, pl):
            return self._commit_impl(p, s, pl, budget)

        specs, rows = self._replica_specs, P(replicas_lib.DATA)
        return self._per_replica(fn, (P(), specs, rows), (specs, rows))(params, state, plan)

    def _plain_replicas(self, params, state):
        specs, rows = self._replica_specs, P(replicas_lib.DATA)
        return self._per_replica(self._plain_impl, (P(), specs), (specs, rows))(params, state)

    def _prefill_replicas(self, params, state, rows, back):
        specs, data = self._replica_specs, P(replicas_lib.DATA)
        state, out = self._per_replica(self._prefill_impl, (P(), specs, data), (specs, data))(
            params, state, rows
        )
        return state, jax.tree.map(lambda x: x[back], out)  # the caller's row order

    def _limits(self, budget: int, replica_budgets=None):
        """Each replica's own verify budget (``[D]``, at most the bucket ``budget``), as
        the per-replica steps take it: sharded over the data axis."""
        from jax.sharding import NamedSharding

        d = self.replicas
        limits = np.full((d,), budget, np.int32)
        if replica_budgets is not None:
            given = np.asarray(replica_budgets, np.int32).reshape(-1)
            if given.shape != (d,):
                raise ValueError(f"replica_budgets needs {d} entries (one per data replica)")
            limits = np.minimum(given, budget)
        return place_host_tree(limits, NamedSharding(self.mesh, P(replicas_lib.DATA)))

    def mesh_context(self):
        """The context every executable of a meshed decoder is traced and run in: the mesh
        and the logical-axis rules (a no-op without a mesh)."""
        from dspark_jax.decode.mesh import mesh_context

        return mesh_context(self.mesh)

    def lower_round(self, state, budget: int, params=None):
        """``jax.jit(...).lower`` of the fused round the decoder runs (draft → schedule →
        packed verify → commit) at verify budget ``budget``: for ahead-of-time compilation
        with abstract arguments (``jax.ShapeDtypeStruct`` with shardings; ``params`` =
        ``(target params, drafter params, SPS table)``, default the decoder's own)."""
        params = self._params if params is None else params
        with self.mesh_context():
            if self.replicas == 1:
                return self._round.lower(params, state, budget)
            limits = jax.ShapeDtypeStruct(
                (self.replicas,), jnp.int32, sharding=jax.sharding.NamedSharding(
                    self.mesh, P(replicas_lib.DATA)
                ),
            )  # fmt: skip
            return self._round.lower(params, state, budget, limits)

    def static_page_rows(self, slots) -> np.ndarray:
        """Page-table rows ``[len(slots), pages_per_seq]`` giving slot ``s`` the fixed pages
        ``1 + s·pages_per_seq …`` when the pool holds every slot at max_len (the default
        pool); otherwise, and for slots ``>= num_slots`` (batch padding), null rows: such a
        slot writes only the null page, so real requests need rows from a
        ``decode.pages.PagePool``."""
        slots = np.asarray(slots, np.int64).reshape(-1)
        rows = np.full((slots.size, self.pages_per_seq), NULL_PAGE, np.int32)
        if self.replica_pages >= self._replica_full_pool:
            own = (slots >= 0) & (slots < self.config.num_slots)
            # With data replicas, pages inside the slot's replica pool.
            base = 1 + (slots[own, None] % self.replica_slots) * self.pages_per_seq
            rows[own] = base + np.arange(self.pages_per_seq)
        return rows

    @property
    def full_budget(self) -> int:
        """The verify budget that holds every draft token: K = R·G (per data replica:
        R/D·G, each replica verifying its own block in a bucket of K rows)."""
        return self.replica_slots * self.gamma

    def compiled_executables(self) -> int:
        """Executables compiled so far for rounds, plans, commits and prefills (one per
        shape; serving checks that none is added after warm-up)."""
        fns = (self._round, self._plan, self._commit, self._prefill, self._relayout_state)
        fns += (self._plain,)
        return sum(f._cache_size() for f in fns)

    # -- the frozen target pieces the drafter shares --------------------------------------
    def _embed_fn(self, tp):
        return lambda tokens: self.target.apply({"params": tp}, tokens, method=Qwen3.embed)

    def _lm_head_fn(self, tp):
        return lambda h: self.target.apply({"params": tp}, h, method=Qwen3.logits_from_hidden)

    def _features(self, taps, hidden):
        """What the drafter reads of target rows: concatenated taps or the final hidden."""
        if self.taps is None:
            return hidden
        m = taps.shape[0]
        return jnp.moveaxis(taps, 0, -2).reshape(taps.shape[1:-1] + (m * taps.shape[-1],))

    @property
    def ctx_shape(self) -> tuple[int, ...]:
        """Shape of ``DecodeState.ctx_feats``: the draft layers' K/V in pages,
        ``[layers, num_pages, page_size, 2·KV, D]``: the target cache's layout and page
        table (``ops.paged_attention``), so its memory is the page pool's, not ``slots ×
        max_len``, and each slot's pages are read once per draft layer (EAGLE-3: per draft
        step), up to its length. Without a drafter, a placeholder ``[1]``."""
        if not self.kv_cache:
            return (1,)
        layers, two, kv, d = self.drafter.config.context_kv_shape(self.target.config)
        return (layers, self.num_pages, self.config.page_size, two * kv, d)

    def _write_context(
        self, ctx: Array, slots: Array, positions: Array, rows: Array, page_table: Array
    ) -> Array:
        """Scatter K/V ``rows [..., layers, 2·KV, D]`` into the pages of slots ``slots``
        (rows of ``page_table``) at ``positions`` (both ``rows.shape[:-3]``); out-of-range
        positions (``max_len``) are dropped."""
        rows = rows.astype(ctx.dtype)
        page, offset = page_locations(
            page_table, slots, positions, positions < self.config.max_len,
            self.config.page_size, ctx.shape[1],
        )  # fmt: skip
        # Adjacent index arrays (page, offset): the indexed shape is
        # (layers,) + positions.shape + (2·KV, D).
        return ctx.at[:, page, offset].set(jnp.moveaxis(rows, -3, 0), mode="drop")

    def _context_rows(self, params, taps, hidden, positions, next_ids):
        """What the drafter context stores for target rows at ``positions``: the draft
        layers' K/V ``[..., layers, 2·KV, D]``, and the context states ``[..., d]``
        (EAGLE-3/MTP-1, whose states pair a row with its next token ``next_ids``; else
        None), whose last the slot keeps as its next draft's first query."""
        tp, dp = params[0], params[1]
        return self.drafter.apply(
            {"params": dp}, self._features(taps, hidden), positions, next_ids,
            self._embed_fn(tp), method="context_cache",
        )  # fmt: skip

    # -- prefill ----------------------------------------------------------------------
    def prefill(
        self,
        state,
        slots,
        prompts,
        lengths,
        max_new,
        temperature,
        top_k,
        top_p,
        keys=None,
        coupled=None,
        page_rows=None,
    ):
        """Insert prompts ``[B, T]`` (right-padded) into ``slots [B]`` and sample token 1.

        ``keys [B, ...]``: each row's random stream as key data (``request_key_data``);
        None: each slot continues its own stream. ``coupled [B]`` bool: rows whose draws are
        keyed by position (load-invariant, see the module docstring); None: none.
        ``page_rows [B, pages_per_seq]``: each row's pages (``decode.pages.PagePool``,
        enough for prompt + max_new positions); None: ``static_page_rows``, which needs
        the full-size pool. A row whose slot is ``>= num_slots`` is computed but writes
        nothing outside the null page (batch padding).
        """
        if keys is None:
            keys = state.slot_keys[jnp.minimum(jnp.asarray(slots), self.config.num_slots - 1)]
        if coupled is None:
            coupled = np.zeros(np.shape(slots), bool)
        if page_rows is None:
            if self.num_pages < self.full_pool:
                raise ValueError(
                    f"this decoder's page pool ({self.num_pages} pages) is smaller than every "
                    f"slot at max_len ({self.full_pool}): pass page_rows from a PagePool"
                )
            page_rows = self.static_page_rows(slots)
        page_rows = np.asarray(page_rows, np.int32)
        if page_rows.shape != (np.size(slots), self.pages_per_seq):
            raise ValueError(
                f"page_rows must have shape [{np.size(slots)}, {self.pages_per_seq}] (rows x "
                f"pages per slot), got {page_rows.shape}"
            )
        rows = (slots, prompts, lengths, max_new, temperature, top_k, top_p, keys, coupled)
        rows += (page_rows,)
        if self.replicas > 1:
            return self._prefill_grouped(state, rows)
        with self.mesh_context():
            return self._prefill(self._params, state, tuple(self._put(a) for a in rows))

    def _prefill_grouped(self, state, rows):
        """Prefill with data replicas: each replica gets ``B`` rows (its own rows first,
        the rest padding), slots local to it; outputs come back in the caller's order."""
        from jax.sharding import NamedSharding

        take, local, back = replicas_lib.group_prefill_rows(
            rows[0], self.replica_slots, self.replicas
        )
        src = np.maximum(take, 0)
        pad = take < 0
        grouped = [local]
        for i, a in enumerate(rows[1:], 1):
            a = np.asarray(a)[src]
            if i == 9:  # page rows: padding rows write only their replica's null page
                a = np.where(pad[:, None], NULL_PAGE, a)
            grouped.append(a)
        data = NamedSharding(self.mesh, P(replicas_lib.DATA))
        grouped = tuple(place_host_tree(np.asarray(a), data) for a in grouped)
        with self.mesh_context():
            return self._prefill(self._params, state, grouped, self._put(back))

    def _put(self, a):
        """A host array as a prefill input: on a mesh over several processes, put whole on
        every device explicitly (every process holds the same value; ``place_host_tree``
        says why not ``jax.device_put``); else ``jnp.asarray``."""
        if self.spans_processes and not isinstance(a, jax.Array):
            from jax.sharding import NamedSharding

            return place_host_tree(np.asarray(a), NamedSharding(self.mesh, P()))
        return jnp.asarray(a)

    def _prefill_impl(self, params, state, rows):
        return prefill_step(self, params, state, rows)

    def profile_step_fns(
        self, budgets, seed: int = 0, context_len: int = 1
    ) -> dict[int, Callable[[], Array]]:
        """``decode.profiling.profile_step_fns`` for this decoder: one callable per verify
        budget ``K``, keyed by ``B = R + K``, for ``sched.sps.profile_sps``."""
        return profile_step_fns(self, budgets, seed, context_len)

    def plain_step_fn(self, seed: int = 0, context_len: int = 1) -> Callable[[], Array]:
        """``decode.profiling.plain_step_fn``: one plain round per call, on the state the
        ``profile_step_fns`` rounds run on (``sched.sps.profile_sps``' ``plain_fn``)."""
        return plain_step_fn(self, seed, context_len)

    def release(self, state: DecodeState, slot: int) -> DecodeState:
        """Free a slot (cancellation): it stops drafting/verifying from the next round."""
        state = state._replace(active=state.active.at[slot].set(False))
        return state if self.mesh is None else self._relayout(state)

    # -- one round --------------------------------------------------------------------
    def _check_budget(self, budget) -> int:
        k = self.full_budget if budget is None else int(budget)
        if not 0 <= k <= self.full_budget:
            raise ValueError(f"verify budget must be in [0, {self.full_budget}], got {k}")
        return k

    def round(self, state: DecodeState, budget: int | None = None, replica_budgets=None):
        """Run one decode round with verify budget K = ``budget`` (default: R·G).

        With data replicas, K is each replica's bucket and ``replica_budgets [D]`` (default
        K each) each replica's own budget: ``topk`` admits each replica's own top-k_d."""
        self._require_table()
        return self._run_round(state, self._check_budget(budget), replica_budgets)

    def _run_round(self, state, k: int, replica_budgets=None):
        with self.mesh_context():
            if self.replicas == 1:
                return self._round(self._params, state, k)
            return self._round(self._params, state, k, self._limits(k, replica_budgets))

    def plain_round(self, state: DecodeState):
        """Run one *plain* round: the target verifies each active slot's anchor alone and
        the drafter is not called (without a drafter: the K = 0 round). The drafter's
        context is still written for the committed token (``commit_step``), so the next
        drafting round drafts as if no round had been plain. Returns ``(state, output)``
        like ``round``; the output's survivals are 0 (nothing was drafted)."""
        if self.drafter is None:
            return self._run_round(state, 0)
        with self.mesh_context():
            return self._plain(self._params, state)

    def plan(
        self, state: DecodeState, budget: int | None = None, replica_budgets=None
    ) -> tuple[DecodeState, Plan]:
        """Draft and schedule; returns ``(state, plan)``. ``budget`` (and, with data
        replicas, ``replica_budgets``) only matter for ``topk``. The state is donated,
        like a round's: only the DSpark/DFlash drafter context changes (the draft's block
        K/V, written past every slot's context), so commit the plan against the returned
        state."""
        self._require_table()
        return self._run_plan(state, budget, replica_budgets)

    def _run_plan(self, state, budget=None, replica_budgets=None):
        k = self._check_budget(budget) if self.config.scheduler == "topk" else self.full_budget
        with self.mesh_context():
            if self.replicas == 1:
                return self._plan(self._params, state, k)
            return self._plan(self._params, state, k, self._limits(k, replica_budgets))

    def commit(self, state: DecodeState, plan: Plan, budget: int):
        """Verify ``plan``'s drafts in a buffer of R + ``budget`` rows and commit.

        ``budget`` should be ``>= plan.lengths.sum()``; a smaller one trims the plan
        (``decode.commit_step.cap_total``), which is exact but wastes drafts.
        """
        with self.mesh_context():
            return self._commit(self._params, state, plan, self._check_budget(budget))

    def _plan_impl(
        self, params, state: DecodeState, budget: int, limit=None
    ) -> tuple[DecodeState, Plan]:
        return plan_step(self, params, state, budget, limit)

    def _plain_impl(self, params, state: DecodeState):
        state, plan = plan_step(self, params, state, 0, drafting=False)
        return self._commit_impl(params, state, plan, 0)

    def _round_impl(self, params, state: DecodeState, budget: int, limit=None):
        state, plan = self._plan_impl(params, state, budget, limit)
        return self._commit_impl(params, state, plan, budget)

    def _logprobs(self, logits: Array, tokens: Array, rows: Array | None = None):
        """Target log-probabilities for logits ``[P, V]``: of ``tokens`` (``[...]``, each
        scored by logits row ``rows[...]``, default row i for token i; PAD entries give
        values the caller never reads) and the ``top_logprobs`` largest entries of those
        rows. A log-sum-exp and a top-N per row: nothing ``V`` wide is gathered."""
        return target_logprobs(logits, tokens, rows, self.config.top_logprobs)

    def _position_keys(self, state: DecodeState) -> Array:
        """Coupled draws' keys ``[R, γ+1]``: key ``j`` of slot ``r`` is that of sequence
        position ``seq_len[r] + 1 + j`` (draft ``j``; ``j = γ`` the bonus position)."""
        return slot_position_keys(self, state)

    def _draft(self, params, state, key):
        return draft(self, params, state, key)

    def _schedule(self, survival, active, budget, sps_table, limit=None):
        """Per-slot prefix lengths ``[R]`` for the configured arm (DESIGN §5.3).

        Must depend on the survival probabilities only through rules that never let a token
        decide its own admission (DESIGN §5.4); tests override it to show a broken rule is
        detected.
        """
        return schedule(self, survival, active, budget, sps_table, limit)

    def _commit_impl(self, params, state: DecodeState, plan: Plan, budget: int):
        return commit_step(self, params, state, plan, budget)


__all__ = [
    "DecodeState",
    "RoundOutput",
    "PrefillOutput",
    "StepConfig",
    "SpeculativeDecoder",
    "FINISH_NAMES",
    "SCHEDULER_MODES",
    "Plan",
]
