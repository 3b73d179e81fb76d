"""What `pdserve bench ablate` runs: the techniques, the serve flags of each configuration, and
the plan (the ladder, isolation and leave-one-out configurations). Pure: no I/O, no torch.

A configuration is a set of techniques applied to the baseline's ``ServeSettings``; it is
identified by that set, so one configuration that plays several roles (ladder rung 1 is also
"continuous batching in isolation") is served and measured once.

- **ladder**: baseline, then each technique added to the previous rung, in the given order
  (the field's order by default: batching, cache management, scheduling budget, quantization,
  speculation, disaggregation).
- **isolation** of T: the baseline + T (+ what T needs, e.g. speculative decoding needs
  continuous batching); its gain is read against the baseline + what T needs.
- **leave-one-out** of T: the full ladder minus T (and minus whatever needs T); its loss is
  read against the full ladder.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterable, Sequence

from engine.errors import UserError

DEFAULT_TUNED_BATCHED_TOKENS = 128   # deploy/runtime_options.py's measured serve default
UNTUNED_BATCHED_TOKENS = 2048        # vLLM's chunked-prefill default budget: no tuning


@dataclass(frozen=True)
class ServeSettings:
    """The `pdserve serve` flags a configuration differs in; ``args()`` renders them."""

    batching: str = "static"
    enable_prefix_caching: bool = False
    max_num_batched_tokens: int = UNTUNED_BATCHED_TOKENS
    quantization: str = "none"
    kv_cache_dtype: str = "auto"
    speculative_method: str | None = None
    num_speculative_tokens: int = 4
    mode: str = "agg"
    dtype: str = "auto"
    env: tuple[tuple[str, str], ...] = ()   # extra environment of the server (debug hooks)

    def args(self) -> list[str]:
        """The serve command-line flags, vLLM-named."""
        out = ["--batching", self.batching, "--mode", self.mode, "--dtype", self.dtype,
               "--enable-prefix-caching" if self.enable_prefix_caching else "--no-enable-prefix-caching",
               "--max-num-batched-tokens", str(self.max_num_batched_tokens),
               "--quantization", self.quantization, "--kv-cache-dtype", self.kv_cache_dtype]
        if self.speculative_method:
            out += ["--speculative-method", self.speculative_method,
                    "--num-speculative-tokens", str(self.num_speculative_tokens)]
        return out

    @property
    def quality_key(self) -> tuple:
        """What changes the model's numerics (perplexity is computed once per key, not per rung)."""
        return (self.dtype, self.quantization, self.kv_cache_dtype, self.env)


@dataclass(frozen=True)
class Technique:
    """One technique: a label, the settings it changes, what it needs, and its quality gate
    (``gate``: the key of its allowed perplexity increase; None = lossless, held to greedy agreement)."""

    name: str
    title: str
    changes: tuple[tuple[str, object], ...]
    requires: tuple[str, ...] = ()
    excludes: tuple[str, ...] = ()
    gate: str | None = None
    debug: bool = False   # never in a default plan

    def apply(self, s: ServeSettings) -> ServeSettings:
        return replace(s, **dict(self.changes))


def catalog(tuned_batched_tokens: int = DEFAULT_TUNED_BATCHED_TOKENS, num_speculative_tokens: int = 4,
            broken_scale_factor: float = 4.0) -> dict[str, Technique]:
    """Every technique, in the field's order."""
    techniques = [
        Technique("continuous", "continuous batching + paged KV", (("batching", "continuous"),)),
        Technique("prefix-caching", "prefix caching", (("enable_prefix_caching", True),), requires=("continuous",)),
        Technique("chunked-prefill", f"chunked-prefill budget tuned ({tuned_batched_tokens} tokens)",
                  (("max_num_batched_tokens", tuned_batched_tokens),), requires=("continuous",)),
        Technique("int8", "INT8 weights (W8A16/W8A8, per channel)", (("quantization", "int8"),),
                  excludes=("fp8", "fp8-broken"), gate="int8"),
        Technique("fp8", "FP8 E4M3 weights (W8A8, per channel)", (("quantization", "fp8"),),
                  excludes=("int8", "fp8-broken"), gate="fp8"),
        Technique("fp8-kv", "FP8 E4M3 KV cache", (("kv_cache_dtype", "fp8_e4m3"),), gate="fp8_kv"),
        Technique("spec", f"speculative decoding (ngram, adaptive k <= {num_speculative_tokens})",
                  (("speculative_method", "ngram"), ("num_speculative_tokens", num_speculative_tokens)),
                  requires=("continuous",)),
        Technique("disagg", "disaggregated prefill/decode (1P + 1D)", (("mode", "disagg"),), requires=("continuous",)),
        Technique("fp8-broken", f"debug: FP8 weights served with every scale x{broken_scale_factor:g}",
                  (("quantization", "fp8"), ("env", (("PDSERVE_DEBUG_FP8_SCALE_FACTOR", f"{broken_scale_factor:g}"),))),
                  excludes=("int8", "fp8"), gate="fp8", debug=True),
    ]
    return {t.name: t for t in techniques}


