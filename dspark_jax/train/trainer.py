"""The training loop: task-agnostic, sharded, checkpointed, resumable (DESIGN §4).

A :class:`Task` supplies everything model-specific: the trainable parameters (``init_params``,
boxed with logical axis names), any frozen parameters (``frozen_params``; a drafter task
returns the target here), the loss ``(params, frozen, batch, rng) -> (loss, metrics)``, the
held-out metrics, and its data iterators. The loop owns the rest: mesh, shardings, the
jitted step, AdamW, Orbax checkpoints, metrics and progress.

Step ``k`` (1-based) consumes the ``k``-th batch and leaves ``state.step == k``; a checkpoint
at step ``k`` holds the state *and* the data-iterator position after ``k`` batches, and
the per-step RNG is ``fold_in(state.rng, step)``, so a resumed run replays exactly the
losses of an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import sys
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from dspark_jax import sharding as shd
from dspark_jax.config import CHOICES, VALIDATORS, ConfigDict, ConfigError
from dspark_jax.models.qwen3 import Qwen3Config
from dspark_jax.train import distributed as dist
from dspark_jax.train.checkpoint import Checkpointer
from dspark_jax.train.optimizer import make_optimizer
from dspark_jax.train.state import TrainState, state_shardings, with_shardings

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.json"
MODEL_CONFIG_FILE = "model_config.json"
CHECKPOINT_DIR = "checkpoints"

# Task name -> "module:Class". Drafter tasks register here (``register_task``).
TASKS: dict[str, str] = {
    "lm": "dspark_jax.train.lm_task:LMTask",
    "drafter": "dspark_jax.train.drafter_task:DrafterTask",
}


def register_task(name: str, target: str) -> None:
    """Make ``task = name`` load ``target`` (``"package.module:Class"``)."""
    TASKS[name] = target
    CHOICES["task"] = sorted(TASKS)


# ----------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------
def _positive(name):
    def check(v):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")

    return check


def _non_negative(name):
    def check(v):
        if v < 0:
            raise ValueError(f"{name} must be >= 0, got {v!r}")

    return check


CHOICES["task"] = sorted(TASKS)
CHOICES["train.compute_dtype"] = ["float32", "bfloat16"]
for _key in ("data.batch_size", "train.steps", "train.log_every", "train.keep_checkpoints",
             "train.eval_batches"):  # fmt: skip
    VALIDATORS[_key] = _positive(_key)
for _key in ("train.lr", "train.weight_decay", "train.clip_norm", "train.eval_every",
             "train.checkpoint_every"):  # fmt: skip
    VALIDATORS[_key] = _non_negative(_key)


def _seq_len_check(v):
    if not isinstance(v, int) or v < 2:
        raise ValueError(f"data.seq_len must be an integer >= 2, got {v!r}")


VALIDATORS["data.seq_len"] = _seq_len_check


def default_config() -> ConfigDict:
    """Every key ``train.py`` understands, with DESIGN §4 defaults; configs fill it in."""
    cfg = ml_collections.ConfigDict()
    cfg.task = "lm"
    # model: a preset plus any Qwen3Config field (None = keep the preset's value;
    # vocab_size None = the tokenizer's size). Precision is train.compute_dtype.
    cfg.model = ml_collections.ConfigDict({"preset": "tiny"})
    for name in Qwen3Config.field_names():
        if name not in ("dtype", "param_dtype"):
            cfg.model[name] = None
    cfg.mesh = ml_collections.ConfigDict({"data": -1, "fsdp": 1, "tensor": 1})
    cfg.data = ml_collections.ConfigDict(
        {
            "data_dir": "",
            "tokenizer": "",
            "seq_len": 256,
            "batch_size": 8,  # global, in sequences
            "seed": 0,
            "shuffle": True,
            # Logical data shards (0 = one per process). Fix it (e.g. 8) to keep the data
            # order independent of the number of hosts: see train/distributed.py.
            "num_shards": 0,
        }
    )
    cfg.train = ml_collections.ConfigDict(
        {
            "steps": 1000,
            "lr": 6e-4,  # DeepSpec
            "warmup_frac": 0.04,  # 4 % linear warm-up, then cosine
            "min_lr_ratio": 0.0,  # cosine floor as a fraction of lr
            "weight_decay": 0.0,
            "clip_norm": 1.0,
            "b1": 0.9,
            "b2": 0.95,
            "eps": 1e-8,
            "compute_dtype": "float32",  # "bfloat16" on accelerators; params stay fp32
            "seed": 0,
            "log_every": 10,
            "eval_every": 200,  # 0 = only at the end
            "eval_batches": 8,
            "checkpoint_every": 200,  # 0 = only at the end
            "keep_checkpoints": 3,
            "async_checkpointing": True,
            # A trained model's directory whose weights replace the initial parameters of
            # a fresh run: continued training / fine-tuning with a new schedule and fresh
            # optimizer moments. Ignored on resume (the checkpoint holds the trained
            # weights). lm: a Hugging Face Qwen3 directory (e.g. an exported target);
            # drafter: a drafter directory of the same kind.
            "init_from": "",
        }
    )
    return cfg


# ----------------------------------------------------------------------------------------
# Tasks
# ----------------------------------------------------------------------------------------
class Task:
    """What a training task provides to the loop. Subclasses override the methods below.

    ``init_params`` and ``loss_fn``/``eval_sums`` must be pure JAX functions: they are
    traced under ``jax.eval_shape``/``jax.jit`` with the mesh and logical rules active.
    """

    name = "task"

    def __init__(self, cfg: ConfigDict):
        self.cfg = cfg

    def check(self) -> None:
        """Validate config against data/tokenizer before anything is compiled."""

    def model_config(self) -> Qwen3Config:
        """The config of the model whose parameters are trained (saved in the workdir)."""
        raise NotImplementedError

    def init_params(self, rng: jax.Array) -> Any:
        """Trainable parameters, boxed with ``nn.Partitioned`` logical names."""
        raise NotImplementedError

    def warm_start_params(self, directory: str) -> Any:
        """Trainable parameters read from ``directory`` (``train.init_from``) as a tree of
        host arrays; the loop checks every shape against this task's model and places
        them."""
        raise ConfigError(f"train.init_from is not supported by the {self.name!r} task")

    def frozen_params(self, mesh) -> tuple[Any, Any]:
        """``(params, shardings)`` of frozen inputs to the loss, already on ``mesh``."""
        return {}, {}

    def loss_fn(self, params, frozen, batch, rng) -> tuple[jax.Array, dict[str, jax.Array]]:
        raise NotImplementedError

    def eval_sums(self, params, frozen, batch) -> dict[str, jax.Array]:
        """Per-batch sums; the loop adds them over the eval batches."""
        raise NotImplementedError

    def summarize_eval(self, sums: dict[str, float]) -> dict[str, float]:
        raise NotImplementedError

    def train_iterator(self, batch_size: int, shard_index: int, shard_count: int):
        """Endless, checkpointable (grain) iterator of host batches (dicts of numpy)."""
        raise NotImplementedError

    def eval_batches(self, batch_size: int, num_batches: int, shard_index: int, shard_count: int):
        raise NotImplementedError

    def checkpoint_meta(self) -> dict[str, Any]:
        return {"task": self.name, "model_config": dataclasses.asdict(self.model_config())}

    def check_resume(self, meta: dict[str, Any]) -> None:
        """Raise if the checkpoint (its ``checkpoint_meta``) was made against other frozen
        inputs than this run has (after ``frozen_params``)."""


def fixed_eval_batches(batches, num_batches: int, empty_message: str) -> list[dict]:
    """The first ``num_batches`` of ``batches`` (one unshuffled held-out pass, so every
    evaluation sees the same tokens), padded with fully masked copies of the last one so
    that every host runs the same number of eval steps."""
    out = []
    for batch in batches:
        out.append(batch)
        if len(out) >= num_batches:
            break
    if not out:
        raise ValueError(empty_message)
    while len(out) < num_batches:
        out.append({k: (v * 0 if k == "loss_mask" else v) for k, v in out[-1].items()})
    return out


def make_task(cfg: ConfigDict) -> Task:
    if cfg.task not in TASKS:
        raise ConfigError(f"Unknown task {cfg.task!r}; allowed tasks: {sorted(TASKS)}")
    module, _, cls = TASKS[cfg.task].partition(":")
    return getattr(importlib.import_module(module), cls)(cfg)


# ----------------------------------------------------------------------------------------
# State construction (shared by training and export)
# ----------------------------------------------------------------------------------------
@dataclasses.dataclass
class StateSpec:
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    abstract: TrainState  # ShapeDtypeStructs with shardings (an Orbax restore target)
    shardings: TrainState
    init: Any  # jitted rng -> sharded TrainState


def build_state_spec(task: Task, cfg: ConfigDict, mesh) -> StateSpec:
    tx, schedule = make_optimizer(cfg.train)

    def init_state(key):
        params = nn.unbox(task.init_params(jax.random.fold_in(key, 0)))
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=tx.init(params),
            rng=jax.random.fold_in(key, 1),
        )

    # Abstract: nothing concrete is created here, so the spec can be built on a mesh of
    # devices this host does not have (AOT for a TPU topology).
    key = jax.eval_shape(lambda: jax.random.PRNGKey(cfg.train.seed))
    abstract_boxed = jax.eval_shape(task.init_params, key)
    abstract = jax.eval_shape(init_state, key)
    shardings = state_shardings(abstract_boxed, abstract, tx, mesh)
    init = jax.jit(init_state, out_shardings=shardings)
    return StateSpec(tx, schedule, with_shardings(abstract, shardings), shardings, init)


def make_train_step(task: Task, tx: optax.GradientTransformation, schedule: optax.Schedule):
    """The un-jitted training step ``(state, frozen, batch) -> (state, metrics)``; shared by
    the loop and the ahead-of-time compiler (``dspark_jax/aot/``)."""

    def train_step(state: TrainState, frozen, batch):
        rng = jax.random.fold_in(state.rng, state.step)
        grad_fn = jax.value_and_grad(task.loss_fn, has_aux=True)
        (loss, metrics), grads = grad_fn(state.params, frozen, batch, rng)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads),
                       lr=schedule(state.step))  # fmt: skip
        new = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        return new, metrics

    return train_step


def _place(batch, mesh):
    if jax.process_count() == 1:
        return shd.place_batch(batch, mesh)
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(shd.batch_sharding(mesh, x.ndim), x),
        batch,
    )


def _check_warm_start(params, abstract_params, directory: str) -> None:
    """Raise ``ValueError`` naming the first parameter of this run's model that the
    weights from ``directory`` lack or hold in another shape (``train.init_from``)."""
    from dspark_jax.train.checkpoint import first_shape_mismatch, flat_shapes

    have, want = flat_shapes(params), flat_shapes(abstract_params)
    found = first_shape_mismatch(have, want)
    if found is None:
        return
    problem, key = found
    if problem == "missing":
        raise ValueError(f"train.init_from: {directory} has no parameter '{key}'")
    if problem == "shape":
        raise ValueError(
            f"train.init_from: parameter '{key}' has shape {have[key]} in {directory} but "
            f"{want[key]} in this run's model"
        )
    raise ValueError(f"train.init_from: {directory} has parameter '{key}' this run's model lacks")


def check_mesh_and_batch(cfg: ConfigDict, mesh) -> None:
    dp = mesh.shape["data"] * mesh.shape["fsdp"]
    bs = cfg.data.batch_size
    if bs % dp:
        raise ValueError(
            f"data.batch_size = {bs} is not divisible by the data-parallel degree "
            f"data x fsdp = {mesh.shape['data']} x {mesh.shape['fsdp']} = {dp}"
        )
    if bs % jax.process_count():
        raise ValueError(
            f"data.batch_size = {bs} is not divisible by the number of hosts {jax.process_count()}"
        )


# ----------------------------------------------------------------------------------------
# Metrics file
# ----------------------------------------------------------------------------------------
def read_metrics(workdir: str) -> list[dict[str, Any]]:
    """All complete JSON lines of ``metrics.jsonl`` (a torn last line is skipped)."""
    path = os.path.join(workdir, METRICS_FILE)
    out = []
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def _truncate_metrics(workdir: str, last_step: int) -> None:
    """Drop entries after ``last_step``: work a killed run did past its last checkpoint,
    which the resumed run redoes (and logs again)."""
    path = os.path.join(workdir, METRICS_FILE)
    if not os.path.exists(path):
        return
    kept = [m for m in read_metrics(workdir) if m.get("step", 0) <= last_step]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for m in kept:
            f.write(json.dumps(m) + "\n")
    os.replace(tmp, path)


def _to_float(x) -> float:
    return float(np.asarray(x))


# ----------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------
def train(
    cfg: ConfigDict,
    workdir: str,
    *,
    devices=None,
    progress: bool = True,
) -> dict[str, Any]:
    """Train (or resume) in ``workdir``; returns a summary dict."""
    from tqdm.auto import tqdm

    workdir = os.path.abspath(workdir)
    tc = cfg.train
    task = make_task(cfg)
    task.check()
    model_config = task.model_config()
    mesh = shd.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, devices=devices)
    check_mesh_and_batch(cfg, mesh)
    os.makedirs(workdir, exist_ok=True)
    is_main = jax.process_index() == 0

    with jax.set_mesh(mesh), shd.rules_context(mesh):
        spec = build_state_spec(task, cfg, mesh)
        frozen, frozen_sh = task.frozen_params(mesh)
        local_bs = cfg.data.batch_size // jax.process_count()
        num_shards = cfg.data.get("num_shards", 0)
        data_it = dist.host_iterator(task, local_bs, num_shards)

        ckpt = Checkpointer(
            os.path.join(workdir, CHECKPOINT_DIR), tc.keep_checkpoints, tc.async_checkpointing
        )
        start = ckpt.latest_step()
        if start is not None:
            ckpt.check_compatible(start, spec.abstract.to_dict())
            task.check_resume(ckpt.meta(start))
            state = TrainState.from_dict(ckpt.restore(start, spec.abstract.to_dict()))
            # Data position from every host's file: resuming on another host count works.
            dist.restore_host_iterator(ckpt.directory, start, data_it)
            resumed = True
            if is_main:
                print(
                    f"resumed from step {start} of {tc.steps} (checkpoint in {ckpt.directory})",
                    file=sys.stderr,
                    flush=True,
                )
        else:
            start, resumed = 0, False
            state = spec.init(jax.random.PRNGKey(tc.seed))
            if tc.get("init_from"):
                # Only the weights: AdamW's moments start at zero either way.
                params = task.warm_start_params(tc.init_from)
                _check_warm_start(params, spec.abstract.params, tc.init_from)
                state = state.replace(params=shd.place_host_tree(params, spec.shardings.params))
                if is_main:
                    print(f"initial weights from {tc.init_from}", file=sys.stderr, flush=True)
        if is_main:
            _truncate_metrics(workdir, start)
            with open(os.path.join(workdir, CONFIG_FILE), "w") as f:
                f.write(cfg.to_json_best_effort(indent=2))
            with open(os.path.join(workdir, MODEL_CONFIG_FILE), "w") as f:
                f.write(model_config.to_json())
        meta = task.checkpoint_meta()

        eval_host = dist.host_eval_batches(task, local_bs, tc.eval_batches, num_shards)
        eval_dev = [_place(b, mesh) for b in eval_host]

        train_step = make_train_step(task, spec.tx, spec.schedule)

        rep = shd.replicated(mesh)
        step_fn = None
        eval_fn = jax.jit(
            lambda p, fz, b: task.eval_sums(p, fz, b),
            in_shardings=(spec.shardings.params, frozen_sh, None),
            out_shardings=rep,
        )

        def run_eval(step: int) -> dict[str, Any]:
            totals: dict[str, float] = {}
            for b in eval_dev:
                sums = eval_fn(state.params, frozen, b)
                for k, v in sums.items():
                    totals[k] = totals.get(k, 0.0) + _to_float(v)
            return {"step": step, "kind": "eval", **task.summarize_eval(totals)}

        metrics_f = open(os.path.join(workdir, METRICS_FILE), "a") if is_main else None

        def log(entry: dict[str, Any]) -> None:
            if metrics_f is not None:
                metrics_f.write(json.dumps(entry) + "\n")
                metrics_f.flush()

        steps = tc.steps
        tokens_per_step = None
        summary: dict[str, Any] = {"start_step": start, "resumed": resumed}
        bar = tqdm(
            total=steps,
            initial=start,
            disable=not (progress and is_main),
            desc=f"train[{task.name}]",
            mininterval=1.0 if sys.stderr.isatty() else 30.0,
            dynamic_ncols=True,
        )
        pending: list[dict[str, jax.Array]] = []
        window_t0, window_steps, timed_tokens, timed_s = time.perf_counter(), 0, 0, 0.0
        last_train: dict[str, Any] = {}
        last_eval: dict[str, Any] = {}
        step = start
        try:
            for step in range(start + 1, steps + 1):
                try:
                    host_batch = next(data_it)
                except StopIteration:
                    raise ValueError(
                        f"empty corpus: the training data iterator of {cfg.data.data_dir} "
                        f"yielded no batch at step {step}"
                    ) from None
                batch = _place(host_batch, mesh)
                if step_fn is None:
                    tokens_per_step = int(np.prod(host_batch["tokens"].shape)) * jax.process_count()
                    batch_sh = jax.tree.map(lambda x: x.sharding, batch)
                    step_fn = jax.jit(
                        train_step,
                        in_shardings=(spec.shardings, frozen_sh, batch_sh),
                        out_shardings=(spec.shardings, rep),
                        donate_argnums=(0,),
                    )
                state, metrics = step_fn(state, frozen, batch)
                pending.append(metrics)
                window_steps += 1
                if step == start + 1:
                    # Keep compilation out of the throughput figure.
                    jax.block_until_ready(metrics)
                    window_t0, window_steps = time.perf_counter(), 0

                if step % tc.log_every == 0 or step == steps:
                    fetched = jax.device_get(pending)
                    dt = time.perf_counter() - window_t0
                    first = step - len(fetched) + 1
                    for i, m in enumerate(fetched):
                        entry = {"step": first + i, "kind": "train"}
                        entry.update({k: _to_float(v) for k, v in m.items()})
                        if i == len(fetched) - 1 and window_steps and dt > 0:
                            entry["tokens_per_s"] = window_steps * tokens_per_step / dt
                        log(entry)
                    last_train = entry
                    if window_steps and dt > 0:
                        timed_tokens += window_steps * tokens_per_step
                        timed_s += dt
                    pending = []
                    bar.set_postfix(
                        loss=f"{last_train['loss']:.4f}",
                        tok_s=f"{last_train.get('tokens_per_s', 0):.0f}",
                        refresh=False,
                    )
                    window_t0, window_steps = time.perf_counter(), 0
                bar.update(1)

                if (tc.eval_every and step % tc.eval_every == 0) or step == steps:
                    t_eval = time.perf_counter()
                    last_eval = run_eval(step)
                    log(last_eval)
                    ppl = last_eval.get("heldout_perplexity")  # LM only; drafters log accept
                    bar.write(
                        f"step {step}: heldout loss {last_eval['heldout_loss']:.4f}"
                        + (f" ppl {ppl:.2f}" if ppl is not None else "")
                    )
                    window_t0 += time.perf_counter() - t_eval  # eval is not training time

                if (tc.checkpoint_every and step % tc.checkpoint_every == 0) or step == steps:
                    ckpt.save(step, state.to_dict(), data_it, meta)
        finally:
            bar.close()
            ckpt.close()
            if metrics_f is not None:
                metrics_f.close()

        summary.update(
            step=step,
            final_loss=last_train.get("loss"),
            tokens_per_s=(timed_tokens / timed_s) if timed_s else None,
            **{k: v for k, v in last_eval.items() if k.startswith("heldout")},
        )
        if start >= steps:
            summary["note"] = f"already trained to step {start} >= train.steps = {steps}"
        return summary
