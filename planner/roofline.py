"""A worker profile from hardware figures, for planning fleets on hardware not at hand.

Roofline estimates, not measurements: a decode step reads every weight once plus each running
request's KV context (memory-bound), a prefill computes 2 × parameters FLOPs per prompt token
(compute-bound), each at a stated efficiency of the vendor's peak. Use a measured profile
(``pdserve profile``) wherever the hardware exists; this one states what it assumes.

Figures for the built-in GPU profile (vendor data sheets):
- NVIDIA H200 SXM: 4.8 TB/s HBM3e, 989 TFLOP/s dense BF16 (NVIDIA H200 Tensor Core GPU datasheet).
- Llama-3-8B: 8.03 B parameters, 32 layers, 8 KV heads × 128 head dim (Meta model card);
  BF16 weights 16.06 GB; KV per token 2 × 32 × 8 × 128 × 2 B = 128 KiB.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.profile import DecodePoint, PrefillPoint, WorkerProfile


@dataclass(frozen=True)
class Hardware:
    name: str
    hbm_bytes_per_s: float
    bf16_flops: float


@dataclass(frozen=True)
class ModelShape:
    name: str
    params: float
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden: int
    dtype_bytes: int = 2

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


H200 = Hardware("NVIDIA H200 SXM", 4.8e12, 989e12)
LLAMA3_8B = ModelShape("Llama-3-8B", 8.03e9, 32, 8, 128, 4096)


def roofline_profile(hw: Hardware = H200, model: ModelShape = LLAMA3_8B, *, bandwidth_efficiency: float = 0.7,
                     compute_efficiency: float = 0.5, step_overhead_ms: float = 2.0,
                     isls: tuple[int, ...] = (128, 512, 1024, 2048, 4096, 8192),
                     batches: tuple[int, ...] = (1, 8, 32, 64, 128, 256),
                     contexts: tuple[int, ...] = (512, 2048, 8192)) -> WorkerProfile:
    """The profile one worker of ``model`` on one ``hw`` would have under the stated efficiencies."""
    bw, flops = hw.hbm_bytes_per_s * bandwidth_efficiency, hw.bf16_flops * compute_efficiency
    prefill = []
    for isl in isls:
        # 2 FLOPs per parameter per token, plus causal attention's 2 × 2 × L × isl² / 2 × hidden.
        work = 2 * model.params * isl + 2 * model.num_layers * isl * isl * model.hidden
        ms = 1000 * work / flops + step_overhead_ms
        prefill.append(PrefillPoint(isl, ms, isl / (ms / 1000)))
    decode = []
    for ctx in contexts:
        for b in batches:
            ms = 1000 * (model.weight_bytes + b * ctx * model.kv_bytes_per_token) / bw + step_overhead_ms
            decode.append(DecodePoint(b, ctx, ms, b / (ms / 1000)))
    meta = {"source": "roofline", "hardware": hw.name, "model": model.name,
            "bandwidth_efficiency": bandwidth_efficiency, "compute_efficiency": compute_efficiency,
            "step_overhead_ms": step_overhead_ms}
    return WorkerProfile(tuple(prefill), tuple(decode), meta)
