"""The router's tokenizer: HF `tokenizers` plus the model's Jinja chat template. No torch.

transformers' AutoTokenizer imports torch, so the router reads the two files it needs from the
model's HF-layout directory itself: ``tokenizer.json`` and the chat template
(``chat_template.jinja``, or ``chat_template`` in ``tokenizer_config.json``), rendered the way
transformers renders it (sandboxed Jinja, ``trim_blocks``/``lstrip_blocks``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import jinja2.sandbox
import tokenizers


class ChatTemplateError(ValueError):
    """The model has no chat template, or the messages do not fit it."""


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


class RouterTokenizer:
    """Encode prompts (plain or chat) and decode token ids, from an HF-layout directory."""

    def __init__(self, tokenizer_dir: str | Path, chat_template: str | None = None) -> None:
        """chat_template: Jinja text replacing the model's template (`--chat-template`)."""
        d = Path(tokenizer_dir)
        self._tok = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
        config = _read_json(d / "tokenizer_config.json")
        self._special = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token")}
        template = chat_template if chat_template is not None else _read_chat_template(d, config)
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._template = env.from_string(template) if template else None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> str:
        """The prompt text for a conversation; raises ChatTemplateError."""
        if self._template is None:
            raise ChatTemplateError("this model has no chat template; send a plain prompt")
        try:
            return self._template.render(messages=[{"role": m.role, "content": m.content} for m in messages],
                                         add_generation_prompt=add_generation_prompt, **self._special)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e

    def encode_chat(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> tuple[str, list[int]]:
        # The template already writes the special tokens; do not add a BOS on top.
        text = self.render_chat(messages, add_generation_prompt)
        return text, self._tok.encode(text, add_special_tokens=False).ids


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _token_text(tok: object) -> str | None:
    if isinstance(tok, dict):  # AddedToken serialised as a dict
        return tok.get("content")
    return tok if isinstance(tok, str) else None


def _read_chat_template(d: Path, config: dict) -> str | None:
    jinja_file = d / "chat_template.jinja"
    if jinja_file.exists():
        return jinja_file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: use "default"
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template
