"""A small decoder-only transformer (GPT-style): token and position embeddings, pre-norm
blocks of causal self-attention and an MLP, logits over the 256 byte values.

Its forward is a chain of layers (``pipeline_layers``), so that trainer.pipeline.degree can
cut it into stages, and it names the layers tensor parallelism splits (``tensor_plan``):
attention's query, key and value by heads (colwise), its output projection rowwise, the
MLP's first layer colwise and its second rowwise (Megatron-LM's split: one all-reduce for
each)."""

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.head_dim = dim // heads
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        batch, length, _ = x.shape
        # -1 heads: under tensor parallelism q, k and v hold only this worker's heads
        q, k, v = (t.view(batch, length, -1, self.head_dim).transpose(1, 2)
                   for t in (self.q(x), self.k(x), self.v(x)))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(batch, length, -1))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(dim), CausalSelfAttention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Embedding(nn.Module):
    """Token and position embeddings, added."""

    def __init__(self, vocab: int, dim: int, seq_len: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(seq_len, dim)

    def forward(self, ids):
        return self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 128, heads: int = 4, layers: int = 2,
                 seq_len: int = 64):
        super().__init__()
        self.embed = Embedding(vocab, dim, seq_len)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def pipeline_layers(self) -> list[str]:
        """The forward as a chain: each layer takes the previous one's output."""
        return ["embed", *(f"blocks.{i}" for i in range(len(self.blocks))), "ln", "head"]

    def tensor_plan(self) -> dict[str, str]:
        return {"blocks.*.attn.q": "colwise", "blocks.*.attn.k": "colwise",
                "blocks.*.attn.v": "colwise", "blocks.*.attn.out": "rowwise",
                "blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"}

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))
