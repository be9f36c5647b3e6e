"""A Llama-3-style decoder-only language model, sized from a CPU-tiny toy to ~1B parameters.

Notation: B batch, T tokens (T <= max_seq_len), D = dim, H = n_heads, G = n_kv_heads,
d = D / H (head dim), F = ffn_dim, V = vocab_size, L = n_layers.

    tokens [B, T] (int64/int32 ids in [0, V))
      -> tok_embeddings                                    h [B, T, D]
      -> L x TransformerBlock:
           n = attention_norm(h)                           RMSNorm, [B, T, D]
           q = wq(n) -> [B, T, H, d] -> [B, H, T, d]        then RoPE
           k = wk(n) -> [B, T, G, d] -> [B, G, T, d]        then RoPE
           v = wv(n) -> [B, T, G, d] -> [B, G, T, d]
           query head i reads kv head i // (H / G)          (k, v are not repeated in memory)
           a = causal softmax(q k^T / sqrt(d)) v            [B, H, T, d] -> [B, T, H*d = D]
           h = h + wo(a)                                   residual
           m = ffn_norm(h)
           h = h + w2(silu(w1(m)) * w3(m))                 SwiGLU, w1/w3: D -> F, w2: F -> D
      -> norm (RMSNorm) -> output (LM head, D -> V)        logits [B, T, V]

Pieces:

* **RMSNorm**: ``x / sqrt(mean(x^2) + eps) * weight``, computed in float32 and cast back to the
  input's dtype (bf16 inputs keep their dtype; the statistics do not lose precision).
* **RoPE** (rotary position embeddings), the interleaved-pair convention of Meta's reference
  code: the head dim is read as d/2 pairs ``(x[2i], x[2i+1])`` and the pair at position p is
  rotated by the angle ``p * theta^(-2i/d)``. Rotations preserve norms, and ``<R_m q, R_n k>``
  depends only on ``n - m``: attention scores see relative positions. cos/sin tables
  ``[max_seq_len, d/2]`` are precomputed once (non-persistent buffers: not in the state_dict,
  rebuilt from the config).
* **Grouped-query attention**: G <= H key/value heads, each shared by H / G query heads. With
  G = H it is ordinary multi-head attention; it shrinks wk, wv and the KV activations by H / G.
  The attention matmuls themselves are ``F.scaled_dot_product_attention(is_causal=True,
  enable_gqa=True)`` (``causal_attention``): the kernel reads the G heads where H are asked for,
  so neither the forward nor its saved tensors hold k and v repeated H / G times (at
  Llama-3.2-1B's shape, 6 KB a token in each block), and the backward sums each kv head's
  gradient over its query heads.
* **Tied embeddings** (``tie_embeddings=True``, as Llama-3.2-1B): ``output.weight`` *is*
  ``tok_embeddings.weight``.

Precision (docs/method.md, 'The three GEMMs of a linear layer'): the seven linears of each block
(wq, wk, wv, wo, w1, w2, w3) are what ``adahop.convert_to_adahop_training`` converts to MXFP4
training; the embedding, the norms, attention's own matmuls and the LM head ``output`` stay in
high precision (``output`` is skipped by name by the default filter, and when tied its weight is
the embedding's). The layers that read one activation (wq, wk, wv; w1, w3) are called together
(``adahop.shared_input``): they quantize it once (``AdaHOPConfig.share_input``). Under
``torch.autocast(..., dtype=torch.bfloat16)`` the logits come out in bf16; upcast them for the
loss. The residual stream stays float32 (the embedding's dtype) in that case. Prefer autocast to
``model.to(torch.bfloat16)``, which would round the RoPE tables to bf16 too.

Big models: build them on the meta device (``with torch.device("meta"): Llama(cfg)``) to count
parameters without memory, or materialise with ``model.to_empty(device=...)`` followed by
``model.reset_parameters()`` (which also rebuilds the RoPE tables).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import nn

from adahop.shared_input import linears_on_one_input

# Named sizes (everything but vocab_size and max_seq_len, which depend on the tokenizer and the
# data). "1b" is Llama-3.2-1B's shape (with its 128256 vocab: 1.24B parameters, tied).
SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=192),
    "small": dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768),
    "20m": dict(dim=384, n_layers=6, n_heads=6, n_kv_heads=2, ffn_dim=1024),
    "125m": dict(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=2048),
    "350m": dict(dim=1024, n_layers=24, n_heads=16, n_kv_heads=8, ffn_dim=2816),
    "1b": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192),
}

_INT_FIELDS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len")


@dataclass(frozen=True)
class LlamaConfig:
    """The model's shape and numerics. Build a named one with ``LlamaConfig.from_size``."""

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
        for name in _INT_FIELDS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.dim % self.n_heads:
            raise ValueError(f"dim must be a multiple of n_heads, got dim={self.dim}, n_heads={self.n_heads}")
        if self.head_dim % 2:
            raise ValueError(
                f"the head dim (dim / n_heads = {self.dim} / {self.n_heads} = {self.head_dim}) must be even for RoPE"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads must be a multiple of n_kv_heads (grouped-query attention), got n_heads={self.n_heads}, "
                f"n_kv_heads={self.n_kv_heads}"
            )
        for name in ("rope_theta", "norm_eps", "init_std"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"tie_embeddings must be a bool, got {self.tie_embeddings!r}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def from_size(cls, name: str, *, vocab_size: int, max_seq_len: int, **overrides) -> LlamaConfig:
        """The named size ``name`` (one of ``SIZES``) with ``overrides`` (any other field)."""
        if name not in SIZES:
            raise ValueError(f"unknown model size {name!r}; known sizes: {tuple(SIZES)}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise ValueError(f"unknown LlamaConfig field(s) {unknown}; fields: {sorted(fields)}")
        return cls(vocab_size=vocab_size, max_seq_len=max_seq_len, **{**SIZES[name], **overrides})

    def num_params(self) -> int:
        """Parameter count of ``Llama(self)`` (a tied LM head counted once)."""
        return num_params(self)


def num_params(config: LlamaConfig) -> int:
    """Parameter count of ``Llama(config)``, from the shapes alone (a tied LM head counted once)."""
    d, f, kv = config.dim, config.ffn_dim, config.n_kv_heads * config.head_dim
    attention = d * d + d * kv + d * kv + d * d  # wq, wk, wv, wo
    feed_forward = 3 * d * f  # w1, w3, w2
    block = attention + feed_forward + 2 * d  # + attention_norm, ffn_norm
    embedding = config.vocab_size * d
    head = 0 if config.tie_embeddings else config.vocab_size * d
    return embedding + config.n_layers * block + d + head  # + final norm


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2, -1) + eps) * weight`` in float32, cast back to x's dtype."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles, each [max_seq_len, head_dim / 2] float32: the angle of
    pair i at position p is ``p * theta^(-2i / head_dim)`` (computed in float64)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64, device=device), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs ``(x[..., 2i], x[..., 2i+1])`` of x [B, heads, T, d] by the angles whose
    cos/sin are given as [T, d/2] (rows = positions). Computed in float32, returned in x's dtype."""
    pairs = x.float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return out.to(x.dtype)


