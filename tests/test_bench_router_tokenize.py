"""pdserve bench router-tokenize on a short prompt: every mode tokenizes the same prompt to the same
ids through the bundled model's tokenizer and the JSON holds a row per mode (speed is the bench's
to print, not asserted here)."""

from __future__ import annotations

import json

import pytest

from bench.router_tokenize import MODES, prompt_text
from deploy import cli

pytestmark = pytest.mark.model


def test_prompt_text_is_seeded_and_exact_length():
    assert prompt_text(1000) == prompt_text(1000) and len(prompt_text(1000)) == 1000
    assert prompt_text(1000, seed=1) != prompt_text(1000)


def test_bench_writes_a_row_per_mode_with_the_same_tokens(model_path, tmp_path, capsys):
    out = tmp_path / "b.json"
    cli.main(["bench", "router-tokenize", "--model", str(model_path), "--chars", "3000", "--repeats", "1",
              "--json", str(out)])
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert tuple(rows) == MODES and doc["chars"] == 3000 and doc["max_model_len"] == 8192
    assert len({r["tokens"] for r in rows.values()}) == 1 and rows["router"]["tokens"] > 300
    assert all(r["encode_ms"] > 0 and r["loop_gap_ms"] > 0 for r in rows.values())
    assert "loop gap ms" in capsys.readouterr().out
