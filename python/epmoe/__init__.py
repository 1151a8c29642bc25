# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""epmoe for Python: `epmoe.torch.MoE`, the expert-parallel MoE layer as a torch module.

    from epmoe.torch import MoE
    moe = MoE(hidden=1024, ffn=3584, experts=8, top_k=2)        # Mixtral's block
    y, losses = moe(x)                                           # x [T, 1024] float32

docs/pytorch.md covers install, the module, loading Hugging Face weights, ranks and stats.
"""

__all__ = ["menu"]


def menu():
    """The precompiled policy bundles: a list of dicts (router, top_k, expert, capacity,
    schedule, expert_tensors, trains)."""
    from . import _epmoe

    return _epmoe.menu()
