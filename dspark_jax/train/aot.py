"""Ahead-of-time compilation of the full-size training step / serving round (DESIGN §4).

Nothing is allocated: parameters, optimizer state, frozen target and batch are
``jax.ShapeDtypeStruct`` carrying their ``NamedSharding``; ``jax.jit(...).lower(...)
.compile()`` builds the SPMD executable for the mesh and ``compiled.memory_analysis()``
gives the *per-device* sizes XLA planned:

* ``argument``: every input shard (trainable params + optimizer state + frozen params +
  batch), ``output``: the outputs, ``alias``: outputs written in place of donated inputs
  (the training state is donated, so it is not counted twice), ``temp``: activations,
  gradients and other scratch live during the step;
* ``peak ≈ argument + output − alias + temp`` (+ generated code): what must fit in HBM.

Two compilers:

* **XLA:TPU for a named topology** (``--aot-topology v5p:2x2x1``): with ``libtpu`` installed
  (``pip install -e '.[tpu]'``, the version ``jax[tpu]`` pins), ``topology_devices(name)``
  gives the devices of a TPU slice this host does not have, through
  ``jax.experimental.topologies``; the mesh is built on them and XLA:TPU compiles and plans
  memory exactly as on the pod. Nothing concrete may be created on such a mesh, so the code
  paths here build abstract values only (``ShapeDtypeStruct``, ``jax.eval_shape``).
* **XLA:CPU with fake devices** (the fallback): ``configure_devices(N)``
  (``--aot-devices N``) makes the CPU backend expose N devices before JAX starts, so a
  64-chip mesh compiles on a laptop. The CPU compiler's fusion/scheduling differs from
  TPU/GPU, so ``temp`` is an estimate (typically within tens of percent);
  parameter/optimizer/argument bytes are exact since they follow the shardings.

Every report says which compiler produced it (``compiler``, ``topology``).
"""

from __future__ import annotations

import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from dspark_jax import sharding as shd
from dspark_jax.ops.flash_attention import compile_platform

GB = 1e9  # device memory is quoted in decimal GB (95 GB v5p, 141 GB H200)


# ----------------------------------------------------------------------------------------
# Fake devices and meshes
# ----------------------------------------------------------------------------------------
def configure_devices(num_devices: int | None) -> None:
    """Use ``num_devices`` fake CPU devices (must run before JAX creates its backends)."""
    if num_devices is None:
        return
    if num_devices < 1:
        raise ValueError(f"--aot-devices must be >= 1, got {num_devices}")
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        have = jax.device_count()
        if jax.default_backend() == "cpu" and have == num_devices:
            return
        raise ValueError(
            f"--aot-devices {num_devices}: JAX is already running with {have} "
            f"{jax.default_backend()} device(s); set the device count before any JAX computation"
        )
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", int(num_devices))


# Chip families libtpu compiles for, and an example topology name of each.
TPU_TOPOLOGY_EXAMPLES = ("v5e:2x2", "v5p:2x2x1", "v5p:4x4x4", "v6e:2x2")


def libtpu_version() -> str | None:
    """The installed libtpu's version, or None when it is not installed."""
    from importlib import metadata

    try:
        return metadata.version("libtpu")
    except metadata.PackageNotFoundError:
        return None


