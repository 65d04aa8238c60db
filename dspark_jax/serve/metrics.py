"""Prometheus metrics of the serving engine (``GET /metrics``, DESIGN §6).

Each server gets its own ``CollectorRegistry`` so several servers (tests) can live in one
process. Counters and histograms are fed by the engine thread through the listener hooks
``on_round`` / ``on_finish``; gauges (queue depth, busy slots, compilations after warm-up)
are read from the engine when scraped.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from dspark_jax.sched.plain_rounds import ROUND_KINDS

_ROUND_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class EngineMetrics:
    """Listener for ``Engine`` plus HTTP-level counters."""

    def __init__(self, engine=None):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "dspark_requests", "Finished requests by finish reason", ["finish_reason"], registry=r
        )
        self.rejected = Counter(
            "dspark_requests_rejected",
            "Requests rejected before admission (invalid, queue_full, shutting_down)",
            ["reason"],
            registry=r,
        )
        self.prompt_tokens = Counter("dspark_prompt_tokens", "Prompt tokens", registry=r)
        self.completion_tokens = Counter("dspark_completion_tokens", "Generated tokens", registry=r)
        self.rounds = Counter("dspark_rounds", "Decode rounds run", registry=r)
        self.round_seconds = Histogram(
            "dspark_round_seconds", "Wall time per decode round", buckets=_ROUND_BUCKETS, registry=r
        )
        self.tau = Histogram(
            "dspark_accepted_length",
            "Tokens emitted per slot per round (tau, bonus token included)",
            buckets=tuple(range(1, 17)),
            registry=r,
        )
        self.budget = Histogram(
            "dspark_verify_budget",
            "Compiled verify budget K (draft tokens) per round",
            buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
            registry=r,
        )
        self.verified = Histogram(
            "dspark_verified_drafts",
            "Draft tokens actually sent to the target per round",
            buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
            registry=r,
        )
        self.last_tau = Gauge("dspark_tau", "Mean tau of the last round", registry=r)
        self.queue_depth = Gauge("dspark_queue_depth", "Requests waiting for a slot", registry=r)
        self.active_slots = Gauge("dspark_active_slots", "Slots owned by a request", registry=r)
        self.compilations = Gauge(
            "dspark_compilations_after_warmup",
            "Executables compiled after warm-up (should stay 0)",
            registry=r,
        )
        self.replica_padding = Gauge(
            "dspark_replica_padding_rows",
            "Verify rows run since start beyond each data replica's own budget (a replica "
            "runs the round's common bucket, the largest replica's; 0 with one replica)",
            registry=r,
        )
        self.lockstep = Gauge(
            "dspark_lockstep",
            "Several processes (engine/lockstep.py), the leader's exchange since start: turns "
            "published, their bytes, the largest turn's bytes, seconds spent publishing "
            "(0 on one process)",
            ["quantity"],
            registry=r,
        )
        self.engine_up = Gauge("dspark_engine_up", "1 while the engine loop runs", registry=r)
        self.engine_seconds = Gauge(
            "dspark_engine_seconds",
            "Engine thread time since start by phase: dispatch (to the device), device_wait "
            "(for a round's output), host (processing outputs), idle",
            ["phase"],
            registry=r,
        )
        self.host_share = Gauge(
            "dspark_host_share",
            "Share of the engine thread's busy time spent on the host, not waiting on the device",
            registry=r,
        )
        self.kv_pages = Gauge(
            "dspark_kv_pages",
            "KV cache pages in the pool (null page excluded), by state: used, free",
            ["state"],
            registry=r,
        )
        self.waiting_for_pages = Gauge(
            "dspark_requests_waiting_for_pages",
            "Queued requests held back because the KV page pool is full (0 when the next "
            "request only waits for a slot)",
            registry=r,
        )
        self.page_waits = Gauge(
            "dspark_page_waits",
            "Admission passes in which the next request had a free slot but not enough pages",
            registry=r,
        )
        self.attention = Gauge(
            "dspark_attention_backend",
            "The verify attention backend in use (value 1)",
            ["backend"],
            registry=r,
        )
        self.survival_estimator = Gauge(
            "dspark_survival_estimator",
            "Where the schedulers' draft survivals come from (value 1): confidence_head, "
            "draft_probability, or none without a drafter",
            ["estimator"],
            registry=r,
        )
        self.round_kinds = Gauge(
            "dspark_rounds_by_kind",
            "Decode rounds since start by kind: draft, plain (the target alone, draft-aware "
            "rounds), probe (a drafting round that refreshes survivals after plain ones)",
            ["kind"],
            registry=r,
        )
        self.mesh = Gauge(
            "dspark_mesh_devices",
            "Devices the engine decodes on (data replicas x tensor split)",
            ["data", "tensor", "platform"],
            registry=r,
        )
        if engine is not None:
            self.attach(engine)

    def attach(self, engine) -> None:
        self.queue_depth.set_function(lambda: engine.queue_depth)
        self.active_slots.set_function(lambda: engine.active_slots)
        self.compilations.set_function(lambda: engine.compilations_after_warmup)
        self.engine_up.set_function(lambda: 1.0 if engine.running else 0.0)
        for phase in ("dispatch", "device_wait", "host", "idle"):
            self.engine_seconds.labels(phase).set_function(
                lambda p=phase: getattr(engine.stats, f"{p}_seconds")
            )
        self.host_share.set_function(lambda: engine.stats.host_share)
        self.kv_pages.labels("used").set_function(lambda: engine.pages.used)
        self.kv_pages.labels("free").set_function(lambda: engine.pages.free)
        self.waiting_for_pages.set_function(
            lambda: engine.queue_depth if engine.waiting_for_pages else 0
        )
        self.page_waits.set_function(lambda: engine.stats.page_waits)
        self.replica_padding.set_function(lambda: engine.stats.padding_rows)
        ex = getattr(engine, "exchange", None)
        for q, attr in (("turns", "turns_sent"), ("bytes", "bytes_sent"),
                        ("largest_turn_bytes", "largest_turn"), ("seconds", "send_seconds")):  # fmt: skip
            self.lockstep.labels(q).set_function(
                lambda a=attr: 0.0 if ex is None else float(getattr(ex, a))
            )
        self.attention.labels(engine.attention_backend).set(1)
        self.survival_estimator.labels(engine.survival_estimator).set(1)
        for kind in ROUND_KINDS:
            self.round_kinds.labels(kind).set_function(
                lambda k=kind: float(engine.policy.kind_counts.get(k, 0))
            )
        m = engine.mesh
        self.mesh.labels(str(m["data"]), str(m["tensor"]), m["platform"]).set(m["devices"])

    # -- engine listener hooks (engine thread) ---------------------------------------------
    def on_round(self, seconds: float, budget: int, taus, verified: int) -> None:
        self.rounds.inc()
        self.round_seconds.observe(seconds)
        self.budget.observe(budget)
        self.verified.observe(verified)
        for t in taus:
            self.tau.observe(t)
        if taus:
            self.last_tau.set(sum(taus) / len(taus))

    def on_finish(self, result) -> None:
        self.requests.labels(result.finish_reason).inc()
        self.prompt_tokens.inc(result.prompt_tokens)
        self.completion_tokens.inc(result.completion_tokens)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


__all__ = ["EngineMetrics"]
