"""Shared fixtures: the tiny preset's weights (built once per test run) and a short real prompt."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # as the Makefile: tiny kernels, no OpenMP spin-waits (before torch)
# Variables the suite reads as a user's settings: a test must not depend on the caller's (tests that need one set it
# with monkeypatch); removed for this process and every process it starts.
for _name in ("OUT", "EXACTNESS_GIT_SHA", "EXACTNESS_GIT_DIRTY"):
    os.environ.pop(_name, None)

from exactness.receipt.env import match_onednn_isa  # noqa: E402  (imports no torch)

match_onednn_isa()  # an emulated lower instruction set (ATEN_CPU_CAPABILITY) caps oneDNN too, before torch loads

import pytest  # noqa: E402
import torch  # noqa: E402

from exactness.config import get_preset  # noqa: E402
from exactness.prompts import build_prompt  # noqa: E402
from exactness.weights import synthetic_weights  # noqa: E402


# The quick tier (make test-quick: pytest -m "not slow") runs these modules, each test of which takes at most a few
# seconds on 2 cores, less the tests they mark @pytest.mark.slow; every test of any other module (notebooks through
# papermill, whole receipts, servers, other engines' models, contract and FP64 sweeps, fault matrices) is marked slow.
QUICK_MODULES = frozenset({
    "test_checkpoint", "test_comment_fits", "test_cuda_graphs", "test_cuda_kernels", "test_diff", "test_exact",
    "test_kernel_class", "test_mtp", "test_offload", "test_prompt_cache", "test_quant_weights", "test_registry",
    "test_report_plots", "test_routing", "test_side_by_side", "test_ulp",
})


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: more than a few seconds on 2 cores; left out by make test-quick")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.stem not in QUICK_MODULES:
            item.add_marker(pytest.mark.slow)


def pytest_ignore_collect(collection_path, config):
    """Under -m "not slow" the other modules are not even imported (their imports take a while)."""
    if config.getoption("markexpr") == "not slow" and collection_path.name.startswith("test_") \
            and collection_path.suffix == ".py" and collection_path.stem not in QUICK_MODULES:
        return True
    return None


@pytest.fixture(scope="session")
def tiny_weights():
    """tiny preset, bf16, CPU."""
    return synthetic_weights(get_preset("tiny"), dtype=torch.bfloat16)


@pytest.fixture(scope="session")
def code_prompt():
    """the `code` prompt cut to 160 tokens."""
    return build_prompt("code", max_tokens=160)


@pytest.fixture
def cpu_compile(monkeypatch, tmp_path):
    """fast_cuda with the fast set's compiled code forced for CPU tensors (_COMPILE["cpu"]), no graph compiled yet
    and every kernel untried, compiling into a cache folder of the test's own (Inductor's on-disk caches do not key
    CPU code by ATen's CPU capability: code cached under another can crash this run). Skips where Inductor cannot
    compile an RMSNorm in bf16 here, tried before anything is forced, so that a failure to compile after that is
    the code's: the tests assert it, not skip on it."""
    from exactness.kernels import fast_cuda
    from exactness.kernels.norm import _rms
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    x = torch.randn(4, 64).bfloat16()
    try:
        torch.compile(lambda a, w: _rms(a, w, 1e-6), fullgraph=True)(x, torch.ones(64, dtype=x.dtype))
    except Exception as e:  # noqa: BLE001 -- whatever Inductor raises where it cannot build here
        pytest.skip(f"Inductor cannot compile here: {type(e).__name__}: {str(e)[:160]}")
    monkeypatch.setitem(fast_cuda._COMPILE, "cpu", True)
    monkeypatch.setattr(fast_cuda, "_GRAPHS", {})
    for k in fast_cuda.STATUS:
        monkeypatch.setitem(fast_cuda.STATUS, k, "untried")
    return fast_cuda


@pytest.fixture
def cpu_grouped(monkeypatch):
    """fast_cuda with its grouped experts served on CPU tensors through torch's reference _grouped_mm
    (_STATE["cpu_grouped"]). Skips where this torch has no CPU _grouped_mm, tried first."""
    from exactness.kernels import fast_cuda
    x, w = torch.ones(4, 16, dtype=torch.bfloat16), torch.ones(2, 16, 16, dtype=torch.bfloat16)
    try:
        torch._grouped_mm(x, w.transpose(1, 2), offs=torch.tensor([2, 4], dtype=torch.int32))
    except (AttributeError, RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch._grouped_mm on CPU: {type(e).__name__}: {str(e)[:160]}")
    monkeypatch.setitem(fast_cuda._STATE, "cpu_grouped", True)
    return fast_cuda
