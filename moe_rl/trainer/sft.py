"""SFT warm start: teacher-forced training on a task's demonstrations.

Shape legend: B = demonstrations, T = padded prompt + response tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moe_rl.dist import all_reduce
from moe_rl.tasks.base import make_rng

if TYPE_CHECKING:
    from moe_rl.megatron.optim import Optimizer
    from moe_rl.megatron.parallel import ParallelInfo
    from moe_rl.megatron.policy import Policy
    from moe_rl.tasks.base import Task
    from moe_rl.tasks.tokenizer import Tokenizer


def encode_pair(tok: Tokenizer, prompt: str, response: str | None, max_len: int) -> tuple[list[int], int]:
    """``<bos> prompt`` (+ ``response <eos>``) ids truncated to ``max_len``, and the prompt length."""
    bos = [tok.bos_id] if getattr(tok, "bos_id", None) is not None else []
    prompt_ids = bos + tok.encode(prompt)
    response_ids = [] if response is None else tok.encode(response) + [tok.eos_id]
    ids = (prompt_ids + response_ids)[:max_len]
    return ids, min(len(prompt_ids), max_len)


def pad_batch(rows: list[list[int]], pad_id: int) -> torch.Tensor:
    """Right-pad id lists to ``[B, T]`` int64."""
    t = max(len(row) for row in rows)
    out = torch.full((len(rows), t), pad_id, dtype=torch.int64)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.int64)
    return out


def sft_batch(task: Task, tok: Tokenizer, *, step: int, batch_size: int, seed: int, max_len: int):
    """Demonstrations of SFT step ``step`` as ``tokens_BT`` and a response ``mask_BT``."""
    demo_seed = make_rng("sft", seed, step).randrange(2**31)
    rows, plens = [], []
    for prompt, response in task.demonstrations(batch_size, demo_seed):
        ids, plen = encode_pair(tok, prompt, response, max_len)
        rows.append(ids)
        plens.append(plen)
    tokens = pad_batch(rows, tok.pad_id)
    pos = torch.arange(tokens.shape[1])[None, :]
    lens = torch.tensor([len(row) for row in rows])[:, None]
    mask = ((pos >= torch.tensor(plens)[:, None]) & (pos < lens)).float()
    return tokens, mask


def sft_step(
    policy: Policy, optimizer: Optimizer, tokens_BT: torch.Tensor, mask_BT: torch.Tensor, info: ParallelInfo
) -> dict[str, float]:
    """One optimizer step of token-mean NLL on this rank's data-parallel share of the batch."""
    rows = tokens_BT.shape[0] // info.dp_size
    sl = slice(info.dp_rank * rows, (info.dp_rank + 1) * rows)
    tokens, mask = tokens_BT[sl], mask_BT[sl].to(info.device)
    n_tokens = float(mask_BT.sum())
    out = policy.logprobs(tokens)
    loss = -(out.logp_BT * mask).sum() / n_tokens
    loss.backward()
    stats = optimizer.step()
    nll = loss.detach().clone()
    all_reduce(nll, info.dp_group)
    return {"loss": float(nll), "tokens": n_tokens, **stats}
