"""The one chat-template renderer, used by the router and the engine alike. Pure Python, no torch.

A model's chat template is Jinja text, from ``chat_template.jinja`` or the ``chat_template`` key
of ``tokenizer_config.json`` (a list of named templates: the one named "default"), or given
explicitly (``--chat-template FILE``). It is rendered the way transformers'
``apply_chat_template`` renders it: a sandboxed environment with ``trim_blocks`` and
``lstrip_blocks``, the loop-control extension, ``raise_exception``, a ``tojson`` that does not
HTML-escape, and the tokenizer's special tokens (``bos_token``, ``eos_token``, ...) as variables.
The rendered text already holds the special tokens: encode it without adding a BOS.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Sequence

import jinja2.ext
import jinja2.sandbox

from proto.sampling import InvalidRequest

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# The roles a conversation may hold (api.proto's ChatMessage.role, OpenAI's chat roles without
# tool calling): a template renders any string it is given, so "wizard" became a turn the model was
# never trained on. "tool" needs tool calls (tool_call_id), which pdserve does not accept;
# "developer" (OpenAI's newer name for "system") is not what these templates check for.
CHAT_ROLES = ("system", "user", "assistant")


class ChatTemplateError(ValueError):
    """The model has no chat template, or the messages do not fit it (the message says which)."""


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


def check_roles(messages: Sequence[ChatMessage]) -> None:
    """Raises InvalidRequest naming ``messages.<i>.role`` for the first role not in CHAT_ROLES."""
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise InvalidRequest(f"messages.{i}.role", f"must be one of {', '.join(CHAT_ROLES)}; got {m.role!r}")


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


class ChatTemplate:
    """A compiled chat template with the special tokens it may refer to."""

    def __init__(self, source: str, special_tokens: dict[str, str | None] | None = None) -> None:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                           extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template does not parse: {e}") from e
        self.special_tokens = dict(special_tokens or {})

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, override: str | None = None) -> "ChatTemplate | None":
        """The template of an HF-layout directory (``override``: Jinja text replacing it); None if it has none."""
        d = Path(model_dir)
        jinja_file = d / CHAT_TEMPLATE_FILE
        config = _read_json(d / "tokenizer_config.json")
        return cls.from_config(config, jinja_file.read_text() if jinja_file.exists() else None, override)

    @classmethod
    def from_config(cls, tokenizer_config: dict, jinja_text: str | None = None,
                    override: str | None = None) -> "ChatTemplate | None":
        """The template from a parsed tokenizer_config.json and the text of chat_template.jinja (which
        wins when present); ``override`` replaces both. None if there is no template."""
        source = override if override is not None else jinja_text or _config_template(tokenizer_config)
        if not source:
            return None
        specials = {k: _token_text(tokenizer_config.get(k)) for k in SPECIAL_TOKEN_KEYS}
        return cls(source, {k: v for k, v in specials.items() if v is not None})

    def render(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> str:
        """The prompt text for a conversation; raises ChatTemplateError."""
        try:
            return self._template.render(messages=[{"role": m.role, "content": m.content} for m in messages],
                                         add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _token_text(tok: object) -> str | None:
    if isinstance(tok, dict):  # AddedToken serialised as a dict
        return tok.get("content")
    return tok if isinstance(tok, str) else None


def _config_template(config: dict) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: use "default"
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template
