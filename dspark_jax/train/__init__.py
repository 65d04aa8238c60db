"""Training: a task-agnostic sharded loop (``trainer``), AdamW schedule (``optimizer``),
Orbax checkpoints (``checkpoint``) and the language-model task (``lm_task``)."""

from dspark_jax.train.checkpoint import Checkpointer
from dspark_jax.train.optimizer import make_optimizer, make_schedule
from dspark_jax.train.state import TrainState
from dspark_jax.train.trainer import (
    TASKS,
    Task,
    build_state_spec,
    default_config,
    make_task,
    read_metrics,
    register_task,
    train,
)

__all__ = [
    "TASKS",
    "Checkpointer",
    "Task",
    "TrainState",
    "build_state_spec",
    "default_config",
    "make_optimizer",
    "make_schedule",
    "make_task",
    "read_metrics",
    "register_task",
    "train",
]
