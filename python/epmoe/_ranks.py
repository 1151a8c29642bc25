# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""What epmoe.torch.MoE and Experts share at construction: the placement table, the group the
layer exchanges on (and where a failing rank tells its peers), the common size checks, the
experts' tensor shapes and a table router's arguments."""
from __future__ import annotations

import datetime
import inspect

import torch

# Each expert kind's tensors, in the layer's order, and their shapes ([slots, rows, cols]).
EXPERT_TENSORS = {
    "swiglu": ("w1", "w3", "w2"),
    "mlp_relu": ("w1", "w2"),
    "mlp_relu_bias": ("w1", "w2", "b1", "b2"),
    # GPT-OSS: clamped SwiGLU ((up + 1) * gate * sigmoid(1.702 gate), clamp 7) with biases.
    "gpt_oss": ("w1", "w3", "w2", "b1", "b3", "b2"),
    # DeepSeek-V4: SwiGLU with the gate clamped above and up clamped both ways at 10.
    "deepseek_v4": ("w1", "w3", "w2"),
}
# Routers whose gate has a learned logit bias: the parameter gate_bias [E].
GATE_BIAS_ROUTERS = ("gpt_oss",)


def _placement_table(placement, experts: int, ranks: int):
    """phy_to_log of a placement: "block", "round_robin" or a list (one expert per slot)."""
    L = experts // ranks
    if placement == "block":
        return list(range(experts))
    if placement == "round_robin":
        return [j * ranks + r for r in range(ranks) for j in range(L)]
    if isinstance(placement, str):
        raise ValueError(f"epmoe: placement = {placement!r}: must be 'block', 'round_robin' or a "
                         "list of the logical expert of each slot")
    table = [int(e) for e in placement]
    if sorted(table) != list(range(experts)):
        raise ValueError(f"epmoe: placement = {table}: must hold each of the {experts} experts "
                         "once (replicas are not in the torch module yet)")
    return table


def _check_sizes(hidden, ffn, experts, top_k, max_tokens, expert, group, exchange_group, ranks):
    """The arguments MoE and Experts share, checked by name; returns the ranks R."""
    if group is not None and ranks is not None:
        raise ValueError("epmoe: pass group (torch.distributed ranks) or ranks (threads), not both")
    if exchange_group is not None and group is None:
        raise ValueError("epmoe: exchange_group needs group (the torch.distributed ranks)")
    R = group.size() if group is not None else (ranks or 1)
    for name, v in (("hidden", hidden), ("ffn", ffn), ("experts", experts), ("top_k", top_k),
                    ("max_tokens", max_tokens)):
        if int(v) < 1:
            raise ValueError(f"epmoe: {name} = {v}: must be >= 1")
    if experts % R:
        raise ValueError(f"epmoe: experts = {experts}: must be a multiple of the ranks ({R})")
    if expert not in EXPERT_TENSORS:
        raise ValueError(f"epmoe: expert = {expert!r}: must be one of {sorted(EXPERT_TENSORS)}")
    return R


_abort_keys = {}  # global ranks -> modules built over them in this process


def _exchange_group(group, exchange_group, exchange_timeout: float):
    """The group the layer exchanges on, the store where a failing rank tells its peers, and
    that layer's key there. By default a group of its own over group's ranks (new_group), so
    that the user's collectives on group (DDP's gradient buckets) never pair with its
    all-to-alls; its gloo timeout (past the layer's deadline) ends a given-up exchange."""
    import torch.distributed as dist

    try:
        ranks = sorted(dist.get_process_group_ranks(group))
    except Exception:  # noqa: BLE001 - a group torch.distributed did not make
        ranks = None
    if exchange_group is None:
        kw = {"backend": dist.get_backend(group)}
        if exchange_timeout > 0:
            kw["timeout"] = datetime.timedelta(seconds=2 * exchange_timeout + 10)
        if ranks is None:
            raise ValueError("epmoe: group was not made by torch.distributed: pass "
                             "exchange_group= (a group over the same ranks, or group itself)")
        if len(ranks) == dist.get_world_size():
            exchange_group = dist.new_group(**kw)  # every process builds the module: all call it
        elif "use_local_synchronization" in inspect.signature(dist.new_group).parameters:
            exchange_group = dist.new_group(ranks, use_local_synchronization=True, **kw)
        else:
            raise ValueError(
                f"epmoe: group holds {len(ranks)} of the job's {dist.get_world_size()} processes: "
                "this torch's new_group must be called by every process with the same ranks, so "
                "the module cannot make a group of its own here: pass exchange_group= (made with "
                "torch.distributed.new_group on every process, or group itself to share it)")
    elif (exchange_group.size(), exchange_group.rank()) != (group.size(), group.rank()):
        raise ValueError(f"epmoe: exchange_group has rank {exchange_group.rank()} of "
                         f"{exchange_group.size()}: must match group's ({group.rank()} of "
                         f"{group.size()})")
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store (MPI): the deadline alone bounds a wait
        return exchange_group, None, ""
    # The peers build their modules over these ranks in the same order: the same key.
    where = ",".join(map(str, ranks)) if ranks is not None else f"size {group.size()}"
    n = _abort_keys[where] = _abort_keys.get(where, 0) + 1
    return exchange_group, store, f"epmoe/abort/{where}/{n}"


def _shape(name: str, n: int, hidden: int, ffn: int):
    return {"w1": (n, ffn, hidden), "w3": (n, ffn, hidden), "w2": (n, hidden, ffn),
            "b1": (n, 1, ffn), "b3": (n, 1, ffn), "b2": (n, 1, hidden)}[name]


def _table_args(table, top_k: int) -> dict:
    """A table router's [vocab, top_k] expert ids (DeepSeek-V4's tid2eid) as the layer's
    arguments; the layer checks every entry and keeps its own copy."""
    if table is None:
        return {}
    t = torch.as_tensor(table)
    if t.dim() != 2 or t.shape[1] != top_k or t.is_floating_point():
        raise ValueError(f"epmoe: router_table has shape {tuple(t.shape)} ({t.dtype}): must be "
                         f"integer [vocab, top_k = {top_k}]")
    return dict(table=t.to(torch.int32).reshape(-1).tolist(), vocab=int(t.shape[0]))
