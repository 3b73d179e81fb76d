"""pdserve generate: offline generation with the bundled model (or any supported checkpoint).

    pdserve generate --model smollm2-135m-instruct --chat "Name three primary colors."
    pdserve generate --chat --prompts-file prompts.jsonl --json      # one JSON object per prompt

Bad input (unknown model, unreadable path or prompts file, empty or too-long prompt, out-of-range
sampling values) raises UserError / InvalidRequest: deploy/cli.py prints one line, exit status 2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from deploy import runtime_options, status_cmd
from engine.errors import UserError
from engine.quantization import check_kv_cache_dtype, check_quantization
from proto.sampling import InvalidRequest, SamplingParams


OFFLINE_MAX_NUM_SEQS = 256   # engine.llm.LLM's default

def command(
    prompt: Optional[str] = typer.Argument(None, help="The prompt (or use --prompts-file)."),
    model: str = typer.Option("smollm2-135m-instruct", "--model", "-m",
                              help="Bundled model name, HF directory or .gguf file."),
    chat: bool = typer.Option(False, "--chat", help="Wrap each prompt in the chat template as one user message."),
    max_tokens: int = typer.Option(64, "--max-tokens", help="Most tokens to generate (>= 1)."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy (default); > 0 samples."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass, in (0, 1]."),
    top_k: int = typer.Option(0, "--top-k", help="Keep the k most likely tokens (0 = all)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Per-request seed (reproducible sampling)."),
    prompts_file: Optional[Path] = typer.Option(None, "--prompts-file",
                                                help='JSONL file, one {"prompt": "..."} per line.'),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON object per prompt."),
    url: Optional[str] = typer.Option(None, "--url", help="Send the prompts to a running pdserve router instead."),
    tls_ca: Optional[Path] = typer.Option(None, "--tls-ca", help="With --url: " + status_cmd.TLS_CA_HELP),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="With --url: " + status_cmd.API_KEY_HELP),
    quantization: str = typer.Option("none", "--quantization", help="Linear method: none, int8 or fp8."),
    kv_cache_dtype: str = typer.Option("auto", "--kv-cache-dtype", help="KV-cache dtype: auto or fp8_e4m3."),
    dtype: str = runtime_options.dtype_option(),
    threads_per_worker: Optional[int] = runtime_options.threads_option(),
    kv_cache_memory: Optional[str] = runtime_options.kv_memory_option(),
    num_blocks: Optional[int] = runtime_options.num_blocks_option(),
    max_num_batched_tokens: int = runtime_options.batched_tokens_option(8192),
) -> None:
    """Generate completions offline: all prompts run as one batch through the paged-cache forward."""
    check_quantization(quantization)
    check_kv_cache_dtype(kv_cache_dtype)
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, max_tokens=max_tokens)
    prompts = _read_prompts(prompt, prompts_file)
    if url is not None:  # the streaming gRPC client (router/client.py, no torch)
        from router.auth import resolve_api_key
        from router.client import print_generations

        try:
            print_generations(url, prompts, chat=chat, json_output=json_output, temperature=temperature,
                              top_p=top_p, top_k=top_k, seed=seed, max_tokens=max_tokens, tls_ca=tls_ca,
                              api_key=resolve_api_key(api_key))
        except ConnectionError as e:
            raise UserError(str(e)) from None
        except OSError as e:
            raise UserError(f"--tls-ca: cannot read {str(tls_ca)!r}: {e.strerror}") from None
        return
    from engine.model_loader import resolve_model

    model_dir = resolve_model(model)
    rt = runtime_options.resolve_runtime(model_dir=model_dir, dtype=dtype, threads_per_worker=threads_per_worker,
                                         kv_cache_memory=kv_cache_memory, num_blocks=num_blocks,
                                         max_num_batched_tokens=max_num_batched_tokens)
    if sys.stderr.isatty():  # scripted runs keep stderr for the one-line error (exit status 2)
        print(f"pdserve: {rt.describe()}", file=sys.stderr, flush=True)
    outputs = _generate_offline(model_dir, prompts, params, chat, rt, quantization, kv_cache_dtype)
    for out in outputs:
        if json_output:
            print(json.dumps({"prompt_token_ids": out.prompt_token_ids, "token_ids": out.token_ids,
                              "text": out.text, "finish_reason": out.finish_reason}), flush=True)
        else:
            print(out.text, flush=True)


def _generate_offline(model: Path, prompts: list[str], params: SamplingParams, chat: bool,
                      rt: "runtime_options.RuntimeOptions", quantization: str = "none",
                      kv_cache_dtype: str = "auto"):
    from engine.llm import LLM
    from engine.platform import bind_to_cores

    bind_to_cores(rt.cores[0] if rt.cores else None, rt.threads)
    # At most as many sequences as the budget has tokens (each running one decodes a token a step):
    # a small --max-num-batched-tokens runs fewer prompts at a time instead of failing.
    llm = LLM(model, dtype=rt.dtype, num_blocks=rt.num_blocks, kv_cache_memory_bytes=rt.kv_cache_memory_bytes,
              max_num_batched_tokens=rt.max_num_batched_tokens, quantization=quantization,
              kv_cache_dtype=kv_cache_dtype, max_num_seqs=min(OFFLINE_MAX_NUM_SEQS, rt.max_num_batched_tokens))
    return llm.generate(prompts, params, chat=chat)


def _read_prompts(prompt: str | None, prompts_file: Path | None) -> list[str]:
    if (prompt is None) == (prompts_file is None):
        raise UserError("give exactly one of a PROMPT argument or --prompts-file F.jsonl")
    if prompt is not None:
        if not prompt:
            raise InvalidRequest("prompt", "must not be empty")
        return [prompt]
    return _read_prompts_file(prompts_file)


def _read_prompts_file(path: Path) -> list[str]:
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read --prompts-file {str(path)!r}: {e.strerror if isinstance(e, OSError) else e}")
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{n}: not JSON ({e.msg}); each line must be {{\"prompt\": \"...\"}}")
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise UserError(f"{path}:{n}: each line must be an object with a string \"prompt\"")
        if not obj["prompt"]:
            raise InvalidRequest("prompt", f"must not be empty ({path}:{n})")
        prompts.append(obj["prompt"])
    if not prompts:
        raise UserError(f"--prompts-file {str(path)!r} has no prompts")
    return prompts
