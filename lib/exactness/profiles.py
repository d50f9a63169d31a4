"""Run profiles: which preset, device, prompts, step sizes and kernel sets a receipt run uses.

A profile holds literals only; ``make receipts PROFILE=<name>`` picks one and the receipt runner passes its fields
to each notebook's papermill ``parameters`` cell (names are validated against the notebook first).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .lookup import lookup


@dataclass(frozen=True)
class Profile:
    """One receipt configuration.

    Attributes:
        name: profile name (``ci``, ``standard``, ``full``, ``gpu``).
        preset: model preset (config.PRESETS).
        device: ``"cpu"`` or ``"cuda"``.
        dtype: storage dtype of weights and activations, ``"bfloat16"`` or ``"float32"`` (accumulation is fp32).
        prompts: prompt names (prompts.PROMPTS).
        prompt_max_tokens: cut every prompt to at most this many tokens (None = the full prompt).
        steps: prefill step sizes (tokens per chunk / segment); at least one is not a multiple of 64.
        gen_tokens: greedy tokens generated per run (end-of-sequence ignored).
        deep_threshold: the deep path serves segments of at least this many rows; shorter ones go batched.
        kernel_sets: kernel sets to run (kernels.registry.KERNEL_SETS).
        weights: projection weights, ``"bf16"`` (as stored) or quantized ``"int4_g128"`` / ``"nvfp4"``
            (kernels/quant.py).
        kv_dtype: what the KV cache stores: ``"bf16"`` (the storage dtype), ``"fp8_e4m3"`` or ``"fp8_e4m3_block"``
            (cache.py).
        extra: further notebook parameters as (name, literal) pairs, e.g. the bench's cold-prefill lengths; each
            notebook receives only the names it declares.
        side_by_side: how many sections that time nothing (sections.Section.timed False) a receipt run executes
            at once, each notebook in its own kernel process (a GPU host has the cores and memory for several);
            the timed sections then run one at a time, alone. 1 = every section in table order, one at a time.
            A run setting, not a notebook parameter.
    """

    name: str
    preset: str
    device: str
    dtype: str
    prompts: tuple[str, ...]
    prompt_max_tokens: int | None
    steps: tuple[int, ...]
    gen_tokens: int
    deep_threshold: int
    kernel_sets: tuple[str, ...]
    extra: tuple[tuple[str, object], ...] = ()
    weights: str = "bf16"
    kv_dtype: str = "bf16"
    side_by_side: int = 1

    def parameters(self) -> dict:
        """Notebook parameters: the fields but side_by_side, and ``extra``, as JSON-friendly literals (tuples
        become lists)."""
        out = {}
        for f in dataclasses.fields(self):
            if f.name == "side_by_side":
                continue
            v = getattr(self, f.name)
            out[f.name] = list(v) if isinstance(v, tuple) else v
        out["profile"] = out.pop("name")
        for k, v in out.pop("extra"):
            out[k] = list(v) if isinstance(v, tuple) else v
        return out


# Step sizes on both sides of the 64-row tile and of 128: a fault that shows only at some call sizes shows here.
SWEEP = (63, 64, 65, 127, 128, 129)
# The engine features in the kernel contract and the FP64 section (standard and full; the ci profile keeps its
# contract and FP64 at bf16 weights and runs the features in the hash matrix only; grouped routing is a control).
FEATURES = (("contract_weights", ("bf16", "int4_g128", "nvfp4")), ("contract_router_groups", (4, 1)),
            ("fp64_weights", ("bf16", "int4_g128", "nvfp4")))
# The hash matrix's repeat test of engines under test on the CPU profiles: one prompt 24 times, alone and 8 in flight, 16 tokens each.
REPEAT_SMALL = (("engine_repeat", 24), ("engine_repeat_concurrency", (1, 8)), ("engine_repeat_tokens", 16))

PROFILES: dict[str, Profile] = {
    "ci": Profile(name="ci", preset="tiny", device="cpu", dtype="bfloat16", prompts=("short", "code", "docs"),
                  prompt_max_tokens=300, steps=(128, 100), gen_tokens=32, deep_threshold=100,
                  kernel_sets=("fast", "invariant"),
                  extra=(("contract_sweep", "quick"), ("contract_dtypes", ("bfloat16",)), ("fp64_rows", 16),
                         ("stream_counts", (1, 2, 4)),
                         ("bench_step", 128), ("bench_reps", 2), ("bench_itl_reps", 2),
                         ("bench_cold_lengths", (128, 256)), ("hash_sweep_steps", SWEEP),
                         ("hash_fp32_control", True), ("hash_features", True), ("contract_router_groups", (4, 1))
                         ) + REPEAT_SMALL),
    "standard": Profile(name="standard", preset="tiny", device="cpu", dtype="bfloat16",
                        prompts=("short", "code", "docs"), prompt_max_tokens=1024, steps=(256, 200), gen_tokens=64,
                        deep_threshold=128, kernel_sets=("fast", "invariant"),
                        extra=(("contract_sweep", "quick"), ("contract_dtypes", ("bfloat16",)), ("fp64_rows", 32),
                               ("stream_counts", (1, 2, 4)), ("stream_prompt_tokens", 256), ("bench_step", 256),
                               ("bench_reps", 2), ("bench_itl_reps", 2), ("bench_cold_lengths", (512, 2048)),
                               ("hash_sweep_steps", SWEEP), ("hash_fp32_control", True),
                               ("hash_features", True)) + FEATURES + REPEAT_SMALL),
    "full": Profile(name="full", preset="tiny", device="cpu", dtype="bfloat16", prompts=("short", "code", "docs"),
                    prompt_max_tokens=None, steps=(1024, 1000), gen_tokens=192, deep_threshold=512,
                    kernel_sets=("fast", "invariant"),
                    extra=(("contract_sweep", "full"), ("contract_dtypes", ("bfloat16",)), ("fp64_rows", 32),
                           ("bench_itl_reps", 2), ("stream_prompt_tokens", 512), ("bench_step", 2048),
                           ("bench_cold_lengths", (2048, 8192, 30000)), ("hash_sweep_steps", SWEEP),
                           ("hash_fp32_control", True), ("hash_features", True)) + FEATURES),
    "gpu": Profile(name="gpu", preset="small", device="cuda", dtype="bfloat16", prompts=("short", "code", "docs"),
                   prompt_max_tokens=None, steps=(2048, 1000), gen_tokens=64, deep_threshold=512,
                   kernel_sets=("fast", "invariant"),
                   # A decode step is bound by kernel launches, not GPU work, so the exactness sections generate
                   # 64 tokens. The hash matrix runs the full prompts, its serial oracle included (each prompt row
                   # one decode step, replayed from a CUDA graph: hash_graphs), and repeats only the batched/deep
                   # runs offloaded (their replies still decode with offloaded experts); concurrent streams use
                   # 256-token prompts; the fast set, the contract's negative control, gets the quick sweep. The
                   # bench keeps its definitions (full prompts, 192 generated tokens) with 2 ITL repetitions. The
                   # four untimed sections run side by side (one kernel process each), then the bench alone.
                   side_by_side=4,
                   extra=(("contract_sweep", "full"), ("contract_control_sweep", "quick"),
                          ("contract_dtypes", ("bfloat16",)), ("fp64_rows", 32), ("stream_prompt_tokens", 256),
                          ("bench_step", 2048), ("bench_gen_tokens", 192),
                          ("bench_itl_reps", 2),
                          ("hash_offload", (False, True)), ("hash_offload_paths", ("batched", "deep")),
                          ("bench_cold_lengths", (2048, 8192, 30000)),
                          ("engine_repeat", 1000), ("engine_repeat_concurrency", (1, 8, 64)),
                          ("engine_repeat_tokens", 64))),
}

DEFAULT_PROFILE = "standard"


def get_profile(name: str) -> Profile:
    """Return the profile called ``name``.

    Raises:
        ValueError: unknown name; the message lists the known profiles.
    """
    return lookup(PROFILES, name, "profile", known_as="known profiles")
