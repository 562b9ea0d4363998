"""The embedded engine's models: they compute only the scheduled tokens, reading earlier
tokens' state from a paged KV cache addressed by slot ids, exactly as a vLLM model does.

- `TinyTransformer`: a real causal transformer (float32, CPU) with paged KV attention. Its
  rows match a full recomputation within float32 rounding (~1e-6).
- `PrefixHashModel`: the "KV" of a slot is a hash of the token prefix up to it, and each
  output row is a pure function of that hash, so rows are bit-exact whatever the batching,
  chunking or hit pattern; a wrong KV slot or a wrong cached row shows as an exact mismatch.

Both return last-layer hidden states ``(n, hidden_size)``, one per-token mm key ``proj`` with
row shape ``(4,)``, and one leftover entry ``step_info`` (a small dict with a tensor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn


@dataclass
class ForwardBatch:
    """The scheduled tokens of one step, request after request."""

    token_ids: torch.Tensor  # (n,) int64
    positions: torch.Tensor  # (n,) int64
    slot_mapping: np.ndarray  # (n,) int64
    requests: list[tuple[int, int, list[int], int]]  # (first row, rows, block table, context length)


@dataclass
class ForwardOutput:
    hidden: torch.Tensor
    mm: dict[str, object]


def _slots(block_table: list[int], length: int, block_size: int) -> torch.Tensor:
    pos = torch.arange(length)
    return torch.tensor(block_table, dtype=torch.int64)[pos // block_size] * block_size + pos % block_size


def _leftover(batch: ForwardBatch) -> dict[str, object]:
    counts = torch.tensor([count for _, count, _, _ in batch.requests], dtype=torch.int64)
    return {"num_requests": len(batch.requests), "rows_per_request": counts}


class TinyTransformer(nn.Module):
    """A few pre-norm transformer layers over a paged KV cache (float32, CPU)."""

    def __init__(
        self,
        num_slots: int,
        block_size: int,
        vocab_size: int = 512,
        hidden_size: int = 64,
        num_layers: int = 2,
        num_heads: int = 4,
        max_positions: int = 4096,
        seed: int = 0,
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.block_size = block_size
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.embed = nn.Embedding(vocab_size, hidden_size)
        self.pos = nn.Embedding(max_positions, hidden_size)
        self.layers = nn.ModuleList(
            nn.ModuleDict(
                {
                    "norm1": nn.LayerNorm(hidden_size),
                    "qkv": nn.Linear(hidden_size, 3 * hidden_size),
                    "out": nn.Linear(hidden_size, hidden_size),
                    "norm2": nn.LayerNorm(hidden_size),
                    "mlp": nn.Sequential(
                        nn.Linear(hidden_size, 4 * hidden_size), nn.GELU(), nn.Linear(4 * hidden_size, hidden_size)
                    ),
                }
            )
            for _ in range(num_layers)
        )
        self.final_norm = nn.LayerNorm(hidden_size)
        self.proj = nn.Linear(hidden_size, 4)
        shape = (num_layers, num_slots, num_heads, self.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape), persistent=False)
        self.eval()

    @torch.no_grad()
    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        x = self.embed(batch.token_ids) + self.pos(batch.positions)
        slots = torch.from_numpy(batch.slot_mapping)
        for i, layer in enumerate(self.layers):
            h = layer["norm1"](x)
            q, k, v = layer["qkv"](h).view(-1, 3, self.num_heads, self.head_dim).unbind(1)
            self.k_cache[i, slots] = k  # write this step's KV first: same-step hits read it
            self.v_cache[i, slots] = v
            attn = torch.empty_like(q)
            for start, count, table, context in batch.requests:
                ctx = _slots(table, context, self.block_size)
                keys, values = self.k_cache[i, ctx], self.v_cache[i, ctx]  # (context, heads, dim)
                scores = torch.einsum("qhd,khd->hqk", q[start : start + count], keys) / math.sqrt(self.head_dim)
                q_pos = batch.positions[start : start + count][:, None]
                mask = torch.arange(context)[None, :] > q_pos
                scores = scores.masked_fill(mask[None], float("-inf"))
                attn[start : start + count] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
            x = x + layer["out"](attn.reshape(-1, self.hidden_size))
            x = x + layer["mlp"](layer["norm2"](x))
        hidden = self.final_norm(x)
        return ForwardOutput(hidden, {"proj": self.proj(hidden), "step_info": _leftover(batch)})


_MASK = (1 << 61) - 1


class PrefixHashModel:
    """Rows that are a pure function of the token prefix, through a paged "KV" of prefix hashes."""

    def __init__(self, num_slots: int, block_size: int, hidden_size: int = 16, seed: int = 0) -> None:
        self.block_size = block_size
        self.hidden_size = hidden_size
        self.seed = seed + 1
        self.kv = np.zeros(num_slots, dtype=np.uint64)

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        tokens = batch.token_ids.tolist()
        positions = batch.positions.tolist()
        hashes = np.zeros(len(tokens), dtype=np.uint64)
        for start, count, table, _ in batch.requests:
            for i in range(start, start + count):
                pos = positions[i]
                if pos == 0:
                    prev = self.seed
                elif i > start:
                    prev = int(hashes[i - 1])
                else:
                    b, off = divmod(pos - 1, self.block_size)
                    prev = int(self.kv[table[b] * self.block_size + off])
                h = (prev * 1_000_003 + tokens[i] * 7919 + 1) & _MASK
                hashes[i] = h
            # Written per request, in batch order, so a later request's same-step hit sees it.
            self.kv[batch.slot_mapping[start : start + count]] = hashes[start : start + count]
        shifts = np.arange(self.hidden_size, dtype=np.uint64) * np.uint64(3)
        digits = (hashes[:, None] >> shifts[None, :]) & np.uint64(0xFFFF)
        hidden = torch.from_numpy(digits.astype(np.float32) / 65536.0)
        shifted = hashes[:, None] >> (np.arange(4, dtype=np.uint64)[None, :] * np.uint64(13))
        proj = torch.from_numpy((shifted & np.uint64(0xFFF)).astype(np.int64))
        return ForwardOutput(hidden, {"proj": proj, "step_info": _leftover(batch)})
