"""A small streaming client of the public gRPC API (used by `pdserve generate --url` and
`pdserve status`). No torch.

    with RouterClient("127.0.0.1:50051") as c:
        for msg in c.generate(prompt="Hi", chat=True, max_tokens=32, temperature=0.0):
            print(msg.text, end="")

TLS (a router serving `pdserve serve --tls-cert C --tls-key K`): ``tls_ca`` names the PEM file
the router's certificate is verified against (for a self-signed one, the certificate itself);
a ``grpcs://`` URL without it verifies against the system's roots. ``api_key`` (a router with
--api-key): sent as ``authorization: Bearer KEY`` metadata on every call.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import grpc

from proto.pdserve.v1 import api_pb2, api_pb2_grpc


def router_channel(url: str, tls_ca: str | Path | None = None) -> grpc.Channel:
    """A channel to the router at url (HOST:PORT, grpc://, grpcs:// or http(s)://): TLS when
    tls_ca is given or the scheme is grpcs/https. OSError when tls_ca cannot be read."""
    secure = tls_ca is not None or url.startswith(("grpcs://", "https://"))
    target = url
    for scheme in ("grpcs://", "grpc://", "https://", "http://"):
        target = target.removeprefix(scheme)
    if not secure:
        return grpc.insecure_channel(target)
    roots = Path(tls_ca).read_bytes() if tls_ca is not None else None
    return grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=roots))


class RouterClient:
    def __init__(self, url: str, timeout_s: float | None = None, *, tls_ca: str | Path | None = None,
                 api_key: str | None = None) -> None:
        """Raises OSError when tls_ca cannot be read (see the module docstring)."""
        self._channel = router_channel(url, tls_ca)
        self._stub = api_pb2_grpc.GenerationStub(self._channel)
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        self.timeout_s = timeout_s

    def __enter__(self) -> "RouterClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def generate(self, prompt: str, *, chat: bool = False, model: str = "", system: str | None = None,
                 **sampling) -> Iterator[api_pb2.GenerateResponse]:
        """Stream responses; sampling: temperature, top_p, top_k, seed, max_tokens, stop, ignore_eos.

        Raises grpc.RpcError with the server's status (INVALID_ARGUMENT names the bad field).
        """
        req = api_pb2.GenerateRequest(model=model, sampling=api_pb2.SamplingOptions(
            **{k: v for k, v in sampling.items() if v is not None}))
        if chat:
            if system is not None:
                req.chat.messages.add(role="system", content=system)
            req.chat.messages.add(role="user", content=prompt)
        else:
            req.prompt = prompt
        yield from self._stub.Generate(req, timeout=self.timeout_s, metadata=self._metadata)

    def list_models(self) -> list[api_pb2.Model]:
        return list(self._stub.ListModels(api_pb2.ListModelsRequest(), timeout=self.timeout_s,
                                          metadata=self._metadata).models)

    def cluster_status(self) -> api_pb2.ClusterStatusResponse:
        return self._stub.ClusterStatus(api_pb2.ClusterStatusRequest(), timeout=self.timeout_s,
                                        metadata=self._metadata)

    def wait_ready(self, timeout_s: float) -> None:
        """Block until the health service says SERVING; raises TimeoutError."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        import time

        stub = health_pb2_grpc.HealthStub(self._channel)
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"router not serving after {timeout_s:.0f} s")


def print_generations(url: str, prompts: list[str], *, chat: bool, json_output: bool, model: str = "",
                      show_ttft: bool = True, timeout_s: float | None = 600.0, tls_ca: str | Path | None = None,
                      api_key: str | None = None, **sampling) -> None:
    """`pdserve generate --url`: stream each prompt's answer to stdout as it arrives.

    Text mode prints the deltas as they come, then a line with the server-side TTFT and the usage
    on stderr; --json prints one object per prompt (token ids, text, finish reason, usage, ttft).
    Raises UserError-like RuntimeError on a gRPC error (the CLI prints it on one line).
    """
    import json
    import sys

    with RouterClient(url, timeout_s=timeout_s, tls_ca=tls_ca, api_key=api_key) as client:
        for prompt in prompts:
            ids, text, ttft, last = [], [], 0.0, None
            try:
                for msg in client.generate(prompt, chat=chat, model=model, **sampling):
                    ids += msg.token_ids
                    text.append(msg.text)
                    ttft = ttft or msg.ttft_seconds
                    last = msg
                    if not json_output:
                        print(msg.text, end="", flush=True)
            except grpc.RpcError as e:
                raise ConnectionError(f"{url}: {e.code().name}: {e.details()}") from None
            usage = last.usage if last is not None else None
            if json_output:
                print(json.dumps({"token_ids": ids, "text": "".join(text), "finish_reason": last.finish_reason,
                                  "ttft_s": ttft, "prompt_tokens": usage.prompt_tokens,
                                  "completion_tokens": usage.completion_tokens}), flush=True)
            else:
                print(flush=True)
                if show_ttft:
                    print(f"[TTFT {ttft * 1000:.0f} ms, {usage.completion_tokens} tokens, "
                          f"finish {last.finish_reason}]", file=sys.stderr, flush=True)