def topology_devices(name: str) -> list:
    """The devices of TPU topology ``name`` (e.g. ``v5p:2x2x1``), for compiling on a host
    without TPUs. Raises a user error naming what is missing or wrong."""
    if libtpu_version() is None:
        raise ValueError(
            f"--aot-topology {name} needs libtpu, the TPU compiler: pip install -e '.[tpu]' "
            "(the version jax[tpu] pins for this jax); without it use --aot-devices N "
            "(fake CPU devices, an estimate)"
        )
    from jax.experimental import topologies

    if ":" not in name:
        raise ValueError(
            f"--aot-topology {name!r}: expected CHIP:SHAPE such as "
            f"{', '.join(TPU_TOPOLOGY_EXAMPLES)}"
        )
    try:
        topo = topologies.get_topology_desc(platform="tpu", topology_name=name)
    except Exception as e:  # libtpu's own message names the bad chip or shape
        if "lockfile" in str(e):
            raise ValueError(
                f"--aot-topology {name!r}: another process holds libtpu's lock "
                "(/tmp/libtpu_lockfile), e.g. a second AOT compile on this host. Wait for it, "
                "or set ALLOW_MULTIPLE_LIBTPU_LOAD=1 when no process is using real TPU chips"
            ) from None
        raise ValueError(
            f"--aot-topology {name!r} is not a TPU topology libtpu knows "
            f"(e.g. {', '.join(TPU_TOPOLOGY_EXAMPLES)}): {e}"
        ) from None
    return list(topo.devices)


def compiler_info(mesh) -> dict[str, Any]:
    """Which compiler a mesh's executables come from (recorded in every report)."""
    dev = mesh.devices.flat[0]
    platform = getattr(dev, "platform", "cpu")
    info: dict[str, Any] = {"compiler": f"XLA:{platform.upper()}", "jax": jax.__version__}
    if platform == "tpu":
        info["libtpu"] = libtpu_version()
        info["device_kind"] = getattr(dev, "device_kind", None)
    else:
        info["note"] = "fake CPU devices: temp memory is the CPU compiler's plan (an estimate)"
    return info


def parse_mesh(text: str | None, mesh_cfg=None) -> tuple[int, int, int]:
    """``"data,fsdp,tensor"`` (one may be -1) or the config's ``mesh`` section."""
    if text is None:
        if mesh_cfg is None:
            return (-1, 1, 1)
        return (mesh_cfg.data, mesh_cfg.fsdp, mesh_cfg.tensor)
    parts = text.split(",")
    try:
        sizes = tuple(int(p) for p in parts)
    except ValueError:
        sizes = ()
    if len(sizes) != 3:
        raise ValueError(f"--aot-mesh must be three integers data,fsdp,tensor; got {text!r}")
    return sizes


