# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""The pack_weights option of MoE and Experts: which packed copy a module reads, and when
(docs/quantisation.md)."""
from __future__ import annotations

import torch

from .quantised import format_group


def _viewable(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.dim() == 2 and t.is_contiguous()



# And the group-wise formats: "int4" (group 32), "int4_g128", "int4_asym", "int4_asym_g128",
# "int8_g32" (epmoe.quantised.format_group).
PACK_WEIGHTS = ("auto", True, False, "bf16", "int8", "fp8", "mxfp4")
# Packed copies that compute the forward only (and the group-wise formats).
INFERENCE_FORMATS = ("int8", "fp8", "mxfp4")


def _pack_option(pack_weights):
    """pack_weights checked: PACK_WEIGHTS or a group-wise format (else ValueError)."""
    if not (any(pack_weights is v or (isinstance(v, str) and pack_weights == v)
                for v in PACK_WEIGHTS) or format_group(pack_weights)):
        raise ValueError(f"epmoe: pack_weights = {pack_weights!r}: must be 'auto', True, "
                         "False, 'bf16', 'int8', 'fp8', 'mxfp4' or a group-wise format ('int4', "
                         "'int4_g128', 'int4_asym', 'int4_asym_g128', 'int8_g32')")
    return pack_weights


def _pack_format(pack_weights) -> str:
    """The layer's packed format for a pack_weights option that packs."""
    return pack_weights if isinstance(pack_weights, str) and pack_weights != "auto" else "fp32"


def _packs(pack_weights, training: bool) -> bool:
    """Whether a module with this option reads packed copies in this mode."""
    return (pack_weights is True or (isinstance(pack_weights, str) and pack_weights != "auto")
            or (pack_weights == "auto" and not training))


DISPATCH_ROWS = ("activations", "int8")


def _refuse_training(pack_weights, training: bool):
    """int8, group-wise, fp8 and mxfp4 copies compute the forward only: a pass in training mode
    is an error."""
    if (pack_weights in INFERENCE_FORMATS or format_group(pack_weights)) and training:
        raise RuntimeError(f"epmoe: pack_weights = {pack_weights!r} is for inference (forward "
                           "only) and the module is in training mode: call .eval(), or pack as "
                           "True or 'bf16' to train")
