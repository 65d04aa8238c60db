"""Offline batches in one Python call, over the serving engine (the shape of vLLM's
``LLM(...).generate(prompts, SamplingParams)``)::

    from dspark_jax.serve import LLM, SamplingParams

    with LLM("assets/target", "assets/drafters/dspark", num_slots=8) as llm:
        results = llm.generate(["def fib(n):", "class Stack:"], SamplingParams(max_tokens=64))
        replies = llm.chat([[{"role": "user", "content": "a function that adds"}]])
    print(results[0].text, results[0].mean_accepted_length)

Every prompt becomes one engine request; they are batched over the engine's slots exactly
as concurrent HTTP requests would be (continuous batching, the configured scheduler) and
the results come back in prompt order. The engine compiles its shapes when the ``LLM`` is
built (through JAX's persistent compilation cache unless ``compile_cache=False``).
"""

from __future__ import annotations

from collections.abc import Sequence

from dspark_jax.decode.mesh import decode_mesh
from dspark_jax.serve.chat import ChatTemplate, load_chat_template, parse_messages
from dspark_jax.serve.config import EngineConfig
from dspark_jax.serve.engine import Engine
from dspark_jax.serve.loading import load_models
from dspark_jax.serve.requests import InvalidRequest, Result, SamplingParams

__all__ = ["LLM"]


class LLM:
    """A started engine for offline batches; see the module docstring.

    ``target`` / ``drafter``: model directories (``drafter=None``: no speculation);
    ``tensor`` / ``data``: the device mesh (``decode.mesh``, as ``serve.py --tensor``;
    default one device); the remaining keywords are ``EngineConfig`` fields
    (``num_slots``, ``max_len``, ``scheduler``, ...). ``compile_cache``: True (the default
    directory), a directory, or False.
    """

    def __init__(
        self,
        target: str,
        drafter: str | None = None,
        *,
        tensor: int = 1,
        data: int = 1,
        compile_cache=True,
        **config,
    ):
        if compile_cache:
            from dspark_jax.compile_cache import enable_compile_cache

            enable_compile_cache(None if compile_cache is True else compile_cache)
        mesh = decode_mesh(data=data, tensor=tensor)
        models = load_models(target, drafter, mesh=mesh)
        if drafter is None:
            config.setdefault("scheduler", "none")
        self._start(models, EngineConfig(**config), load_chat_template(target), mesh)

    @classmethod
    def from_models(
        cls, models, config: EngineConfig, chat_template: ChatTemplate | None = None, mesh=None
    ):
        """An ``LLM`` over models already in memory: ``(target, target_params, tokenizer,
        drafter, drafter_params, sts)`` as ``serve.loading.load_models`` returns them."""
        llm = cls.__new__(cls)
        llm._start(models, config, chat_template, mesh)
        return llm

    def _start(self, models, config: EngineConfig, chat_template, mesh=None) -> None:
        target, tp, tok, drafter, dp, sts = models
        self.engine = Engine(target, tp, tok, drafter, dp, config, sts=sts, mesh=mesh).start()
        self.chat_template = chat_template

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Result]:
        """One ``Result`` per prompt (text or token ids), in order. ``params``: one for all
        prompts or one per prompt. A bad prompt or setting raises ``InvalidRequest`` naming
        it before anything runs."""
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        params = list(params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        for i, (prompt, p) in enumerate(zip(prompts, params)):  # fail before submitting any
            try:
                self.engine.check_request(prompt, p)
            except InvalidRequest as e:
                raise InvalidRequest(f"prompt {i}: {e}", e.param) from None
        results: list[Result | None] = [None] * len(prompts)
        pending = list(enumerate(zip(prompts, params)))
        window = max(1, self.engine.config.max_queue // 2)  # stay below the queue bound
        inflight = []
        while pending or inflight:
            while pending and len(inflight) < window:
                i, (prompt, p) = pending.pop(0)
                inflight.append((i, self.engine.submit(prompt, p)))
            i, handle = inflight.pop(0)
            results[i] = handle.result()
        return results  # type: ignore[return-value]

    def chat(
        self,
        conversations: Sequence[list[dict]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[Result]:
        """``generate`` over chat conversations rendered with the target's chat template
        (``add_generation_prompt``); the default ``max_tokens`` runs to the cache's end."""
        if self.chat_template is None:
            raise ValueError("this target has no chat template (tokenizer_config.json)")
        if params is None:
            params = SamplingParams(max_tokens=None)
        prompts = [
            self.chat_template.render(parse_messages(c), True, chat_template_kwargs)
            for c in conversations
        ]
        return self.generate(prompts, params)

    def close(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