# ----------------------------------------------------------------------------------------
# Byte accounting
# ----------------------------------------------------------------------------------------
def per_device_bytes(tree: Any) -> int:
    """Bytes one device holds of a tree of sharded arrays / ``ShapeDtypeStruct``s (the
    largest shard, i.e. what the most loaded device stores)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = tuple(leaf.shape)
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None:
            shape = sharding.shard_shape(shape)
        total += math.prod(shape) * _itemsize(leaf.dtype)
    return int(total)


def _itemsize(dtype) -> int:
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):  # typed PRNG keys: 2 x uint32
        return 8
    return np.dtype(dtype).itemsize


def global_bytes(tree: Any) -> int:
    return int(sum(math.prod(x.shape) * _itemsize(x.dtype) for x in jax.tree.leaves(tree)))


def _count(tree: Any) -> int:
    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(tree)))


def memory_fields(compiled) -> dict[str, int]:
    """Per-device sizes from ``compiled.memory_analysis()`` and the peak estimate."""
    m = compiled.memory_analysis()
    if m is None:
        raise ValueError("this backend's compiler reports no memory analysis")
    out = {
        "argument_bytes": int(m.argument_size_in_bytes),
        "output_bytes": int(m.output_size_in_bytes),
        "alias_bytes": int(m.alias_size_in_bytes),
        "temp_bytes": int(m.temp_size_in_bytes),
        "code_bytes": int(m.generated_code_size_in_bytes),
    }
    out["peak_bytes"] = (
        out["argument_bytes"]
        + out["output_bytes"]
        - out["alias_bytes"]
        + out["temp_bytes"]
        + out["code_bytes"]
    )
    return out


def _with_fit(report: dict[str, Any], device_memory_gb: float | None) -> dict[str, Any]:
    if device_memory_gb:
        report["device_memory_gb"] = float(device_memory_gb)
        report["fits"] = bool(report["memory"]["peak_bytes"] <= device_memory_gb * GB)
    return report


def _abstract(boxed_tree, mesh):
    """Unboxed ``ShapeDtypeStruct``s with the rules-table shardings of a boxed abstract tree."""
    sh = shd.param_shardings(boxed_tree, mesh)
    plain = shd.unboxed(boxed_tree)  # not nn.unbox: see shd.unboxed
    return (
        jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), plain, sh),
        sh,
    )


# ----------------------------------------------------------------------------------------
# What a task must provide for AOT (abstract frozen params and batch shapes)
# ----------------------------------------------------------------------------------------
def abstract_frozen(task, mesh) -> tuple[Any, Any]:
    """``(ShapeDtypeStruct tree with shardings, shardings)`` of the task's frozen inputs.

    Tasks with frozen parameters implement ``abstract_frozen_params(mesh)`` (the drafter
    task: the target, sharded by the rules table); the LM task has none.
    """
    if hasattr(task, "abstract_frozen_params"):
        return task.abstract_frozen_params(mesh)
    if task.name == "lm":
        return {}, {}
    raise ValueError(
        f"task {task.name!r} cannot be compiled ahead of time: it does not implement "
        "abstract_frozen_params(mesh) (the frozen inputs as sharded ShapeDtypeStructs)"
    )


def abstract_batch(task, batch_size: int, mesh) -> dict[str, jax.ShapeDtypeStruct]:
    """The global batch as ``ShapeDtypeStruct``s sharded over (data, fsdp)."""
    if hasattr(task, "batch_shapes"):
        shapes = task.batch_shapes(batch_size)
    elif task.name == "lm":  # packed LM batches (data/packing.py): five int32 [B, T] arrays
        t = task.cfg.data.seq_len
        keys = ("tokens", "targets", "segment_ids", "positions", "loss_mask")
        shapes = {k: jax.ShapeDtypeStruct((batch_size, t), jnp.int32) for k in keys}
    else:
        raise ValueError(
            f"task {task.name!r} cannot be compiled ahead of time: it does not implement "
            "batch_shapes(batch_size) (the global batch as ShapeDtypeStructs)"
        )
    return {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shd.batch_sharding(mesh, len(v.shape)))
        for k, v in shapes.items()
    }


def aot_task(cfg):
    """The task of ``cfg`` for compilation only: a drafter task whose ``target.dir`` holds no
    model takes the target's shape from ``target.preset`` (e.g. ``qwen3-8b``), and no data,
    tokenizer or weights are read (see :func:`_abstract_drafter_task`)."""
    from dspark_jax.train.trainer import make_task

    task = make_task(cfg)
    if task.name == "drafter":
        return _abstract_drafter_task(cfg)
    return task


def _abstract_drafter_task(cfg):
    import os

    from dspark_jax.models.drafter_config import DrafterConfig
    from dspark_jax.models.presets import get_preset
    from dspark_jax.models.qwen3 import Qwen3
    from dspark_jax.train.drafter_task import DrafterTask

    class AbstractDrafterTask(DrafterTask):
        """The drafter task seen by the compiler: shapes and shardings, nothing loaded."""

        def _read_target_config(self):
            d = self.cfg.target.dir
            if d and os.path.isfile(os.path.join(d, "config.json")):
                return super()._read_target_config()
            preset = self.cfg.target.preset
            if not preset:
                raise FileNotFoundError(
                    f"--aot needs the target's shape: target.dir = {d!r} holds no config.json "
                    "and target.preset is not set (e.g. --config.target.preset=qwen3-8b)"
                )
            if self._target_config is None:
                self._target_config = get_preset(preset)
            return self._target_config

        @property
        def drafter_config(self) -> DrafterConfig:
            if self._drafter_config is None:
                d = self.cfg.drafter
                try:  # the real mask id when a tokenizer is at hand
                    mask_id = self.tokenizer.mask_id
                except (FileNotFoundError, ValueError):
                    # Compilation depends on shapes only; any in-vocabulary id will do.
                    mask_id = self.model_config().vocab_size - 1
                dc = DrafterConfig.from_section(d, mask_id)
                self._drafter_config = dc.resolve(self.model_config())
            return self._drafter_config

        def abstract_frozen_params(self, mesh):
            """The frozen target as sharded ``ShapeDtypeStruct``s (``target.dtype``), laid
            out by the rules table exactly as ``frozen_params`` places the loaded weights."""
            fcfg = self.frozen_config()
            boxed = jax.eval_shape(
                lambda: Qwen3(fcfg).init(jax.random.key(0), jnp.zeros((1, 2), jnp.int32))["params"]
            )
            return _abstract(boxed, mesh)

        def batch_shapes(self, batch_size: int):
            """The distillation batch (``data/distill.py``): tokens, loss_mask ``[B, T]``,
            length ``[B]``, all int32."""
            t = self.cfg.data.seq_len
            return {
                "tokens": jax.ShapeDtypeStruct((batch_size, t), jnp.int32),
                "loss_mask": jax.ShapeDtypeStruct((batch_size, t), jnp.int32),
                "length": jax.ShapeDtypeStruct((batch_size,), jnp.int32),
            }

    return AbstractDrafterTask(cfg)


# ----------------------------------------------------------------------------------------
# Training step
# ----------------------------------------------------------------------------------------
def compile_train_step(
    cfg, mesh, device_memory_gb: float | None = None, task=None
) -> tuple[dict[str, Any], Any]:
    """Lower and compile the training step of ``cfg`` for ``mesh``; returns (report, compiled).

    The step is the loop's own (``trainer.make_train_step``), with the same shardings and
    donation, so the report is for the executable ``train.py`` would run.
    """
    from dspark_jax.train.trainer import build_state_spec, check_mesh_and_batch, make_train_step

    task = task or aot_task(cfg)
    check_mesh_and_batch(cfg, mesh)
    rep = NamedSharding(mesh, PartitionSpec())
    # "auto" attention backends resolve for the mesh's chips, not this host's.
    platform = compile_platform(mesh.devices.flat[0].platform)
    with jax.set_mesh(mesh), shd.rules_context(mesh), platform:
        spec = build_state_spec(task, cfg, mesh)
        frozen, frozen_sh = abstract_frozen(task, mesh)
        batch = abstract_batch(task, cfg.data.batch_size, mesh)
        batch_sh = jax.tree.map(lambda x: x.sharding, batch)
        step = jax.jit(
            make_train_step(task, spec.tx, spec.schedule),
            in_shardings=(spec.shardings, frozen_sh, batch_sh),
            out_shardings=(spec.shardings, rep),
            donate_argnums=(0,),
        )
        t0 = time.perf_counter()
        lowered = step.lower(spec.abstract, frozen, batch)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
    params, opt_state = spec.abstract.params, spec.abstract.opt_state
    report = {
        "kind": "train_step",
        **compiler_info(mesh),
        "task": task.name,
        "mesh": dict(mesh.shape),
        "num_devices": int(mesh.size),
        "batch_size": int(cfg.data.batch_size),
        "seq_len": int(cfg.data.seq_len),
        "compute_dtype": cfg.train.compute_dtype,
        "remat": _remat_of(task),
        "anchors_per_seq": _anchors_of(cfg),
        "lower_s": round(t1 - t0, 2),
        "compile_s": round(t2 - t1, 2),
        "trainable_params": _count(params),
        "frozen_params": _count(frozen),
        "per_device": {
            "params_bytes": per_device_bytes(params),
            "opt_state_bytes": per_device_bytes(opt_state),
            "frozen_bytes": per_device_bytes(frozen),
            "batch_bytes": per_device_bytes(batch),
        },
        "global": {
            "params_bytes": global_bytes(params),
            "opt_state_bytes": global_bytes(opt_state),
            "frozen_bytes": global_bytes(frozen),
        },
        "memory": memory_fields(compiled),
    }
    return _with_fit(report, device_memory_gb), compiled


def _anchors_of(cfg) -> int | None:
    """Supervised draft blocks per sequence (drafter tasks; None for the others)."""
    drafter = cfg.get("drafter")
    return None if drafter is None else drafter.get("anchors_per_seq")


def _remat_of(task) -> str | None:
    try:
        return getattr(task.model_config(), "remat", None)
    except (ValueError, FileNotFoundError):
        return None


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
    ``tensor``); the paged KV pool (every slot at ``max_len``, pages of ``page_size``) is
    split over KV heads (``tensor``), the drafter context (K/V rows for DSpark/DFlash) over
    slots (``data``×``fsdp``) and KV heads. ``attention`` ``auto`` resolves for the mesh's
    platform (the TPU kernel for a TPU topology).
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
        t_params, _ = _abstract(t_boxed, mesh)
        d_params = None
        if drafter is not None:
            d_boxed = jax.eval_shape(lambda k: init_drafter_params(drafter, k), key)
            d_params, _ = _abstract(d_boxed, mesh)
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
    return _with_fit(report, device_memory_gb), compiled


# ----------------------------------------------------------------------------------------
# CLI glue (train.py --aot)
# ----------------------------------------------------------------------------------------
def serve_configs(task) -> tuple[Any, Any]:
    """``(target Qwen3Config, DrafterConfig)`` of a drafter task, for ``--aot-serve``."""
    if task.name != "drafter":
        raise ValueError(f"--aot-serve needs a drafter config (task 'drafter'), got {task.name!r}")
    return task.frozen_config(), task.drafter_config


def aot_mesh(mesh_text: str | None, mesh_cfg=None, topology: str | None = None):
    """The ``(data, fsdp, tensor)`` mesh to compile for: over the devices of a TPU
    ``topology`` when given, else over this process's (fake CPU) devices."""
    devices = topology_devices(topology) if topology else None
    mesh = shd.make_mesh(*parse_mesh(mesh_text, mesh_cfg), devices=devices)
    return mesh


