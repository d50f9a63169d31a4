"""The environment record every receipt embeds: git commit and dirty flag, Python/torch/CUDA/Triton versions, the
device and its compute capability, and the numerics flags (TF32, deterministic algorithms, matmul precision); and
the import path the notebooks' kernels start with (callers_import_path).
"""
from __future__ import annotations

import datetime as _dt
import importlib.metadata
import os
import platform
import re
import socket
import subprocess
from contextlib import contextmanager
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]   # lib/exactness/receipt/env.py -> the repository


def _git(args: list[str], cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True,
                          timeout=30).stdout.strip()


CODE_PATHS = ("lib", "notebooks", "scripts", "benchmarks", "tests", "Makefile", "pyproject.toml")


def git_state(path: Path | str = REPO_ROOT) -> dict:
    """Git state of the repository containing ``path``.

    Returns:
        ``{"sha": str|None, "short": str|None, "dirty": bool|None, "error": str (only when unknown)}``; ``dirty``
        counts modified and staged files, and untracked (not ignored) ones under CODE_PATHS: a user's prompt or
        engine file beside the code is no change of it. Never raises: no git, no repo or no commit
        yet give ``None`` values and an ``error`` message. Where the tree was copied with a stale ``.git`` or none
        (e.g. a working tree sent to a GPU machine with an older checkout's ``.git``), the caller states the commit
        in ``EXACTNESS_GIT_SHA`` (40 hex digits) and ``EXACTNESS_GIT_DIRTY`` (``0``/``1``); the record then
        holds that, ``"source": "EXACTNESS_GIT_SHA"`` and what git itself said under ``git_said``.
    """
    try:
        sha = _git(["rev-parse", "HEAD"], Path(path))
        dirty = bool(_git(["status", "--porcelain", "--untracked-files=no"], Path(path))
                     or _git(["status", "--porcelain", "--", *CODE_PATHS], Path(path)))
        said = {"sha": sha, "short": sha[:7], "dirty": dirty}
    except (OSError, subprocess.SubprocessError) as e:
        msg = getattr(e, "stderr", None) or str(e)
        said = {"sha": None, "short": None, "dirty": None, "error": msg.strip().splitlines()[-1] if msg else "?"}
    stated = os.environ.get("EXACTNESS_GIT_SHA", "")
    if stated and stated_commit_problem({"EXACTNESS_GIT_SHA": stated}) is None:
        return {"sha": stated, "short": stated[:7], "dirty": os.environ.get("EXACTNESS_GIT_DIRTY") == "1",
                "source": "EXACTNESS_GIT_SHA", "git_said": said}
    return said


def stated_commit_problem(environ) -> str | None:
    """What keeps ``environ``'s stated commit (git_state) out of the record, in one line, or None: EXACTNESS_GIT_SHA,
    when set, must be the full 40 lowercase hexadecimal digits (a short SHA is not taken), EXACTNESS_GIT_DIRTY, when
    set, 0 or 1."""
    sha, dirty = environ.get("EXACTNESS_GIT_SHA", ""), environ.get("EXACTNESS_GIT_DIRTY", "")
    if sha and not re.fullmatch(r"[0-9a-f]{40}", sha):
        return (f"EXACTNESS_GIT_SHA={sha!r}: the full commit is needed, 40 lowercase hexadecimal digits "
                "(git rev-parse HEAD); unset it to record what git says")
    if dirty and dirty not in ("0", "1"):
        return f"EXACTNESS_GIT_DIRTY={dirty!r}: 0 (the tree is the stated commit) or 1 (it has changes) is allowed"
    return None


# oneDNN's name for the instruction set that torch's ATEN_CPU_CAPABILITY names.
ONEDNN_ISA = {"default": "SSE41", "avx2": "AVX2"}


def match_onednn_isa() -> None:
    """Where ``ATEN_CPU_CAPABILITY`` lowers torch's kernels below this CPU's instruction set (``default`` or
    ``avx2``), cap oneDNN at the same level through ``ONEDNN_MAX_CPU_ISA``, unless the caller set it.

    Without the cap torch mixes lowered kernels with oneDNN kernels of the CPU's full instruction set, a pairing no
    real CPU produces, and some of them refuse to run together (bf16 attention then raises "pack_vnni2 is only
    supported when avx512 is supported"). Must run before torch is first imported; changes only the environment
    of this process and its children.
    """
    cap = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    if cap in ONEDNN_ISA:
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", ONEDNN_ISA[cap])


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def kernel_set_records(refs) -> list[dict] | None:
    """Each kernel set's provenance (kernels.provenance: its name, description, claims_exact and, for a
    ``module:ATTR`` set, the module's file, SHA-256 and package version), or None when ``refs`` is empty.

    Raises:
        ValueError: a set that does not resolve (the parameter check refused it before).
    """
    from ..kernels import provenance
    return [provenance(r) for r in refs] if refs else None


def environment() -> dict:
    """Record of where a receipt was made.

    Returns:
        dict with ``git`` (see :func:`git_state`), ``python``, ``torch``, ``cuda`` (torch's CUDA version or None),
        ``triton`` (None when not installed), ``device`` (GPU name, or the CPU name), ``compute_capability``
        (``"9.0"`` or None), ``numerics`` (TF32 flags, deterministic algorithms, float32 matmul precision),
        ``platform``, ``hostname`` and ``time_utc`` (ISO 8601). Raises nothing beyond torch's own import errors.
    """
    import torch

    cuda = torch.cuda.is_available()
    return {
        "git": git_state(REPO_ROOT),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": cuda,
        "triton": _version("triton"),
        "device": torch.cuda.get_device_name(0) if cuda else _cpu_name(),
        "compute_capability": ".".join(map(str, torch.cuda.get_device_capability(0))) if cuda else None,
        "numerics": {
            "cuda_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
            "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "cpu_threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA"),
        },
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "time_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


@contextmanager
def callers_import_path():
    """PYTHONPATH, while the notebooks' kernels start, such that they import what this process imports: its
    entries made absolute and this process's working folder appended (``python -m`` puts it on sys.path, so a
    ``package.module:ATTR`` kernel set or preset found here would be missing in a kernel started in notebooks/)."""
    old = os.environ.get("PYTHONPATH")
    parts = [os.path.abspath(p) for p in (old or "").split(os.pathsep) if p] + [os.getcwd()]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts))
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old
