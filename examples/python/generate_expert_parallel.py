#!/usr/bin/env python3
# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""Greedy generation with a whole transformers 5 MoE model whose experts are split over
processes by epmoe (epmoe.hf.expert_parallel), against the same model unmodified.

Each process builds the same tiny model (transformers' own config class, seeded random
weights: nothing is downloaded) or loads --model DIR (a local checkpoint, float32), keeps an
unmodified copy as the reference, and hands the model to epmoe.hf.expert_parallel: its
experts modules keep only this rank's experts (E/N of them); attention, routers, shared
experts and dense layers stay transformers' own, replicated. Every process generates from
the same prompt; the experts of each layer compute 1/N of the rows on each process and
exchange tokens over gloo. Prints the tokens, whether they equal the reference's, the
largest logit difference, and each process's expert bytes. Exit code 1 if the tokens differ.

    python examples/python/generate_expert_parallel.py [--procs 2] [--family deepseek_v3]
    torchrun --nproc_per_node 2 examples/python/generate_expert_parallel.py [...]

(with build/venv/bin/python and PYTHONPATH=build/default/python, where epmoe is built.)
"""
import argparse
import copy
import datetime
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# family -> (config class, model class, fields): tiny, 8 experts, top-2
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
            num_local_experts=8, num_experts=8, n_routed_experts=8, num_experts_per_tok=2,
            n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, norm_topk_prob=True,
            eos_token_id=None, pad_token_id=0, tie_word_embeddings=False,
            initializer_range=0.1)
FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),  # biased, clamped, interleaved experts
}


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--procs", type=int, default=2, help="processes (ignored under torchrun)")
    p.add_argument("--family", default="deepseek_v3", choices=sorted(FAMILIES))
    p.add_argument("--model", help="a local transformers checkpoint instead of a tiny model")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--timeout", type=float, default=120, help="seconds a collective may wait")
    return p.parse_args()


def build(args):
    import transformers

    if args.model:
        return transformers.AutoModelForCausalLM.from_pretrained(
            args.model, dtype=torch.float32).eval()
    cfg_name, model_name = FAMILIES[args.family]
    C = getattr(transformers, cfg_name)
    fields = set(getattr(C, "attribute_map", {}))
    for k in C.__mro__:
        fields |= set(getattr(k, "__annotations__", {}))
    torch.manual_seed(0)  # every process: the same weights
    config = C(**{k: v for k, v in TINY.items() if k in fields})
    return getattr(transformers, model_name)(config).eval()


def generate(model, ids, n):
    out = model.generate(ids, max_new_tokens=n, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    return out.sequences, torch.stack(out.logits)


def run(rank, world, args):
    from epmoe import hf

    torch.set_num_threads(1)  # the processes share the cores
    model = build(args)
    reference = copy.deepcopy(model)  # unmodified: every expert, transformers' own loop
    full = hf.expert_bytes(model)
    hf.expert_parallel(model, dist.group.WORLD, exchange_timeout=args.timeout)
    mine = hf.expert_bytes(model)

    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(3, vocab, (1, 8), generator=torch.Generator().manual_seed(1))
    want, want_logits = generate(reference, ids, args.new_tokens)
    got, logits = generate(model, ids, args.new_tokens)
    same = torch.equal(got, want)
    diff = (logits - want_logits).abs().max().item() / want_logits.abs().max().item()

    per_rank = [None] * world
    dist.all_gather_object(per_rank, (mine, sorted(hf.local_experts(model).items())[0]))
    if rank == 0:
        print(f"{args.model or args.family}: {world} processes (gloo)")
        print(f"tokens: {got[0, ids.shape[1]:].tolist()}")
        print(f"tokens equal the unmodified model's: {'yes' if same else 'NO'}; "
              f"max |logit diff| / max |logit| = {diff:.2e}")
        for r, (b, (name, experts)) in enumerate(per_rank):
            print(f"rank {r}: expert bytes {b} of {full} ({b / full:.0%}); {name} holds "
                  f"experts {experts}")
    return same


def worker(rank, world, path, args, failed):
    dist.init_process_group("gloo", init_method="file://" + path, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    try:
        if not run(rank, world, args):
            failed.set()
    finally:
        dist.destroy_process_group()


def main():
    args = parse()
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
        ok = run(dist.get_rank(), dist.get_world_size(), args)
        dist.destroy_process_group()
        sys.exit(0 if ok else 1)
    ctx = mp.get_context("spawn")
    failed = ctx.Event()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(args.procs, os.path.join(tmp, "rendezvous"), args,
                                         failed), nprocs=args.procs, start_method="spawn")
    sys.exit(1 if failed.is_set() else 0)


if __name__ == "__main__":
    main()
