"""The incremental detokenizer (proto/detokenizer.py, engine and router) with the real SmolLM2 tokenizer: byte-split characters (CJK, emoji),
stop strings across token boundaries, hold-back and final flush."""

from __future__ import annotations

import pytest

from proto.detokenizer import REPLACEMENT, IncrementalDetokenizer

TEXTS = [
    "Hello 🙂 world, how are you?",
    "日本語のテキストです。中文也可以。",
    "👩‍👩‍👧‍👦 family 🇫🇷 and café naïve — “quotes”",
    "def f(x):\n    return x ** 2  # 🐍",
]


def stream(tok, text, stop=(), prompt="Say:"):
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, prompt_ids, stop)
    deltas = []
    for t in ids:
        deltas.append(d.step([t]))
        if d.stopped:
            break
    deltas.append(d.finish())
    return deltas, d


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_decoded_text_without_broken_characters(tokenizer, text):
    deltas, d = stream(tokenizer, text)
    assert "".join(deltas) == tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    assert not any(REPLACEMENT in x for x in deltas)
    assert not d.stopped


@pytest.mark.parametrize("text,stop", [
    ("Hello world, this is a test", "ld, th"),       # spans three tokens
    ("日本語のテキストです。中文也可以。", "テキ"),      # CJK split inside bytes
    ("Hello 🙂 world", "🙂 w"),
    ("one two three four", "three"),
])
def test_stop_string_ends_text_before_it_and_is_never_emitted(tokenizer, text, stop):
    deltas, d = stream(tokenizer, text, stop=(stop, "zzzzzzzz"))
    out = "".join(deltas)
    assert d.stopped
    assert out == text[: text.index(stop)]
    assert all(stop not in x for x in deltas) and stop not in out
    assert not any(REPLACEMENT in x for x in deltas)


def test_partial_stop_prefix_is_held_back_then_flushed(tokenizer):
    text = "the answer is 42 and then"
    ids = tokenizer.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tokenizer, [1], ("and then some",))
    emitted = "".join(d.step([t]) for t in ids)
    assert text[len(emitted):] == "and then"  # held back: the part a later token could make "and then some"
    assert emitted + d.finish() == text
    assert not d.stopped


def test_finish_drops_an_unfinished_trailing_character(tokenizer):
    ids = tokenizer.encode("ok 日本", add_special_tokens=False)
    d = IncrementalDetokenizer(tokenizer, [1])
    out = "".join(d.step([t]) for t in ids[:-1]) + d.finish()  # last byte of 本 missing
    assert REPLACEMENT not in out and out.startswith("ok")


def test_special_tokens_skipped(tokenizer):
    ids = tokenizer.encode("Hi there", add_special_tokens=False) + [tokenizer.eos_token_id]
    d = IncrementalDetokenizer(tokenizer, [1])
    assert "".join(d.step([t]) for t in ids) + d.finish() == "Hi there"
