"""Typed parameters: one frozen dataclass per receipt section, checked when it is built.

:class:`Common` holds the profile's fields every section reads (profiles.Profile); each section class adds the
section's own parameters with their defaults. ``__post_init__`` refuses a bad value with one line naming the value
and what is allowed, so a run is refused before anything runs, whichever entry point built the object: the command
line, the receipt runner (both build it from the merged parameters) or a notebook (``run_section(dict)``, which goes
through :meth:`Common.from_dict`).

The section table (sections.SECTIONS) names each section's class; the parameter names a section accepts anywhere
are its class's fields. The checks of the hash matrix's engine fields are in params_engines.py; the checks every
section shares (check_common, ParamError) in params_check.py. This module imports no analysis (the analyses import it); the checks
that need a model module import it when they run, so that importing this module stays cheap.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

from .params_engines import check_engine_fields
from .params_check import ParamError, at_least, check_bool, check_common, offload_weights, positive_int
from .profiles import PROFILES

PARAMS_CLASSES: list[type] = []   # every section's parameters class (Common's subclasses), in definition order


@dataclass(frozen=True, kw_only=True)
class Common:
    """The profile's fields (profiles.Profile documents each). None means not given: a section refuses a None in
    a field it ``NEEDS``; the others it does not read. ``profile`` only names the run."""

    SECTION: ClassVar[str] = ""
    NEEDS: ClassVar[tuple[str, ...]] = ("preset", "device", "dtype", "prompts", "steps", "gen_tokens",
                                        "deep_threshold", "kernel_sets")

    profile: str = ""
    preset: str | None = None
    device: str | None = None
    dtype: str | None = None
    prompts: list[str] | None = None
    prompt_max_tokens: int | None = None
    steps: list[int] | None = None
    gen_tokens: int | None = None
    deep_threshold: int | None = None
    kernel_sets: list[str] | None = None
    weights: str = "bf16"
    kv_dtype: str = "bf16"

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        PARAMS_CLASSES.append(cls)

    def needs(self) -> tuple[str, ...]:
        """The fields it refuses as None: NEEDS."""
        return self.NEEDS

    def __post_init__(self) -> None:
        missing = [k for k in self.needs() if getattr(self, k) is None]
        if missing:
            raise ParamError(f"{self.SECTION} section parameter(s) {', '.join(map(repr, missing))} missing; profile "
                             "fields are required")
        check_common({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    def check_lengths(self, max_positions: int, model: str = "the model") -> None:
        """Refuse a length of the section's own that passes ``max_positions`` (none here; the bench's cold
        prefills have one). Raises ParamError."""

    def values(self) -> dict:
        """Every field and its value (the run's parameters as the section reads them)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def own_names(cls) -> tuple[str, ...]:
        """The section's own parameter names (its fields beyond the common ones)."""
        common = {f.name for f in dataclasses.fields(Common)}
        return tuple(f.name for f in dataclasses.fields(cls) if f.name not in common)

    @classmethod
    def names(cls) -> set[str]:
        """Every parameter name of the section, common ones included."""
        return {f.name for f in dataclasses.fields(cls)}

    @classmethod
    def from_dict(cls, values: dict):
        """The typed parameters from a dict (a notebook's, or the command line's merged profile and overrides):
        names of this class are taken, names another section takes are left to it, any other name is refused."""
        if isinstance(values, cls):
            return values
        mine = cls.names()
        unknown = sorted(set(values) - mine - known_names())
        if unknown:
            raise ParamError(f"unknown parameter {unknown[0]!r} for section {cls.SECTION}; allowed: "
                             f"{', '.join(sorted(mine))}")
        return cls(**{k: v for k, v in values.items() if k in mine})


def offload_modes(offload) -> list[bool]:
    """The expert-offload modes to run: False (resident) always first, since it gives the oracle; ``offload`` is a
    bool or a list of bools.

    Raises:
        ValueError: anything else.
    """
    modes = offload if isinstance(offload, (list, tuple)) else [offload]
    if not all(isinstance(m, bool) for m in modes):
        raise ParamError(f"offload must be true, false or a list of them, got {offload!r}")
    return [False] + ([True] if True in modes else [])


def check_offload_paths(paths) -> list[str]:
    """The paths whose runs are repeated with offloaded experts: a non-empty list drawn from decode/batched/deep.

    Raises:
        ValueError: anything else (names the bad value and the allowed ones).
    """
    from .paths import PATHS

    if (not isinstance(paths, (list, tuple)) or not paths or any(p not in PATHS for p in paths)):
        raise ParamError(f"hash_offload_paths must be a non-empty list drawn from {list(PATHS)}, got {paths!r}")
    return list(paths)


@dataclass(frozen=True, kw_only=True)
class HashesParams(Common):
    """The hash matrix (analysis/hashes.py documents each parameter): our engine's, or with ``engine`` (engine
    specs: engines/__init__.py) the matrix, stream equalities, bench, repeat test and dumps of the engines named."""

    SECTION: ClassVar[str] = "hashes"

    checkpoint: str = ""
    allow_unpinned: bool = False
    hash_offload: bool | list[bool] = False
    hash_offload_paths: list[str] | None = None
    hash_max_tokens: int | None = None
    hash_rerun: bool = True
    hash_sweep_steps: list[int] = field(default_factory=list)
    hash_sweep_prompt: str = "code"
    hash_sweep_tokens: int = 300
    hash_fp32_control: bool = False
    hash_features: bool = False
    hash_graphs: bool = True
    engine: list[str] = field(default_factory=list)
    engine_streams: bool = True
    engine_bench: bool = False
    engine_cold_lengths: list[int] = field(default_factory=lambda: [256, 1024])
    engine_repeat: int = 0
    engine_repeat_concurrency: list[int] = field(default_factory=lambda: [1, 8])
    engine_repeat_prompt: str | None = None
    engine_repeat_tokens: int = 32
    engine_repeat_configs: list[str] = field(default_factory=list)
    engine_repeat_only: bool = False
    engine_dumps: str = "off"

    def needs(self) -> tuple[str, ...]:
        """Engines under test need fewer fields: they bring their own model and kernels."""
        return ("device", "dtype", "prompts", "steps", "gen_tokens") if self.engine else self.NEEDS

    def __post_init__(self) -> None:
        if isinstance(self.engine, str):
            object.__setattr__(self, "engine", self.engine.split())
        super().__post_init__()
        check_engine_fields(self)
        offload_weights("hash_offload", True in offload_modes(self.hash_offload), self.weights)
        if self.hash_offload_paths is not None:
            check_offload_paths(self.hash_offload_paths)
        cut = self.max_tokens
        if cut is not None and not positive_int(cut):
            raise ParamError(f"hash_max_tokens / prompt_max_tokens must be a positive int or None, got {cut!r}")
        check_bool("hash_rerun", self.hash_rerun)
        check_bool("hash_fp32_control", self.hash_fp32_control)
        check_bool("hash_features", self.hash_features)
        check_bool("hash_graphs", self.hash_graphs)
        if not isinstance(self.hash_sweep_steps, (list, tuple)) or not all(
                positive_int(s) for s in self.hash_sweep_steps):
            raise ParamError(f"hash_sweep_steps must be a list of positive ints (tokens), got {self.hash_sweep_steps!r}")
        at_least("hash_sweep_tokens", self.hash_sweep_tokens, 2)
        from .prompts import PROMPTS
        if self.hash_sweep_prompt not in PROMPTS:
            raise ParamError(f"hash_sweep_prompt {self.hash_sweep_prompt!r} is not a prompt; allowed: "
                             f"{', '.join(PROMPTS)}")

    @property
    def max_tokens(self) -> int | None:
        """This section's prompt cut: hash_max_tokens, else prompt_max_tokens."""
        return self.hash_max_tokens or self.prompt_max_tokens


@dataclass(frozen=True, kw_only=True)
class ContractParams(Common):
    """The kernel contract (analysis/contract/check.py documents each parameter). It draws synthetic inputs of the
    preset's shapes, so the profile's fields have defaults here and prompts, steps and tokens are not read."""

    SECTION: ClassVar[str] = "contract"
    NEEDS: ClassVar[tuple[str, ...]] = ()

    preset: str = "tiny"
    device: str = "cpu"
    dtype: str = "bfloat16"
    contract_sweep: str = "full"
    contract_dtypes: list[str] | None = None
    contract_control_sweep: str | None = None
    contract_classes: list[str] | None = None
    contract_offload: bool = True
    contract_weights: list[str] = field(default_factory=lambda: ["bf16"])
    contract_router_groups: list[int] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        from .kernels.quant import WEIGHT_FORMATS

        w = self.contract_weights
        if (not isinstance(w, (list, tuple)) or not w or any(f not in WEIGHT_FORMATS for f in w)
                or len(set(w)) != len(w)):
            raise ParamError(f"contract_weights={w!r} is not allowed; allowed: a non-empty list of distinct "
                             f"formats drawn from {', '.join(WEIGHT_FORMATS)}")
        g = self.contract_router_groups
        if g is None:
            return
        if not isinstance(g, (list, tuple)) or len(g) != 2 or not all(positive_int(v) for v in g):
            raise ParamError(f"contract_router_groups={g!r} is not allowed; allowed: null (the preset's routing) "
                             "or [n_groups, topk_groups], two positive ints")
        from .config import get_preset
        try:
            get_preset(self.preset).replace(n_groups=g[0], topk_groups=g[1])
        except ValueError as e:
            raise ParamError(f"contract_router_groups={list(g)!r} does not fit preset {self.preset!r}: {e}") from None


@dataclass(frozen=True, kw_only=True)
class Fp64Params(Common):
    """The FP64 per-class receipt (analysis/fp64/section.py run_section documents each parameter)."""

    SECTION: ClassVar[str] = "fp64"
    NEEDS: ClassVar[tuple[str, ...]] = ("preset", "device", "dtype", "prompts", "steps", "deep_threshold",
                                        "kernel_sets")

    fp64_rows: int = 64
    fp64_cert: int = 12
    fp64_tokens: int | None = None
    fp64_prompt: str | None = None
    fp64_synthetic: bool = True
    fp64_k_max: int = 16384
    fp64_synth_rows: int = 128
    fp64_fp32_sweep: bool = True
    fp64_synth_classes: list[str] | None = None
    fp64_extra_positions: list[int] = field(default_factory=list)
    fp64_weights: list[str] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if int(self.fp64_rows) < 1 or int(self.fp64_cert) < 1:
            raise ParamError(f"fp64_rows and fp64_cert must be >= 1, got {self.fp64_rows}, {self.fp64_cert}")
        from .kernels.quant import WEIGHT_FORMATS

        w = self.fp64_weights
        if w is not None and (not isinstance(w, (list, tuple)) or not w or len(set(w)) != len(w)
                              or any(f not in WEIGHT_FORMATS for f in w)):
            raise ParamError(f"fp64_weights={w!r} is not allowed; allowed: null (the profile's weights) or a "
                             f"non-empty list of distinct formats drawn from {', '.join(WEIGHT_FORMATS)}")

    @property
    def weight_formats(self) -> list[str]:
        """The weights formats the section judges: fp64_weights, else the profile's ``weights``."""
        return list(self.fp64_weights or [self.weights])


@dataclass(frozen=True, kw_only=True)
class StreamsParams(Common):
    """Drafted, resumed and concurrent streams (analysis/streams.py documents each parameter).
    ``stream_prompt_tokens`` None becomes a quarter of prompt_max_tokens within 8..256 (256 without a cut)."""

    SECTION: ClassVar[str] = "streams"

    mtp_k: int = 2
    stream_counts: list[int] = field(default_factory=lambda: [1, 2, 4])
    prompt_cache_gib: float = 1.0
    stream_offset: int = 2
    stream_prompt_tokens: int | None = None
    prefill_path: str = "batched"
    drafts: list[str] = field(default_factory=lambda: ["mtp", "self"])
    checkpoint: str = ""
    allow_unpinned: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        from .batch import BATCH_LIMIT, check_streams
        from .mtp import check_k
        from .prompt_cache import PromptCache

        check_k(self.mtp_k)
        for n in self.stream_counts:
            check_streams(n, self.stream_offset, BATCH_LIMIT)
        PromptCache(self.prompt_cache_gib, "any")  # validates the budget
        bad = [d for d in self.drafts if d not in ("mtp", "self")]
        if bad:
            raise ParamError(f"unknown draft sources {bad}; allowed: mtp, self")
        if self.stream_prompt_tokens is None:   # derived once here, so every reader sees the same length
            pm = self.prompt_max_tokens
            object.__setattr__(self, "stream_prompt_tokens", min(256, max(8, pm // 4)) if pm else 256)


@dataclass(frozen=True, kw_only=True)
class BenchParams(Common):
    """The bench tables (analysis/bench.py documents each parameter). ``bench_gen_tokens``, when set, replaces
    gen_tokens: the bench's tables are defined at their own reply length."""

    SECTION: ClassVar[str] = "bench"
    NEEDS: ClassVar[tuple[str, ...]] = ("preset", "device", "dtype", "prompts", "gen_tokens", "deep_threshold",
                                        "kernel_sets")

    bench_gen_tokens: int | None = None
    bench_path: str = "deep"
    bench_step: int | None = 2048
    bench_reps: int = 2
    bench_itl_reps: int = 3
    bench_cold_lengths: list[int] = field(default_factory=lambda: [2048, 8192, 30000])
    bench_graphs: bool = True
    offload: bool = False
    checkpoint: str = ""
    allow_unpinned: bool = False

    def __post_init__(self) -> None:
        from .paths import PATHS

        if self.bench_gen_tokens is not None:
            object.__setattr__(self, "gen_tokens", self.bench_gen_tokens)
        super().__post_init__()
        if self.bench_path not in PATHS:
            raise ParamError(f"bench_path {self.bench_path!r} is not a path; allowed: {', '.join(PATHS)}")
        if self.bench_step is not None:
            at_least("bench_step", self.bench_step)
        for name in ("bench_reps", "bench_itl_reps", "gen_tokens"):
            at_least(name, getattr(self, name))
        check_bool("offload", self.offload)
        offload_weights("offload", self.offload, self.weights)
        if not isinstance(self.bench_cold_lengths, (list, tuple)):
            raise ParamError(f"bench_cold_lengths must be a list of ints (tokens), got {self.bench_cold_lengths!r}")
        for n in self.bench_cold_lengths:
            at_least("every bench_cold_lengths entry", n, 2)
        check_bool("bench_graphs", self.bench_graphs)

    def check_lengths(self, max_positions: int, model: str = "the model") -> None:
        """Refuse a cold length whose prompt and reply pass ``max_positions`` (``model`` names it in the message).

        Raises:
            ParamError: naming the length, the positions it needs, the limit and the lengths allowed.
        """
        room = max_positions - self.gen_tokens
        for n in self.bench_cold_lengths:
            if n > room:
                raise ParamError(
                    f"bench: bench_cold_lengths entry {n} with {self.gen_tokens} generated tokens is "
                    f"{n + self.gen_tokens} positions, past the max_positions={max_positions} of {model}; "
                    + (f"allowed lengths: 2..{room}" if room >= 2 else "the generated tokens leave no room"))


@dataclass(frozen=True, kw_only=True)
class DumpsParams(Common):
    """Tensor dumps of an engine (analysis/dumps_section.py): ``dumps`` is the dump set's folder (docs/dumps.md;
    "" = none given, which the section refuses when it runs), ``dumps_fp64`` adds the FP64 per-class error to the
    contract."""

    SECTION: ClassVar[str] = "dumps"
    NEEDS: ClassVar[tuple[str, ...]] = ()

    dumps: str = ""
    dumps_fp64: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        import os

        if not isinstance(self.dumps, str) or (self.dumps and not os.path.isfile(os.path.join(self.dumps,
                                                                                         "manifest.json"))):
            raise ParamError(f"dumps={self.dumps!r} is not a dump set; allowed: a folder holding manifest.json "
                             "(docs/dumps.md)")
        check_bool("dumps_fp64", self.dumps_fp64)


def known_names() -> set[str]:
    """Every parameter name some section takes: the fields of every parameters class defined (sections.py imports
    each section's class) and every name a profile sets (a profile's dict holds every section's values)."""
    return ({f.name for cls in PARAMS_CLASSES for f in dataclasses.fields(cls)}
            | {k for prof in PROFILES.values() for k in prof.parameters()})
