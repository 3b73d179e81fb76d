"""The router's tokenizer: HF `tokenizers` plus the model's chat template (proto/chat.py). No torch.

transformers' AutoTokenizer imports torch, so the router builds its tokenizer from the model's
files themselves: ``tokenizer.json``, ``tokenizer_config.json`` (special tokens, chat template)
and ``chat_template.jinja``. It receives them from a worker (Worker.ModelFiles, see
proto/model_files.py), never from a path on a worker's disk, so it works on any node.
"""

from __future__ import annotations

import functools
import json

import tokenizers

from proto.chat import CHAT_TEMPLATE_FILE, ChatMessage, ChatTemplate, ChatTemplateError


class RouterTokenizer:
    """Encode prompts (plain or chat) and decode token ids.

    files: file name -> contents, as proto.model_files.join_chunks returns them (tokenizer.json
    required). chat_template: Jinja text replacing the model's template (`--chat-template`)."""

    def __init__(self, files: dict[str, bytes], chat_template: str | None = None) -> None:
        if "tokenizer.json" not in files:
            raise ValueError("the worker sent no tokenizer.json: this model cannot be served by the router")
        self._tok = tokenizers.Tokenizer.from_str(files["tokenizer.json"].decode())
        config = json.loads(files["tokenizer_config.json"]) if "tokenizer_config.json" in files else {}
        jinja_text = files[CHAT_TEMPLATE_FILE].decode() if CHAT_TEMPLATE_FILE in files else None
        self._template = ChatTemplate.from_config(config, jinja_text, chat_template)

    @functools.cached_property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_chars_per_token(self) -> int:
        """An upper bound on the characters one token decodes to: its vocabulary string's length
        (byte-level BPE writes each byte as one character, and a character is at least a byte)."""
        return max(len(t) for t in self._tok.get_vocab(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        """Token ids of a plain prompt (with the BOS the tokenizer adds). Safe to call from another
        thread while the event loop runs: the batch call releases the GIL while it encodes
        (`Tokenizer.encode` holds it: 390k characters stalled every other thread for 0.27 s)."""
        return self._tok.encode_batch([text], add_special_tokens=True)[0].ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def decode_releasing_gil(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """decode() through the batch call, which releases the GIL while it decodes (decode holds it:
        1M ids stalled every other thread for 0.86 s): for long lists decoded off the event loop.
        The streams' small per-step decodes keep decode()."""
        return self._tok.decode_batch([token_ids], skip_special_tokens=skip_special_tokens)[0]

    def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> str:
        """The prompt text for a conversation; raises ChatTemplateError."""
        if self._template is None:
            raise ChatTemplateError("this model has no chat template; send a plain prompt")
        return self._template.render(messages, add_generation_prompt)

    def encode_chat(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> tuple[str, list[int]]:
        # The template already writes the special tokens; do not add a BOS on top.
        text = self.render_chat(messages, add_generation_prompt)
        return text, self._tok.encode_batch([text], add_special_tokens=False)[0].ids
