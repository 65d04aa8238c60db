"""Tiny random models for tests and ``--quick`` smoke runs (not for anything measured).

``tiny_random_models(tokenizer, kind)`` builds the ``tiny`` Qwen3 preset sized to a
tokenizer and, unless ``kind`` is None, a one-layer drafter of that kind, with random
weights: their text is meaningless but every code path (prefill, draft, verify, commit,
serving) runs with real shapes.

``tiny_hf_qwen3(out_dir)`` writes a tiny random Qwen3 as a Hugging Face directory laid out
like a real Qwen3 checkpoint (Qwen3's special-token names, a ChatML chat template, an
embedding larger than the tokenizer), built offline: the stand-in for "your own Qwen3"
that ``scripts/byo_qwen3.sh`` runs on in CI.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time

import jax
import jax.numpy as jnp

__all__ = [
    "free_port",
    "wait_until_healthy",
    "kill_and_resume",
    "xla_compilations",
    "one_device_subprocess_env",
    "smoke_schedule",
    "stdlib_corpus",
    "tiny_hf_qwen3",
    "tiny_random_models",
]


@contextlib.contextmanager
def xla_compilations():
    """Counts of XLA compilations by jitted function name while the block runs, from jax's
    own "Finished XLA compilation of jit(NAME)" log record (one per executable compiled;
    a jitted function's ``_cache_size()`` counts dispatch-cache entries instead, which
    on a mesh can hold two entries for one executable)."""
    counts: collections.Counter = collections.Counter()
    pattern = re.compile(r"Finished XLA compilation of jit\((\w+)\)")

    class Count(logging.Handler):
        def emit(self, record):
            m = pattern.match(record.getMessage())
            if m:
                counts[m.group(1)] += 1

    logger = logging.getLogger("jax._src.dispatch")
    handler, level = Count(logging.DEBUG), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield counts
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def stdlib_corpus(root, modules, vocab_size: int = 320, **prepare_kwargs) -> tuple[str, str]:
    """A small, deterministic corpus of real Python code: the standard library's
    ``modules`` (names without ``.py``) prepared under ``root/data`` as a source-tree
    corpus, with a BPE tokenizer trained on its train split. Returns ``(data_dir,
    tokenizer_path)``."""
    from dspark_jax.data import TRAIN, make_text_dataset, prepare_corpus, train_bpe_tokenizer

    src = os.path.join(root, "src")
    os.makedirs(src, exist_ok=True)
    stdlib = sysconfig.get_paths()["stdlib"]
    for name in modules:
        shutil.copy(os.path.join(stdlib, name + ".py"), os.path.join(src, name + ".py"))
    data_dir = os.path.join(root, "data")
    prepare_corpus("source_tree", src, data_dir, **prepare_kwargs)
    texts = (r["text"] for r in make_text_dataset(data_dir, TRAIN, shuffle=False))
    tok = train_bpe_tokenizer(texts, vocab_size, out_path=os.path.join(data_dir, "tokenizer.json"))
    return data_dir, str(tok.path)


def _train_losses(workdir) -> dict[int, float]:
    from dspark_jax.train import read_metrics

    return {m["step"]: m["loss"] for m in read_metrics(workdir) if m["kind"] == "train"}


def kill_and_resume(
    repo, config_spec, overrides, root, steps: int, checkpoint_every: int, kill_timeout=120.0
) -> dict:
    """The resume-after-kill protocol for ``train.py`` (run from ``repo`` with ``--config
    config_spec``, the ``(key, value)`` config ``overrides``, ``steps`` and a checkpoint
    every ``checkpoint_every`` steps, on one CPU device with a shared compilation cache): a
    reference run to the end under ``root/ref``; a second run under ``root/killed``
    SIGKILLed as soon as its first checkpoint exists, then started again to the end.

    Returns ``ref_losses`` and ``resumed_losses`` (step -> train loss), ``killed_at`` (the
    last step the killed run logged) and the resumed run's ``stdout`` / ``stderr``.
    """
    env = one_device_subprocess_env(os.path.join(root, "jax_cache"))
    extra = [f"--config.{k}={v}" for k, v in overrides]
    extra += [f"--config.train.steps={steps}", f"--config.train.checkpoint_every={checkpoint_every}",
              "--config.train.eval_every=0"]  # fmt: skip

    def argv(workdir):
        return [sys.executable, "train.py", "--config", config_spec, "--workdir", workdir,
                "--no-progress", *extra]  # fmt: skip

    def run(workdir):
        return subprocess.run(argv(workdir), cwd=repo, env=env, check=True, capture_output=True)

    ref = os.path.join(root, "ref")
    run(ref)
    work = os.path.join(root, "killed")
    proc = subprocess.Popen(
        argv(work), cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    ckpt_dir = os.path.join(work, "checkpoints")
    deadline = time.time() + kill_timeout
    while time.time() < deadline and proc.poll() is None:
        if os.path.isdir(ckpt_dir) and [d for d in os.listdir(ckpt_dir) if d.isdigit()]:
            break
        time.sleep(0.02)
    if proc.poll() is not None:
        raise AssertionError("training finished before it could be killed")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed = _train_losses(work)
    out = run(work)
    return {
        "ref_losses": _train_losses(ref),
        "resumed_losses": _train_losses(work),
        "killed_at": max(killed, default=0),
        "stdout": out.stdout.decode(),
        "stderr": out.stderr.decode(),
    }


def one_device_subprocess_env(compile_cache_dir) -> dict[str, str]:
    """Environment for a child ``train.py`` in tests: one CPU device (fastest to compile;
    the fake-device count of ``tests/conftest.py`` removed) and a persistent compilation
    cache shared by the children, so a resumed run does not compile again."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(
        f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f
    )
    env["JAX_COMPILATION_CACHE_DIR"] = str(compile_cache_dir)
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    return env