# The default ladder on a CPU host: FP8 weights and the FP8 KV cache are measured in isolation
# only (the CPU attention kernel sends FP8 KV to the torch reference, and INT8 is the weight
# format with native dot products here: AVX512-VNNI), so the rungs after quantization are not
# measured on a path this hardware does not run fast.
DEFAULT_LADDER = ("continuous", "prefix-caching", "chunked-prefill", "int8", "spec", "disagg")
DEFAULT_ISOLATION = ("int8", "fp8", "fp8-kv", "spec")
DEFAULT_LEAVE_ONE_OUT = ("int8", "spec")


@dataclass(frozen=True)
class ConfigPlan:
    """One configuration to serve: its techniques (ladder order) and the roles it plays."""

    name: str
    techniques: tuple[str, ...]
    settings: ServeSettings
    roles: tuple[str, ...] = field(default=())


def parse_names(text: str | None, flag: str, known: dict[str, Technique], default: Sequence[str]) -> tuple[str, ...]:
    """``"a,b"`` -> ("a", "b"); "" or "none" -> (); None -> default. UserError naming the flag."""
    if text is None:
        return tuple(default)
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if names in ((), ("none",)):
        return ()
    unknown = [n for n in names if n not in known]
    if unknown:
        raise UserError(f"{flag}: unknown technique(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    if len(set(names)) != len(names):
        raise UserError(f"{flag}: a technique is named twice in {text!r}")
    return names


def closure(names: Iterable[str], known: dict[str, Technique]) -> set[str]:
    """names plus everything they need, transitively."""
    out, todo = set(), list(names)
    while todo:
        n = todo.pop()
        if n not in out:
            out.add(n)
            todo.extend(known[n].requires)
    return out


def check_compatible(names: set[str], known: dict[str, Technique], flag: str) -> None:
    """UserError naming the first clash in catalog order (deterministic, whatever the set's order)."""
    for n in (x for x in known if x in names):
        clash = [x for x in known[n].excludes if x in names]
        if clash:
            raise UserError(f"{flag}: {n} and {clash[0]} cannot be combined (one weight format at a time)")


def build_plan(ladder: Sequence[str], isolation: Sequence[str], leave_one_out: Sequence[str],
               known: dict[str, Technique], base: ServeSettings | None = None) -> list[ConfigPlan]:
    """The configurations, each once, in run order: the ladder, then isolation, then leave-one-out.

    UserError if a ladder technique comes before one it needs, or two exclusive ones meet."""
    base = base or ServeSettings()
    order = {n: i for i, n in enumerate(known)}
    for i, n in enumerate(ladder):
        missing = [r for r in known[n].requires if r not in ladder[:i]]
        if missing:
            raise UserError(f"--techniques: {n} needs {missing[0]} before it in the ladder")
    check_compatible(set(ladder), known, "--techniques")
    missing = [n for n in leave_one_out if n not in ladder]
    if missing:
        raise UserError(f"--leave-one-out: {missing[0]} is not in the ladder (--techniques)")
    roles: dict[frozenset, list[str]] = {}

    def add(names: Iterable[str], role: str) -> None:
        roles.setdefault(frozenset(names), []).append(role)

    for i in range(len(ladder) + 1):
        add(ladder[:i], f"ladder:{i}")
    for n in isolation:
        add(closure(known[n].requires, known), f"isolation-reference:{n}")
        add(closure([n], known), f"isolation:{n}")
    for n in leave_one_out:
        add((x for x in ladder if n not in closure([x], known)), f"leave-one-out:{n}")
    plans = []
    for names, rs in roles.items():
        check_compatible(set(names), known, "--isolation")
        ordered = tuple(sorted(names, key=lambda x: (ladder.index(x) if x in ladder else len(ladder), order[x])))
        settings = base
        for n in ordered:
            settings = known[n].apply(settings)
        plans.append(ConfigPlan(config_name(ordered), ordered, settings, tuple(rs)))
    return plans


def config_name(techniques: Sequence[str]) -> str:
    return "baseline" if not techniques else "+".join(techniques)
