"""A Llama-3-style decoder: RMSNorm, rotary position embeddings, SwiGLU, grouped-query attention,
tied or untied embeddings. Sized by a few numbers, from a CPU-tiny model to ~1B.

Shapes (B batch, T tokens, D = dim, H heads, G kv heads, d = D/H head dim, F ffn dim, V vocab):

    tokens [B, T] -> tok_embeddings -> h [B, T, D]
    per block:  h += wo(attention(rope(wq(n)), rope(wk(n)), wv(n)))  with n = attention_norm(h)
                    q [B, H, T, d], k/v [B, G, T, d] repeated to H heads, causal softmax
                h += w2(silu(w1(m)) * w3(m))                          with m = ffn_norm(h)
    logits [B, T, V] = output(norm(h))

The seven linears of each block (wq, wk, wv, wo, w1, w2, w3) are what ``convert_to_adahop_training``
converts; ``output`` (the LM head) stays in high precision (its name is on the default filter's
skip list, and when tied its weight is the embedding's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    max_seq_len: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    init_std: float = 0.02

    def __post_init__(self):
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(f"dim ({self.dim}) must be a multiple of n_heads ({self.n_heads}) with an even head dim (RoPE)")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def from_size(cls, name: str, *, vocab_size: int, max_seq_len: int, **overrides) -> "LlamaConfig":
        if name not in SIZES:
            raise ValueError(f"unknown model size {name!r}; known: {tuple(SIZES)}")
        return cls(vocab_size=vocab_size, max_seq_len=max_seq_len, **{**SIZES[name], **overrides})

    def num_params(self) -> int:
        d, f, kv = self.dim, self.ffn_dim, self.n_kv_heads * self.head_dim
        block = d * d * 2 + d * kv * 2 + 3 * d * f + 2 * d  # wq, wo, wk, wv, w1-3, two norms
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.n_layers * block + d + head


SIZES = {
    "tiny": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=192),
    "small": dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768),
    "20m": dict(dim=384, n_layers=6, n_heads=6, n_kv_heads=2, ffn_dim=1024),
    "125m": dict(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=2048),
    "350m": dict(dim=1024, n_layers=24, n_heads=16, n_kv_heads=8, ffn_dim=2816),
    "1b": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x [B, heads, T, d] by position-dependent angles."""
    x32 = x.float().unflatten(-1, (-1, 2))
    a, b = x32[..., 0], x32[..., 1]
    out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return out.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rep = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(a.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, h, cos, sin):
        h = h + self.attention(self.attention_norm(h), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.config.init_std
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue  # norm weights stay 1
            # Residual output projections scaled by 1/sqrt(2 n_layers) (GPT-2): the sum of
            # 2 n_layers residual branches keeps unit scale at init.
            scale = 1 / math.sqrt(2 * self.config.n_layers) if name.endswith(("wo.weight", "w2.weight")) else 1.0
            nn.init.normal_(p, mean=0.0, std=std * scale)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if not isinstance(tokens, torch.Tensor) or tokens.dtype not in (torch.int64, torch.int32) or tokens.dim() != 2:
            raise ValueError(f"tokens must be an int64/int32 tensor [batch, seq], got {getattr(tokens, 'dtype', type(tokens))} {tuple(getattr(tokens, 'shape', ()))}")
        t = tokens.shape[1]
        if t > self.config.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds the model's max_seq_len {self.config.max_seq_len}")
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.config.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.config.vocab_size}), got [{int(tokens.min())}, {int(tokens.max())}]")
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))
