"""Chat messages -> prompt text with the checkpoint's own chat template (``/v1/chat/
completions``), rendered the way Hugging Face ``transformers`` renders it: a sandboxed
Jinja2 environment with ``trim_blocks`` / ``lstrip_blocks``, the ``loopcontrols``
extension, ``raise_exception``, a ``tojson`` filter and ``strftime_now``; the template
sees ``messages``, ``add_generation_prompt``, the tokenizer's ``bos_token`` /
``eos_token`` and any ``chat_template_kwargs`` of the request (e.g. Qwen3's
``enable_thinking``).

The template comes from the model directory: ``chat_template.jinja`` if present, else the
``chat_template`` field of ``tokenizer_config.json`` (a string, or a list of named
templates, of which ``default`` is used). A checkpoint without one has no chat endpoint:
requests get a 400 naming the missing file, never a silent concatenation of messages.
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any

from dspark_jax.serve.requests import InvalidRequest

__all__ = ["ChatTemplate", "load_chat_template", "parse_messages"]

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
ROLES = ("system", "user", "assistant")


def _token_text(value) -> str | None:
    """A special token as ``tokenizer_config.json`` stores it: a string or an
    ``AddedToken`` dict with ``content``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    """A compiled chat template and the special tokens it may reference."""

    def __init__(self, source: str, origin: str, bos_token=None, eos_token=None):
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(
                x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                sort_keys=sort_keys,
            )  # fmt: skip

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"the chat template in {origin} does not compile: {e}") from None
        self.source, self.origin = source, origin
        self.bos_token, self.eos_token = bos_token, eos_token
        self._errors = jinja2.exceptions.TemplateError

    def render(self, messages: list[dict], add_generation_prompt: bool = True, kwargs=None) -> str:
        """The prompt text for ``messages`` (``kwargs``: extra template variables, e.g.
        ``{"enable_thinking": False}``); ``InvalidRequest`` if the template rejects them
        (its ``raise_exception``) or a variable collides with the template's inputs."""
        kwargs = dict(kwargs or {})
        reserved = {"messages", "add_generation_prompt", "bos_token", "eos_token"}
        clash = sorted(reserved & set(kwargs))
        if clash:
            raise InvalidRequest(
                f"chat_template_kwargs may not set {', '.join(clash)}", "chat_template_kwargs"
            )
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except self._errors as e:
            raise InvalidRequest(
                f"the chat template rejected the messages: {e}", "messages"
            ) from None


def load_chat_template(model_dir: str | os.PathLike) -> ChatTemplate | None:
    """The chat template of a Hugging Face model directory, or None if it has none."""
    model_dir = os.fspath(model_dir)
    config_path = os.path.join(model_dir, TOKENIZER_CONFIG)
    config: dict[str, Any] = {}
    if os.path.isfile(config_path):
        try:
            with open(config_path) as f:
                config = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{config_path} is not valid JSON: {e}") from None
    tokens = dict(
        bos_token=_token_text(config.get("bos_token")),
        eos_token=_token_text(config.get("eos_token")),
    )
    file_path = os.path.join(model_dir, TEMPLATE_FILE)
    if os.path.isfile(file_path):
        with open(file_path) as f:
            return ChatTemplate(f.read(), file_path, **tokens)
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if source is None:
        return None
    if not isinstance(source, str):
        raise ValueError(f"{config_path}: chat_template must be a string, got {type(source)}")
    return ChatTemplate(source, config_path, **tokens)


def parse_messages(messages: Any) -> list[dict]:
    """Validate OpenAI chat ``messages``: a non-empty list of ``{"role", "content"}`` with
    role system/user/assistant and text content (a string, or a list of ``{"type":
    "text", "text"}`` parts, joined). Returns plain ``{"role", "content"}`` dicts."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise InvalidRequest(f"{where} must be an object with role and content", where)
        role = m.get("role")
        if role not in ROLES:
            raise InvalidRequest(
                f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role"
            )
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise InvalidRequest(
                        f"{where}.content[{j}]: only text parts are supported",
                        f"{where}.content",
                    )
                parts.append(str(part.get("text", "")))
            content = "".join(parts)
        if not isinstance(content, str):
            raise InvalidRequest(f"{where}.content must be a string", f"{where}.content")
        extra = sorted(set(m) - {"role", "content", "name"})
        if extra:
            raise InvalidRequest(
                f"{where} has unsupported field(s) {', '.join(extra)}", f"{where}.{extra[0]}"
            )
        out.append({"role": role, "content": content})
    return out