def run_cli(cfg, args) -> dict[str, Any]:
    topology = getattr(args, "aot_topology", None)
    mesh = aot_mesh(args.aot_mesh, cfg.get("mesh"), topology)
    task = aot_task(cfg)
    if args.aot_serve:
        tcfg, dcfg = serve_configs(task)
        report, _ = compile_serve_round(
            tcfg, dcfg, mesh, args.slots, args.max_len, device_memory_gb=args.aot_device_memory_gb
        )
    else:
        report, _ = compile_train_step(cfg, mesh, args.aot_device_memory_gb, task=task)
    if topology:
        report["topology"] = topology
    return report


def _gb(b: int) -> str:
    return f"{b / GB:8.2f} GB"


def format_report(report: dict[str, Any]) -> str:
    where = report.get("topology") or f"{report['num_devices']} devices"
    lines = [
        f"AOT {report['kind']} by {report.get('compiler', 'XLA')}: mesh {report['mesh']} "
        f"({where}); lower {report['lower_s']:.1f}s, compile {report['compile_s']:.1f}s",
        "per device:",
    ]
    for k, v in report["per_device"].items():
        lines.append(f"  {k:<18}{_gb(v)}")
    for k in ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "peak_bytes"):
        lines.append(f"  {k:<18}{_gb(report['memory'][k])}")
    if "fits" in report:
        verdict = "fits" if report["fits"] else "DOES NOT FIT"
        lines.append(f"  {verdict} in {report['device_memory_gb']:.0f} GB per device")
    return "\n".join(lines)
