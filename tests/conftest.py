"""Shared fixtures: the tiny preset's weights (built once per session) and a short real prompt."""
import pytest
import torch

from exactness.config import get_preset
from exactness.prompts import build_prompt
from exactness.weights import synthetic_weights


@pytest.fixture(scope="session")
def tiny_weights():
    """tiny preset, bf16, CPU."""
    return synthetic_weights(get_preset("tiny"), dtype=torch.bfloat16)


@pytest.fixture(scope="session")
def code_prompt():
    """the `code` prompt cut to 160 tokens."""
    return build_prompt("code", max_tokens=160)
