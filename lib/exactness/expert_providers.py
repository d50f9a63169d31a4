"""Where model.moe_block gets the routed experts' weights: the ExpertProvider protocol and its default,
ResidentExperts (the model's own layer weights); offload.ExpertStore is the other provider.
"""
from __future__ import annotations

from typing import Protocol

import torch

from .weights import LayerWeights


class ExpertProvider(Protocol):
    """Where moe_block gets the routed experts' weights: ResidentExperts (the default) or offload.ExpertStore.

    Attributes:
        deep_ready: whether the deep plan can run; False when the provider could not reserve the device buffers
            the deep plan stages experts through (paths.prefill then serves deep segments with the batched plan).
        fallback_reason: why deep_ready is False (None when it is True).
    """

    deep_ready: bool
    fallback_reason: str | None

    def prepare(self, layer: int, expert_ids: list[int], plan: str) -> None:
        """Announce the experts with members in this MoE call (ascending ids: the order ``fetch`` is then asked
        in) and the forward's plan kind (``"decode"``, ``"batched"`` or ``"deep"``)."""
        ...

    def fetch(self, layer: int, expert_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w_gate [I, H], w_up [I, H], w_down [H, I]) of one expert on the compute device, storage dtype."""
        ...

    # Optional: stacked(layer, plan, idx [M, k], accept) -> (w_gate [E, I, H], w_up [E, I, H], w_down [E, H, I]) |
    # None, the whole layer for a set that computes all routed experts in one launch (None: fetch expert by expert);
    # accept(w_gate, w_up, w_down) says whether that launch serves such weights, asked before anything is staged.


class ResidentExperts:
    """The default expert provider: experts read from resident layer weights (views of the stacked tensors, no
    copy), so nothing needs staging and the deep plan is always available."""

    deep_ready: bool = True
    fallback_reason: str | None = None

    def __init__(self, layers: list[LayerWeights]):
        self.layers = layers

    def prepare(self, layer: int, expert_ids: list[int], plan: str) -> None:
        """Nothing to stage: resident experts are on the device already."""

    def fetch(self, layer: int, expert_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views (w_gate [I, H], w_up [I, H], w_down [H, I]) of expert ``expert_id`` of ``layer``."""
        lw = self.layers[layer]
        return lw.w_gate[expert_id], lw.w_up[expert_id], lw.w_down[expert_id]

    def stacked(self, layer: int, plan: str, idx: torch.Tensor, accept=None) -> tuple | None:
        """The layer's stacked experts (w_gate [E, I, H], w_up [E, I, H], w_down [E, H, I]) on any plan; None for
        quantized weights (not plain tensors). Nothing is staged, so ``accept`` is left to the caller's kernel."""
        lw = self.layers[layer]
        return (lw.w_gate, lw.w_up, lw.w_down) if torch.is_tensor(lw.w_gate) else None
