"""The batch-invariant GEMMs' tile configurations (triton_gemm, triton_moe): one fixed config per weight shape,
dtype and GPU architecture, never per M, and the placements a small call may take instead.

A shape's config (from (N, K), the dtype and the architecture) fixes BLOCK_K and split_k: the order of a row's
accumulation. Tile placement may depend on M: which program computes which tile, the persistent grid, and on sm_90
the tile's rows and columns, warps and pipeline stages (PLACEMENTS: small-M bf16 calls take smaller tiles). A
placement carries no BLOCK_K or split_k of its own (it overrides only PLACEMENT_FIELDS of the shape's config). That
it changes no byte is a property of the GPU's MMA, measured on sm_90 (``tl.dot`` gave each output element the same
bytes from 16-row ``mma.sync`` tiles as from 64- and 128-row ``wgmma`` tiles), not a guarantee: every entry must
pass the GPU test tests/test_cuda_kernels.py runs on its architecture (each placement gives every row the shape
config's bytes).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


SPLIT_LOOPS = ("runs", "fold", "flat")   # GemmConfig.split_loop; the index is the kernels' SPLIT_LOOP


@dataclass(frozen=True)
class GemmConfig:
    """One tile configuration: a weight shape's config (chosen per shape and architecture, never per M), or one of
    its placements (the same BLOCK_K and split_k; PLACEMENTS).

    Attributes:
        block_m, block_n, block_k: tile sizes (rows of x, rows of w, reduction step); powers of two >= 16.
        num_stages: software-pipelining depth; num_warps: warps per program.
        persistent: one program per SM looping over tiles (True) or one program per tile (False).
        group_m: tiles of this many M-blocks are walked N-first (L2 reuse; no effect on any tile's bytes).
        tma: load through TMA tensor descriptors (sm_90+ only).
        warp_specialize: ask Triton to warp-specialize the persistent loop (experimental on Hopper).
        split_k: K is cut into this many runs of whole BLOCK_K chunks; each run's partial is accumulated from zero
            and the partials are added in run order in fp32 (no atomic adds), whether the runs go to parallel programs
            (small M: more programs than tiles) or one program does them in turn (large M: no partial buffer).
            Part of the shape's fixed config, so decode and prompt rows share it.
        split_loop: how one program does its runs in turn (the same operations in the same order, so the same
            bytes): ``"runs"`` one K loop per run; ``"fold"`` one K loop over every chunk, the running partial
            added to the total at each run's last chunk (one software pipeline across the runs); ``"flat"`` the run
            loop and its K loops flattened into one by Triton (``tl.range(flatten=True)``).
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_stages: int = 4
    num_warps: int = 8
    persistent: bool = False
    group_m: int = 8
    tma: bool = True
    warp_specialize: bool = False
    split_k: int = 1
    split_loop: str = "runs"

    def __post_init__(self) -> None:
        if not isinstance(self.split_k, int) or self.split_k < 1:
            raise ValueError(f"split_k must be an int >= 1, got {self.split_k!r}")
        if self.split_loop not in SPLIT_LOOPS:
            raise ValueError(f"split_loop must be one of {', '.join(SPLIT_LOOPS)}; got {self.split_loop!r}")

    def label(self) -> str:
        """Short id such as ``128x128x64 s4 w8 P tma``."""
        flags = ("P" if self.persistent else "NP") + (" tma" if self.tma else " ptr")
        flags += " ws" if self.warp_specialize else ""
        if self.split_k > 1:
            flags += f" k/{self.split_k}" + (f" {self.split_loop}" if self.split_loop != "runs" else "")
        return f"{self.block_m}x{self.block_n}x{self.block_k} s{self.num_stages} w{self.num_warps} {flags}"

    def smem_bytes(self, elem: int, gate_up: bool = False) -> int:
        """Shared memory of the pipelined operand buffers (bytes; Triton adds a little for barriers/epilogue)."""
        per_stage = (self.block_m + self.block_n * (2 if gate_up else 1)) * self.block_k * elem
        return per_stage * self.num_stages


# Per (kind, N, K, dtype, arch) tile configs. Keys never contain M (that would break invariance). "sm90" = H100/
# H200, "sm120" = RTX 50xx class (99 KB shared memory per block, mma.sync), "other" = everything else (pointer
# loads, no TMA). Entries for the `small` preset's shapes were chosen on an H200 by benchmarks/bench_gpu_kernels.py.
_LINEAR_DEFAULTS: dict[tuple[str, str], GemmConfig] = {
    ("16bit", "sm90"): GemmConfig(128, 128, 64, 4, 8, persistent=True),
    ("16bit", "sm120"): GemmConfig(128, 128, 32, 3, 8),
    ("16bit", "other"): GemmConfig(128, 128, 32, 3, 8, tma=False),
    ("fp32", "sm90"): GemmConfig(64, 64, 32, 3, 4),
    ("fp32", "sm120"): GemmConfig(64, 64, 32, 2, 4),
    ("fp32", "other"): GemmConfig(64, 64, 32, 2, 4, tma=False),
    # CPU interpreter (tests): small tiles keep the interpreted programs cheap.
    ("16bit", "interp"): GemmConfig(32, 32, 16, 1, 4),
    ("fp32", "interp"): GemmConfig(32, 32, 16, 1, 4),
}
# The fused gate/up kernel loads two B tiles per stage: on the GPUs it takes the linear tile with half the block_n,
# the same shared memory (GemmConfig.smem_bytes); the interpreter's tiles are small already.
_DEFAULTS: dict[tuple[str, str, str], GemmConfig] = {
    **{("linear", *k): c for k, c in _LINEAR_DEFAULTS.items()},
    **{("gate_up", *k): c if k[1] == "interp" else replace(c, block_n=c.block_n // 2)
       for k, c in _LINEAR_DEFAULTS.items()},
}
# Chosen on an H200: the tiles by benchmarks/bench_gpu_kernels.py --tune (per shape, the candidate with the best
# GEMM/cuBLAS ratio at M = 4096 and 16384; its candidates have no split), split_k per shape by the decode-step time
# (bench_gpu_kernels.py --sections decode_step), and q, k/v and o's split_loop, program layout and q's stages by
# GPU time / cuBLAS at M = 1 to 16384 (benchmarks/bench_split_k.py --part configs). The split makes a decode row (one
# tile per BLOCK_N columns, a few programs for 132 SMs) run split_k times as many programs; it is part of
# the shape's config, so prompt rows use the same split (one program per tile running the runs in turn: q, k/v and
# o fold them into one K loop, one software pipeline across the runs), and the fused gate/up's tile by the decode
# step and the one-chunk prefill (benchmarks/bench_gpu_goals.py). Small calls take the shape's PLACEMENTS below
# instead of these tiles. The ratios this table reaches, with the commands that measure them, are in
# docs/figures.md.
SHAPE_CONFIGS: dict[tuple[str, int, int, str, str], GemmConfig] = {
    ("linear", 4096, 2048, "16bit", "sm90"): GemmConfig(128, 128, 64, 5, 8, split_k=4, split_loop="fold"),  # q
    ("linear", 512, 2048, "16bit", "sm90"): GemmConfig(128, 128, 64, 4, 8, split_k=8, split_loop="fold"),   # k, v
    ("linear", 2048, 4096, "16bit", "sm90"): GemmConfig(128, 128, 64, 4, 8, split_k=8, split_loop="fold"),  # o
    ("linear", 768, 2048, "16bit", "sm90"): GemmConfig(128, 256, 64, 3, 8, persistent=True),    # gate|up alone
    ("linear", 2048, 768, "16bit", "sm90"): GemmConfig(128, 256, 64, 3, 8, persistent=True),    # down
    ("linear", 128, 2048, "16bit", "sm90"): GemmConfig(128, 128, 64, 4, 8, split_k=8),                   # router
    ("linear", 258, 2048, "16bit", "sm90"): GemmConfig(128, 64, 64, 4, 4, split_k=4),                    # lm_head
    ("gate_up", 768, 2048, "16bit", "sm90"): GemmConfig(128, 64, 64, 4, 8),                     # fused gate/up
}


# What a placement may change: how a tile is laid out and run, never BLOCK_K or split_k (the row's arithmetic).
PLACEMENT_FIELDS = ("block_m", "block_n", "num_warps", "num_stages", "persistent", "group_m", "warp_specialize")
_SMALL = dict(num_warps=4, num_stages=4, persistent=False)
# Per (kind, N, K, "bf16", arch): (rows, overrides) in ascending rows; a call of at most ``rows`` rows takes the
# shape's config with those fields replaced, a larger call the config itself. The shape's config has 128-row tiles
# for prompts; a small call in them does a 128-row tile's MMA work on few programs. Chosen on an H200 by GPU time at
# M = 1 to 512 (benchmarks/bench_split_k.py --part placements, which also compares every candidate's bytes with the
# config's; docs/figures.md has the figures); the router's and lm_head's 16-row entries by a decode step's GPU time.
PLACEMENTS: dict[tuple[str, int, int, str, str], tuple[tuple[int, dict], ...]] = {
    ("linear", 4096, 2048, "bf16", "sm90"): ((16, dict(_SMALL, block_m=16)), (512, dict(_SMALL, block_m=64))),
    ("linear", 512, 2048, "bf16", "sm90"): ((16, dict(_SMALL, block_m=16, block_n=64)),
                                           (512, dict(_SMALL, block_m=64, block_n=64))),
    ("linear", 2048, 4096, "bf16", "sm90"): ((16, dict(_SMALL, block_m=16)), (512, dict(_SMALL, block_m=64))),
    ("linear", 768, 2048, "bf16", "sm90"): ((512, dict(_SMALL, block_m=64, block_n=64)),),
    ("linear", 2048, 768, "bf16", "sm90"): ((512, dict(_SMALL, block_m=64, block_n=64)),),
    ("linear", 128, 2048, "bf16", "sm90"): ((16, dict(_SMALL, block_m=16, block_n=128)),    # one tile: triton_router
                                           (512, dict(_SMALL, block_m=64, block_n=64))),
    ("linear", 258, 2048, "bf16", "sm90"): ((16, dict(_SMALL, block_m=16)), (256, dict(_SMALL, block_m=64))),
    ("gate_up", 768, 2048, "bf16", "sm90"): ((512, dict(_SMALL, block_m=64, block_n=32)),),
}


def _pkey(dtype: torch.dtype) -> str | None:
    """The dtype key of the placement tables: bf16 only (the dtype their bytes were measured in)."""
    return "bf16" if dtype == torch.bfloat16 else None


def check_placement(where: str, rows: list, overrides: list[dict], fields: tuple = PLACEMENT_FIELDS) -> None:
    """Raise ValueError (naming ``where``, a table entry) unless ``rows`` ascend as positive ints and every override
    dict changes only ``fields`` (the rest fix a row's arithmetic). Shared by this module's, triton_moe's and
    triton_attention's placement tables."""
    if rows != sorted(set(rows)) or any(not isinstance(r, int) or r < 1 for r in rows):
        raise ValueError(f"{where}: rows must be ascending positive ints, got {rows}")
    bad = sorted(set().union(*overrides) - set(fields))
    if bad:
        raise ValueError(f"{where} overrides {bad}: a placement may change only {', '.join(fields)} "
                         "(the other fields fix a row's arithmetic)")


def _check_placements(table: dict) -> None:
    """Raise ValueError for an entry that overrides a field outside PLACEMENT_FIELDS or whose rows do not ascend."""
    for key, entries in table.items():
        check_placement(f"PLACEMENTS[{key}]", [r for r, _ in entries], [over for _, over in entries])


_check_placements(PLACEMENTS)


def placements(kind: str, N: int, K: int, dtype: torch.dtype, capability: tuple[int, int]
               ) -> tuple[tuple[int, GemmConfig], ...]:
    """(rows, config) per placement of a weight shape, rows ascending: the shape's config (config_for) with the
    placement's fields replaced; then (inf, the shape's config) for larger calls."""
    base = config_for(kind, N, K, dtype, capability)
    entries = PLACEMENTS.get((kind, N, K, _pkey(dtype), arch_of(capability)), ())
    return tuple((r, replace(base, **over)) for r, over in entries) + ((float("inf"), base),)


def arch_of(capability: tuple[int, int]) -> str:
    """``"sm90"`` for compute capability 9.x, ``"sm120"`` for 12.x, ``"interp"`` for (0, 0) (the CPU
    interpreter), else ``"other"``."""
    if capability == (0, 0):
        return "interp"
    return {9: "sm90", 12: "sm120"}.get(capability[0], "other")


def _dkey(dtype: torch.dtype) -> str:
    return "fp32" if dtype == torch.float32 else "16bit"


def config_for(kind: str, N: int, K: int, dtype: torch.dtype, capability: tuple[int, int]) -> GemmConfig:
    """The fixed config of a weight shape: SHAPE_CONFIGS entry if any, else the (kind, dtype, arch) default.

    Args:
        kind: ``"linear"`` or ``"gate_up"``; N, K: weight rows and columns; capability: (major, minor).
    Raises:
        ValueError: unknown kind.
    """
    if kind not in ("linear", "gate_up"):
        raise ValueError(f"GEMM kind must be 'linear' or 'gate_up', got {kind!r}")
    arch, dk = arch_of(capability), _dkey(dtype)
    return SHAPE_CONFIGS.get((kind, N, K, dk, arch)) or _DEFAULTS[(kind, dk, arch)]


def with_config(kind: str, N: int, K: int, dtype: torch.dtype, arch: str, cfg: GemmConfig) -> None:
    """Pin ``cfg`` as one weight shape's config (what the tuned table below does); the key has no M by construction.
    Its placements (PLACEMENTS) still replace their fields for small calls. Plans made before keep the old config."""
    if arch not in ("sm90", "sm120", "other", "interp"):
        raise ValueError(f"arch must be 'sm90', 'sm120', 'other' or 'interp', got {arch!r}")
    SHAPE_CONFIGS[(kind, N, K, _dkey(dtype), arch)] = replace(cfg)
