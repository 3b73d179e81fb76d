"""The torch-free protocol layer (proto/): one set of sampling rules, the wire converter, the stop
rules, one detokenizer for router and engine, and the rule that importing it (and the router) never
imports torch. No model, no network."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from proto.chat import ChatMessage, ChatTemplate, ChatTemplateError
from proto.detokenizer import IncrementalDetokenizer
from proto.model_files import MODEL_FILES, file_chunks, join_chunks
from proto.pdserve.v1 import api_pb2, worker_pb2
from proto.sampling import InvalidRequest, SamplingParams, check_prompt, from_wire, to_wire
from proto.stop import find_stop_string, partial_stop_len, token_stop_reason

REPO = Path(__file__).resolve().parents[1]


def test_importing_the_protocol_layer_and_the_router_does_not_import_torch():
    code = ("import sys, pkgutil, importlib, proto, router; "
            "[importlib.import_module(m.name) for p in (proto, router) "
            " for m in pkgutil.walk_packages(p.__path__, p.__name__ + '.')]; "
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=2.5), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(logprobs=21), "logprobs"),
    (dict(stop_token_ids=(-1,)), "stop_token_ids"),
    (dict(stop=tuple(str(i) for i in range(17))), "stop"),
    (dict(stop=("",)), "stop"),
    (dict(stop=("x" * 257,)), "stop"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(repetition_penalty=1e-38), "repetition_penalty"),  # logits / 1e-38 overflow to inf
    (dict(repetition_penalty=1e3), "repetition_penalty"),
    (dict(seed=2**64), "seed"),
    (dict(seed=-1), "seed"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"),
])
def test_bad_sampling_names_the_field(kwargs, field):
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field and str(e.value).startswith(f"{field}: ")


def test_bad_wire_options_fail_with_the_same_rule():
    with pytest.raises(InvalidRequest, match="^top_p"):
        from_wire(api_pb2.SamplingOptions(top_p=0.0))


def test_wire_round_trip_keeps_every_field():
    # values exact in float32: the wire carries float
    p = SamplingParams(temperature=0.5, top_k=3, top_p=0.75, seed=7, max_tokens=5, stop_token_ids=[4, 5],
                       stop=["\n\n"], ignore_eos=True)
    assert from_wire(to_wire(p)) == p
    assert from_wire(to_wire(p), max_tokens=1).max_tokens == 1
    assert from_wire(api_pb2.SamplingOptions()) == SamplingParams()


def test_prompt_rules():
    with pytest.raises(InvalidRequest, match="^prompt"):
        check_prompt([], 4, 100)
    with pytest.raises(InvalidRequest, match=r"^prompt: token ids must be >= 0"):
        check_prompt([0, -1, 0], 1, 100)  # no vocabulary known (the router): negative ids still refused
    with pytest.raises(InvalidRequest, match=r"^prompt: token ids must be in \[0, 10\)"):
        check_prompt([3, 10], 4, 100, vocab_size=10)
    with pytest.raises(InvalidRequest, match="^max_tokens.*context length 100"):
        check_prompt([1] * 90, 11, 100)
    check_prompt([1] * 90, 10, 100, vocab_size=10)


# -- stop rules (proto/stop.py) ------------------------------------------------------------------
def test_token_stop_rules():
    p = SamplingParams(max_tokens=3, stop_token_ids=(7,))
    eos = (2,)
    assert token_stop_reason(5, 1, p, eos) is None
    assert token_stop_reason(2, 1, p, eos) == "stop"
    assert token_stop_reason(7, 1, p, eos) == "stop"
    assert token_stop_reason(5, 3, p, eos) == "length"
    assert token_stop_reason(2, 3, p, eos) == "stop"  # token rules before length rules
    assert token_stop_reason(2, 1, SamplingParams(max_tokens=3, ignore_eos=True), eos) is None
    assert token_stop_reason(5, 1, p, eos, num_tokens=100, max_model_len=100) == "length"  # context full
    assert token_stop_reason(5, 1, p, eos, num_tokens=99, max_model_len=100) is None
    m = SamplingParams(max_tokens=3, min_tokens=2, stop_token_ids=(7,))
    assert token_stop_reason(2, 1, m, eos) is None and token_stop_reason(7, 1, m, eos) is None  # under min_tokens
    assert token_stop_reason(7, 2, m, eos) == "stop"
    assert token_stop_reason(5, 1, SamplingParams(max_tokens=1, min_tokens=1), eos) == "length"


def test_stop_string_helpers():
    assert find_stop_string("abc\nEND x", ("END", "\n")) == 3
    assert find_stop_string("abcEND", ("END",), start=4) is None
    assert partial_stop_len("Hello\nEN", ("\nEND",)) == 3
    assert partial_stop_len("Hello", ("\nEND",)) == 0
    assert partial_stop_len("xab", ("abc", "bz")) == 2


# -- one detokenizer -----------------------------------------------------------------------------
def test_router_and_engine_use_the_same_detokenizer_type():
    import engine.llm_engine
    import router.service

    assert engine.llm_engine.IncrementalDetokenizer is IncrementalDetokenizer
    assert router.service.IncrementalDetokenizer is IncrementalDetokenizer


def test_no_other_detokenizer_or_stop_rule_is_defined():
    """The copies this layer replaced must not come back under another module."""
    defined = {}
    packages = [d for d in REPO.iterdir() if (d / "__init__.py").exists() and d.name != "tests"]
    for path in (p for d in packages for p in d.rglob("*.py") if "_pb2" not in p.name):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and (
                    "detokeniz" in node.name.lower() and isinstance(node, ast.ClassDef)
                    or node.name in ("check_stop", "token_stop_reason", "find_stop_string", "partial_stop_len")):
                defined.setdefault(node.name, []).append(str(path.relative_to(REPO)))
    assert defined == {"IncrementalDetokenizer": ["proto/detokenizer.py"], "token_stop_reason": ["proto/stop.py"],
                       "find_stop_string": ["proto/stop.py"], "partial_stop_len": ["proto/stop.py"]}


# -- one chat-template renderer (proto/chat.py) and the model files a worker sends (proto/model_files.py)
CONVERSATIONS = [
    [ChatMessage("user", "What is the capital of France?")],
    [ChatMessage("system", "You are terse."), ChatMessage("user", "Hi"), ChatMessage("assistant", "Hello."),
     ChatMessage("user", "Name three colors.")],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_as_transformers_does(model_path, tokenizer, messages, add_generation_prompt):
    ours = ChatTemplate.from_model_dir(model_path).render(messages, add_generation_prompt)
    theirs = tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in messages],
                                           add_generation_prompt=add_generation_prompt, tokenize=False)
    assert ours == theirs


def test_chat_template_errors_are_one_type():
    with pytest.raises(ChatTemplateError, match="does not parse"):
        ChatTemplate("{% if %}")
    with pytest.raises(ChatTemplateError, match="no system"):
        ChatTemplate("{{ raise_exception('no system') }}").render([ChatMessage("user", "x")])


def test_router_tokenizer_from_the_files_a_worker_sends(model_path, tokenizer):
    from router.tokenizer import RouterTokenizer

    chunks = list(file_chunks(model_path, chunk_bytes=256 * 1024))
    assert max(len(c.data) for c in chunks) <= 256 * 1024
    files = join_chunks(chunks)
    assert files["tokenizer.json"] == (model_path / "tokenizer.json").read_bytes()
    assert set(files) <= set(MODEL_FILES) and "tokenizer_config.json" in files
    tok = RouterTokenizer(files)
    text = "Hello 🙂 world, how are you?"
    assert tok.encode(text) == tokenizer(text)["input_ids"]
    rendered, ids = tok.encode_chat(CONVERSATIONS[0])
    assert ids == tokenizer.apply_chat_template([{"role": "user", "content": CONVERSATIONS[0][0].content}],
                                                add_generation_prompt=True, tokenize=True, return_dict=False)
    assert "tokenizer_dir" not in worker_pb2.WorkerInfo.DESCRIPTOR.fields_by_name  # no path on a worker's disk
    with pytest.raises(ValueError, match="unexpected model file"):
        join_chunks([worker_pb2.FileChunk(name="../../etc/passwd", data=b"")])


def test_a_temperature_below_sampling_eps_is_greedy():
    """temperature 1e-39 divided fp32 logits into +-inf: softmax NaN, token 0 every step (adversary)."""
    assert SamplingParams(temperature=1e-39).greedy and SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=1e-4).greedy