def compute_copies(x: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    """``n`` copies of x in autocast's compute dtype, one per linear layer that reads x; without
    autocast, x itself n times.

    Each linear would cast its input itself (autocast does, and so does ``AdaHOPLinear``). Doing it
    here, once per reader and before any of them runs, gives the same values and, in eager mode,
    the same kernels; the gradients still meet in float32 (each cast's backward upcasts its own).
    In a compiled model the casts then come out of the norm's kernel, and the gradients are
    summed inside it."""
    device_type = x.device.type
    # (only the devices autocast knows: torch.amp.is_autocast_available is not traceable by Dynamo)
    if device_type not in ("cuda", "cpu") or not torch.is_autocast_enabled(device_type):
        return (x,) * n
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(x.to(dtype) for _ in range(n))


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, G, T, d] -> [B, G * n_rep, T, d]: kv head g serves query heads g*n_rep ... g*n_rep+n_rep-1."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [B, H, T, d], k and v [B, G, T, d] -> [B, H, T, d]; query head i reads kv head i // (H / G).

    Where the fused kernel takes G heads (FlashAttention: bf16 or fp16 on a GPU; the CPU's kernels)
    k and v stay at G heads, so the repeated copies are neither written nor saved for the backward.
    Elsewhere (float32 on a GPU) only the memory-efficient kernel is fused, and it takes H heads:
    k and v are repeated first, or SDPA would fall back to its unfused math."""
    n_rep = q.shape[1] // k.shape[1]
    if n_rep == 1:
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    if fused_kernel_reads_kv_heads(q):
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return nn.functional.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), is_causal=True)


def fused_kernel_reads_kv_heads(q: torch.Tensor) -> bool:
    """Whether SDPA has a fused kernel that takes fewer key/value heads than ``q`` has heads."""
    return q.device.type == "cpu" or q.dtype in (torch.bfloat16, torch.float16)


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE on q and k."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = linears_on_one_input((self.wq, self.wk, self.wv), compute_copies(x, 3))
        q = q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # [B, H, T, d]
        k = k.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, G, T, d]
        v = v.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, G, T, d]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        a = causal_attention(q, k, v)  # [B, H, T, d]
        return self.wo(a.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))



class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Both projections first, then the product: in a compiled block with graph breaks at the
        # linear layers, silu and the product are then one fused kernel (forward and backward).
        h1, h3 = linears_on_one_input((self.w1, self.w3), compute_copies(x, 2))
        return self.w2(nn.functional.silu(h1) * h3)


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h += attention(attention_norm(h)); h += feed_forward(ffn_norm(h))``."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = h + self.attention(self.attention_norm(h), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """The decoder (see the module doc). ``forward(tokens [B, T]) -> logits [B, T, vocab_size]``."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        if not isinstance(config, LlamaConfig):
            raise ValueError(f"config must be a LlamaConfig (see LlamaConfig.from_size), got {type(config).__name__}")
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.tie_weights()
        self.register_buffer("rope_cos", torch.empty(config.max_seq_len, config.head_dim // 2), persistent=False)
        self.register_buffer("rope_sin", torch.empty(config.max_seq_len, config.head_dim // 2), persistent=False)
        self.reset_parameters()

    def tie_weights(self) -> None:
        """Make ``output.weight`` the embedding's weight (when ``tie_embeddings``). Called again by
        ``reset_parameters``: ``to_empty`` (meta -> real device) unties shared parameters."""
        if self.config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """(Re)tie, (re)initialise every parameter and rebuild the RoPE tables, in place on their
        device (after ``to_empty`` too).

        Linears and the embedding: normal(0, init_std). The residual output projections (wo and
        w2, whose outputs are added to the residual stream) get std init_std / sqrt(2 n_layers),
        as in GPT-2: the stream sums 2 n_layers such branches, so its variance at init stays
        independent of depth. RMSNorm weights: 1."""
        cfg = self.config
        self.tie_weights()
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, device=self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        residual_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        for name, p in self.named_parameters():  # a tied weight appears once
            if p.dim() < 2:
                nn.init.ones_(p)  # the RMSNorm weights (the model has no biases)
            elif name.endswith(("wo.weight", "w2.weight")):
                nn.init.normal_(p, mean=0.0, std=residual_std)
            else:
                nn.init.normal_(p, mean=0.0, std=cfg.init_std)

    def num_params(self) -> int:
        """Distinct parameters actually held (a tied weight counted once)."""
        return sum(p.numel() for p in self.parameters())

    def _check_tokens(self, tokens) -> None:
        cfg = self.config
        if not isinstance(tokens, torch.Tensor):
            raise ValueError(f"tokens must be a torch.Tensor of token ids [batch, seq], got {type(tokens).__name__}")
        if tokens.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"tokens must be int64 or int32 token ids, got dtype {tokens.dtype}")
        if tokens.dim() != 2 or tokens.shape[0] < 1 or tokens.shape[1] < 1:
            raise ValueError(f"tokens must have shape [batch >= 1, seq >= 1], got {tuple(tokens.shape)}")
        if tokens.shape[1] > cfg.max_seq_len:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds max_seq_len={cfg.max_seq_len}")
        # The values are checked where that costs nothing: on a CPU tensor, outside a compiled graph.
        # On a GPU the check would read two integers back every step (a host sync that keeps the
        # host from queueing the next step, and a graph break under torch.compile); there the ids
        # come from a corpus checked when it was built and loaded (data.corpus), and an id past the
        # vocabulary still fails, as a device-side assert of the embedding.
        if tokens.is_meta or tokens.device.type != "cpu" or torch.compiler.is_compiling():
            return
        lo, hi = torch.aminmax(tokens)
        lo, hi = int(lo), int(hi)
        if lo < 0 or hi >= cfg.vocab_size:
            raise ValueError(f"token ids must be in [0, {cfg.vocab_size}) (vocab_size), got ids in [{lo}, {hi}]")

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self._check_tokens(tokens)
        t = tokens.shape[1]
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]  # [T, d/2]
        h = self.tok_embeddings(tokens)  # [B, T, D]
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))  # [B, T, V]