def smoke_schedule(steps: int, eval_every: int, eval_batches: int, checkpoint_every: int):
    """``train`` fields of a tiny smoke/test run (configs/tiny/*.py): a high learning rate
    so a few steps move the loss, a log line every step, two checkpoints kept."""
    return dict(
        steps=steps, lr=3e-3, warmup_frac=0.1, log_every=1, eval_every=eval_every,
        eval_batches=eval_batches, checkpoint_every=checkpoint_every, keep_checkpoints=2,
    )  # fmt: skip


def tiny_random_models(
    tokenizer,
    drafter_kind: str | None = "dspark",
    gamma: int = 4,
    max_len: int = 256,
    seed: int = 0,
):
    """``(target, target_params, drafter, drafter_params)``; the drafter pair is
    ``(None, None)`` when ``drafter_kind`` is None."""
    import flax.linen as nn

    from dspark_jax.models.drafter_config import DrafterConfig
    from dspark_jax.models.drafter_config import drafter_kind as kind_spec
    from dspark_jax.models.drafters import init_drafter_params, make_drafter
    from dspark_jax.models.presets import PRESETS
    from dspark_jax.models.qwen3 import Qwen3

    cfg = PRESETS["tiny"].replace(
        vocab_size=tokenizer.vocab_size, max_position_embeddings=max(max_len, 16)
    )
    target = Qwen3(cfg)
    params = nn.unbox(target.init(jax.random.key(seed), jnp.zeros((1, 8), jnp.int32))["params"])
    if drafter_kind is None:
        return target, params, None, None
    spec = kind_spec(drafter_kind)
    kw = dict(kind=drafter_kind, num_layers=1, gamma=1 if spec.single_token else gamma)
    if spec.mask_token:
        kw.update(mask_token_id=tokenizer.mask_id)
    if spec.sequential_head:
        kw.update(markov_rank=16)
    drafter = make_drafter(DrafterConfig(**kw), cfg)
    dparams = nn.unbox(init_drafter_params(drafter, jax.random.key(seed + 1)))
    return target, params, drafter, dparams


# The special tokens of a Qwen3 tokenizer that matter here, by Qwen3's names: documents end
# with <|endoftext|>, chat turns are <|im_start|>role ... <|im_end|>, and <|fim_pad|> is the
# MASK token of configs/recipes/drafter_dspark_my_qwen3.py (Qwen3 has no <|mask|>).
QWEN3_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
)  # fmt: skip
# ChatML, the turn format of Qwen chat models (without Qwen3's thinking and tool parts).
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TINY_QWEN3_TEXT_MODULES = ("textwrap", "string", "glob", "fnmatch", "shlex", "bisect")


