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


@pytest.fixture(scope="session")
def tiny_weights():
    """tiny preset, bf16, CPU."""
    return synthetic_weights(get_preset("tiny"), dtype=torch.bfloat16)


@pytest.fixture(scope="session")
def code_prompt():
    """the `code` prompt cut to 160 tokens."""
    return build_prompt("code", max_tokens=160)
