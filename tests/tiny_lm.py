"""A small causal transformer and a byte-level corpus for tests: the CPython standard library's
own source (real text every Python installation carries, so no test needs a download)."""

from __future__ import annotations

import inspect

import torch
from torch import nn

CORPUS_MODULES = ("argparse", "textwrap", "inspect", "dataclasses", "json.decoder", "unittest.case")


# ---- data ----------------------------------------------------------------------------------------
def load_corpus() -> str:
    import importlib

    return "\n".join(inspect.getsource(importlib.import_module(m)) for m in CORPUS_MODULES)


def encode_bytes(text: str) -> torch.Tensor:
    """Byte-level tokens (vocab 256)."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def batches(tokens: torch.Tensor, *, batch: int, seq_len: int, steps: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        start = torch.randint(0, tokens.numel() - seq_len - 1, (batch,), generator=g)
        idx = start[:, None] + torch.arange(seq_len + 1)
        chunk = tokens[idx]
        yield chunk[:, :-1], chunk[:, 1:]


# ---- a tiny pre-norm transformer (causal self-attention + GELU MLP) ------------------------------
class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.norm2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d, bias=False)
        self.down = nn.Linear(4 * d, d, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        h = h + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return h + self.down(nn.functional.gelu(self.up(self.norm2(h))))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 256, d: int = 64, layers: int = 2, heads: int = 4, seq_len: int = 128):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq_len, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.lm_head(self.norm(h))


def lm_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(inputs)
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