def _tiny_qwen3_tokenizer(out_dir: str, tokens: int, modules):
    """A byte-level BPE of ``tokens`` ids trained on standard-library modules, with
    Qwen3's special tokens added after the learnt vocabulary (where Qwen3 has them)."""
    import tokenizers
    from tokenizers import trainers

    from dspark_jax.data.tokenizer_train import build_byte_level_bpe

    stdlib = sysconfig.get_paths()["stdlib"]
    texts = []
    for name in modules:
        with open(os.path.join(stdlib, name + ".py"), encoding="utf-8") as f:
            texts.append(f.read())
    tok = build_byte_level_bpe()
    trainer = trainers.BpeTrainer(
        vocab_size=tokens - len(QWEN3_SPECIAL_TOKENS), min_frequency=2, show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens(
        [tokenizers.AddedToken(t, special=True, normalized=False) for t in QWEN3_SPECIAL_TOKENS]
    )
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    return tok


def tiny_hf_qwen3(
    out_dir,
    *,
    writer: str = "auto",
    tokens: int = 480,
    max_position_embeddings: int = 512,
    seed: int = 0,
    modules=TINY_QWEN3_TEXT_MODULES,
) -> dict:
    """Write a tiny random Qwen3 checkpoint to ``out_dir``, offline: ``config.json``,
    ``model.safetensors`` (bfloat16), ``tokenizer.json`` (a byte-level BPE of ``tokens`` ids
    trained on the standard library's ``modules``, Qwen3's special tokens last) and
    ``tokenizer_config.json`` with a ChatML ``chat_template``. The embedding has a multiple
    of 64 rows, more than the tokenizer's ids, as Qwen3's does.

    ``writer``: ``"transformers"`` (``Qwen3ForCausalLM(config).save_pretrained``; needs
    torch), ``"save_hf"`` (this package's initialiser and ``convert.save_hf``) or
    ``"auto"`` (transformers when torch is importable). Returns ``{"path", "writer",
    "vocab_size", "tokenizer_size"}``."""
    import importlib.util
    import json

    if writer == "auto":
        have_torch = importlib.util.find_spec("torch") is not None
        have_hf = importlib.util.find_spec("transformers") is not None
        writer = "transformers" if have_torch and have_hf else "save_hf"
    if writer not in ("transformers", "save_hf"):
        raise ValueError(f"writer must be 'auto', 'transformers' or 'save_hf', got {writer!r}")
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    tok = _tiny_qwen3_tokenizer(out_dir, tokens, modules)
    n_ids = tok.get_vocab_size(with_added_tokens=True)
    vocab = -(-(n_ids + 1) // 64) * 64
    ids = {t: tok.token_to_id(t) for t in QWEN3_SPECIAL_TOKENS}
    shape = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1_000_000.0,
        rms_norm_eps=1e-6, max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False, bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
    )  # fmt: skip
    if writer == "transformers":
        import torch
        import transformers

        torch.manual_seed(seed)
        # initializer_range 0.1 (HF default 0.02): logits far enough from uniform that the
        # random model's continuations have some structure for a drafter to learn.
        config = transformers.Qwen3Config(**shape, initializer_range=0.1)
        model = transformers.Qwen3ForCausalLM(config).to(torch.bfloat16)
        model.save_pretrained(out_dir)
    else:
        import flax.linen as nn
        import numpy as np

        from dspark_jax.convert.hf_qwen3 import save_hf
        from dspark_jax.models.qwen3 import Qwen3, Qwen3Config

        cfg = Qwen3Config(**shape)
        params = Qwen3(cfg).init(jax.random.key(seed), jnp.zeros((1, 8), jnp.int32))["params"]
        params = jax.tree.map(np.asarray, nn.unbox(params))
        params["lm_head"]["kernel"] = params["lm_head"]["kernel"] * 5.0  # as above: less flat
        save_hf(out_dir, cfg, params, dtype="bfloat16")
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": max_position_embeddings,
        "chat_template": CHATML_TEMPLATE,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config, f, indent=2)
    return {"path": out_dir, "writer": writer, "vocab_size": vocab, "tokenizer_size": n_ids}


def multiprocess_env(devices_per_process: int) -> dict[str, str]:
    """Environment for the processes of a local multi-process run in tests: CPU,
    ``devices_per_process`` fake devices each (the test's own count removed)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(
        [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
        + [f"--xla_force_host_platform_device_count={devices_per_process}"]
    )
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    return env


def launch_processes(cmd: list[str], n: int, port: int, env: dict, **popen) -> list:
    """``cmd`` started ``n`` times as the processes of one JAX program (coordinator on
    127.0.0.1:``port``, ``--process-id`` 0 … n-1); returns the ``Popen`` objects."""
    extra = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(n)]
    return [
        subprocess.Popen(cmd + extra + ["--process-id", str(i)], env=env, **popen) for i in range(n)
    ]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a server or coordinator a
    test starts)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(url: str, procs, timeout: float = 600.0) -> None:
    """Wait for ``url``'s ``/health`` to answer 200 (a started ``serve.py``: compiling
    its shapes takes minutes on 2 loaded CPU cores). Raises ``AssertionError`` naming why
    if a process of ``procs`` exits first (with its stderr) or the wait runs out."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for i, p in enumerate(procs):
            if p.poll() is not None:
                err = p.communicate()[1] or ""
                raise AssertionError(f"process {i} exited with {p.returncode}:\n{err[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"{url} was not healthy within {timeout:.0f} s")
