"""The Llama-style model (adahop.llama.model): shapes and dtypes, causality, RoPE, grouped-query
attention, tied embeddings, parameter counts and named sizes, init, AdaHOP conversion, training,
bad input."""

import dataclasses
import math

import pytest
import torch
from torch import nn

import adahop
from adahop.llama.model import (
    SIZES,
    Llama,
    LlamaConfig,
    RMSNorm,
    apply_rope,
    compute_copies,
    num_params,
    repeat_kv,
    rope_tables,
)

VOCAB = 97
BLOCK_LINEARS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")


def tiny_config(**kw) -> LlamaConfig:
    return LlamaConfig.from_size("tiny", vocab_size=VOCAB, max_seq_len=32, **kw)


def tiny(seed=0, **kw) -> Llama:
    torch.manual_seed(seed)
    return Llama(tiny_config(**kw))


def tokens(b, t, seed=1, vocab=VOCAB):
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- shapes, dtypes, causality


def test_shapes_and_dtypes():
    m = tiny()
    x = tokens(3, 17)
    y = m(x)
    assert y.shape == (3, 17, VOCAB) and y.dtype == torch.float32 and torch.isfinite(y).all()
    # int32 ids give the same logits as int64
    assert torch.equal(m(x.to(torch.int32)), y)
    # the full context length is allowed
    assert m(tokens(1, 32)).shape == (1, 32, VOCAB)
    # parameters are float32, the model has no biases
    assert all(p.dtype == torch.float32 for p in m.parameters())
    assert all(mod.bias is None for mod in m.modules() if isinstance(mod, nn.Linear))


def test_autocast_bf16_on_cpu():
    m = tiny()
    x = tokens(2, 16)
    ref = m(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
    assert y.dtype == torch.bfloat16
    # bf16 matmuls: close to the fp32 logits, not equal to them
    err = (y.float() - ref).abs().max().item()
    assert 0 < err < 0.05 * ref.abs().max().item()
    y.float().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())


def test_compute_copies_cast_once_per_reader_and_sum_gradients_in_float32():
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0), requires_grad=True)
    assert compute_copies(x, 3) == (x, x, x)  # no autocast: x itself
    with torch.autocast("cpu", dtype=torch.bfloat16):
        copies = compute_copies(x, 3)
    assert len({id(c) for c in copies}) == 3
    assert all(c.dtype == torch.bfloat16 and torch.equal(c, x.detach().bfloat16()) for c in copies)
    # three bf16 gradients whose bf16 sum would round: each cast's backward upcasts its own, and
    # the float32 sum is exact here
    grads = [torch.full((4, 8), v, dtype=torch.bfloat16) for v in (1.0, 2.0**-9, 2.0**-9)]
    torch.autograd.backward(copies, grads)
    assert torch.equal(x.grad, torch.full((4, 8), 1.0 + 2.0**-8))


def test_autocast_model_equals_linears_that_cast_their_own_input(monkeypatch):
    """compute_copies changes no value: the block under autocast equals the same block whose
    linear layers each receive the float32 input and cast it themselves (autocast's F.linear)."""
    import adahop.llama.model as model_mod

    m = tiny()
    x = tokens(2, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
        monkeypatch.setattr(model_mod, "compute_copies", lambda t, n: (t,) * n)
        y_ref = m(x)
    assert torch.equal(y, y_ref)


def test_rmsnorm_float32_math_and_dtype():
    norm = RMSNorm(8, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.arange(1.0, 9.0))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0)) * 3
    want = x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5) * torch.arange(1.0, 9.0).double()
    assert torch.allclose(norm(x).double(), want, atol=1e-5)
    xb = x.bfloat16()
    yb = norm(xb)
    assert yb.dtype == torch.bfloat16
    want_b = (xb.float() * torch.rsqrt(xb.float().pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight).bfloat16()
    assert torch.equal(yb, want_b)  # computed in float32, rounded once at the end


def test_swiglu_feed_forward_by_hand():
    ff = tiny().layers[0].feed_forward
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    w1, w2, w3 = ff.w1.weight, ff.w2.weight, ff.w3.weight
    assert w1.shape == w3.shape == (192, 64) and w2.shape == (64, 192)
    want = (nn.functional.silu(x @ w1.T) * (x @ w3.T)) @ w2.T
    assert torch.allclose(ff(x), want, atol=1e-6)


def test_causality():
    m = tiny()
    x = tokens(2, 20)
    y = m(x)
    for t in (0, 9, 19):
        x2 = x.clone()
        x2[:, t] = (x2[:, t] + 1) % VOCAB
        y2 = m(x2)
        assert torch.equal(y[:, :t], y2[:, :t]), f"logits before {t} changed"
        assert not torch.allclose(y[:, t], y2[:, t]), f"logits at {t} did not change"
    # a prefix gives the same logits as the full sequence at those positions
    assert torch.allclose(m(x[:, :7]), y[:, :7], atol=1e-5)


# ---------------------------------------------------------------- RoPE


def test_rope_scores_depend_only_on_the_offset():
    d, theta = 16, 10000.0
    cos, sin = rope_tables(d, 512, theta)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(d, generator=g), torch.randn(d, generator=g)

    def rot(v, pos):  # v [d] at position pos -> [d]
        return apply_rope(v.view(1, 1, 1, d), cos[pos : pos + 1], sin[pos : pos + 1]).view(d)

    def direct(m, n):  # <R_m q, R_n k> = sum_i cos(a_i)(qa ka + qb kb) + sin(a_i)(qb ka - qa kb), a_i = (n-m) theta_i
        qd, kd = q.double().view(-1, 2), k.double().view(-1, 2)
        ang = (n - m) * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        qa, qb, ka, kb = qd[:, 0], qd[:, 1], kd[:, 0], kd[:, 1]
        return (ang.cos() * (qa * ka + qb * kb) + ang.sin() * (qb * ka - qa * kb)).sum().item()

    for m_pos, n_pos in [(0, 0), (5, 2), (2, 5), (100, 97), (300, 511), (511, 0)]:
        got = (rot(q, m_pos) * rot(k, n_pos)).sum().item()
        assert got == pytest.approx(direct(m_pos, n_pos), abs=1e-4)
    # same offset, different absolute positions: same score; different offset: different score
    same = [(rot(q, p + 3) * rot(k, p)).sum().item() for p in (0, 7, 200, 400)]
    assert max(same) - min(same) < 1e-4
    assert abs((rot(q, 10) * rot(k, 0)).sum().item() - same[0]) > 1e-3


def test_rope_preserves_norms_and_position_zero_is_identity():
    d = 32
    cos, sin = rope_tables(d, 64, 10000.0)
    x = torch.randn(2, 3, 64, d, generator=torch.Generator().manual_seed(0))
    y = apply_rope(x, cos, sin)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5)
    assert torch.allclose(y[:, :, 0], x[:, :, 0])
    assert not torch.allclose(y[:, :, 1:], x[:, :, 1:])
    # the same rotation as multiplying complex pairs by e^{i p theta_i} (Meta's reference form)
    xc = torch.view_as_complex(x.double().unflatten(-1, (-1, 2)).contiguous())
    freqs = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.outer(torch.arange(64, dtype=torch.float64), freqs)
    want = torch.view_as_real(xc * torch.polar(torch.ones_like(ang), ang)).flatten(-2)
    assert torch.allclose(y.double(), want, atol=1e-5)
    # bf16 in, bf16 out
    assert apply_rope(x.bfloat16(), cos, sin).dtype == torch.bfloat16


def test_model_rope_tables_follow_the_config_and_are_not_saved():
    m = tiny()
    m2 = tiny(rope_theta=500000.0)
    d = m.config.head_dim
    assert m.rope_cos.shape == (32, d // 2)
    assert torch.equal(m.rope_cos, rope_tables(d, 32, 10000.0)[0])
    assert torch.equal(m2.rope_sin, rope_tables(d, 32, 500000.0)[1])
    assert not torch.equal(m.rope_sin, m2.rope_sin)
    assert not any("rope" in k for k in m.state_dict())
    # same weights, different theta: different logits
    m2.load_state_dict(m.state_dict())
    x = tokens(1, 16)
    assert not torch.allclose(m(x), m2(x))


# ---------------------------------------------------------------- grouped-query attention


def _mha_by_hand(attn, x):
    """Multi-head attention written out: the GQA module's wk/wv with each kv head's rows repeated
    for the query heads it serves, RoPE as complex rotation, explicit causal softmax."""
    b, t, dim = x.shape
    h, g, d = attn.n_heads, attn.n_kv_heads, attn.head_dim
    wk = attn.wk.weight.view(g, d, dim).repeat_interleave(h // g, dim=0).reshape(h * d, dim)
    wv = attn.wv.weight.view(g, d, dim).repeat_interleave(h // g, dim=0).reshape(h * d, dim)
    q = (x @ attn.wq.weight.T).view(b, t, h, d).transpose(1, 2).double()
    k = (x @ wk.T).view(b, t, h, d).transpose(1, 2).double()
    v = (x @ wv.T).view(b, t, h, d).transpose(1, 2).double()
    freqs = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.outer(torch.arange(t, dtype=torch.float64), freqs)
    rot = torch.polar(torch.ones_like(ang), ang)

    def rope(z):
        return torch.view_as_real(torch.view_as_complex(z.unflatten(-1, (-1, 2)).contiguous()) * rot).flatten(-2)

    q, k = rope(q), rope(k)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    a = scores.softmax(-1) @ v
    return a.transpose(1, 2).reshape(b, t, h * d).float() @ attn.wo.weight.T


def test_gqa_attention_equals_mha_written_by_hand():
    m = tiny()
    attn = m.layers[0].attention
    assert attn.wk.weight.shape == (2 * 16, 64) and attn.wq.weight.shape == (4 * 16, 64)
    x = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(3))
    cos, sin = m.rope_cos[:12], m.rope_sin[:12]
    assert torch.allclose(attn(x, cos, sin), _mha_by_hand(attn, x), atol=1e-5)


def test_attention_repeats_kv_only_where_the_fused_kernel_needs_it(monkeypatch):
    """Where SDPA's fused kernel takes G heads (bf16 or fp16 on a GPU, the CPU) k and v go in as
    they are; elsewhere (float32 on a GPU) repeated to H heads. Both give the same attention."""
    from adahop.llama import model as model_module

    assert model_module.fused_kernel_reads_kv_heads(torch.zeros(1, device="cpu"))
    assert model_module.fused_kernel_reads_kv_heads(torch.zeros(1, device="meta", dtype=torch.bfloat16))
    assert not model_module.fused_kernel_reads_kv_heads(torch.zeros(1, device="meta"))  # float32, not the CPU
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, h, 12, 16, generator=g, requires_grad=True) for h in (4, 2, 2))
    direct = model_module.causal_attention(q, k, v)
    grads = torch.autograd.grad(direct.square().sum(), (q, k, v))
    monkeypatch.setattr(model_module, "fused_kernel_reads_kv_heads", lambda q: False)
    repeated = model_module.causal_attention(q, k, v)
    assert torch.equal(direct, repeated)
    for a, b in zip(grads, torch.autograd.grad(repeated.square().sum(), (q, k, v))):
        assert torch.allclose(a, b, atol=1e-5)


def test_gqa_model_equals_mha_model_with_repeated_kv_weights():
    gqa = tiny()
    mha = tiny(n_kv_heads=4)
    hd, rep = gqa.config.head_dim, 2
    sd = {}
    for k, v in gqa.state_dict().items():
        if k.endswith(("attention.wk.weight", "attention.wv.weight")):
            v = v.view(2, hd, -1).repeat_interleave(rep, dim=0).reshape(4 * hd, -1)
        sd[k] = v
    mha.load_state_dict(sd)
    x = tokens(2, 12)
    assert torch.allclose(gqa(x), mha(x), atol=1e-5)
    # the backward too: each kv head's gradient is the sum over the query heads that read it
    gqa(x).square().mean().backward()
    mha(x).square().mean().backward()
    for (k, p), (_, q) in zip(gqa.named_parameters(), mha.named_parameters()):
        g = q.grad
        if k.endswith(("attention.wk.weight", "attention.wv.weight")):
            g = g.view(2, rep, hd, -1).sum(1).reshape(2 * hd, -1)
        assert torch.allclose(p.grad, g, atol=1e-6), k
    # repeating kv heads the other way (tile instead of interleave) is NOT equivalent
    bad = dict(sd)
    for k, v in gqa.state_dict().items():
        if k.endswith("attention.wk.weight"):
            bad[k] = v.view(2, hd, -1).repeat(rep, 1, 1).reshape(4 * hd, -1)
    mha.load_state_dict(bad)
    assert not torch.allclose(gqa(x), mha(x), atol=1e-4)
    assert torch.equal(repeat_kv(torch.arange(2.0).view(1, 2, 1, 1), 3).flatten(), torch.tensor([0.0, 0, 0, 1, 1, 1]))


# ---------------------------------------------------------------- embeddings, sizes, init


def test_tied_and_untied_embeddings():
    m = tiny()
    assert m.output.weight is m.tok_embeddings.weight
    assert "output.weight" in m.state_dict()  # saved under both names, loads back tied
    (m(tokens(1, 8)).sum()).backward()
    assert m.tok_embeddings.weight.grad is not None
    u = tiny(tie_embeddings=False)
    assert u.output.weight is not u.tok_embeddings.weight
    assert not torch.equal(u.output.weight, u.tok_embeddings.weight)
    assert u.num_params() - m.num_params() == VOCAB * 64
    # tied output moves with the embedding
    with torch.no_grad():
        m.tok_embeddings.weight.zero_()
    assert torch.equal(m(tokens(1, 4)), torch.zeros(1, 4, VOCAB))


def test_param_count_tiny_by_hand():
    cfg = tiny_config()
    m = Llama(cfg)
    held = sum(p.numel() for p in m.parameters())
    # by hand: embedding 97*64; per block wq 64*64, wk 64*32, wv 64*32, wo 64*64, w1/w3/w2 64*192
    # each, two norms 64 each; final norm 64; the tied head adds nothing
    block = 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64 + 3 * 64 * 192 + 2 * 64
    assert block == 49280
    assert held == num_params(cfg) == cfg.num_params() == m.num_params() == 97 * 64 + 2 * block + 64 == 104832
    untied = tiny_config(tie_embeddings=False)
    assert sum(p.numel() for p in Llama(untied).parameters()) == num_params(untied) == 104832 + 97 * 64


@pytest.mark.parametrize(
    "name,vocab,lo,hi",
    [
        ("tiny", 32000, 1.5e6, 3e6),
        ("small", 32000, 8e6, 16e6),
        ("20m", 32000, 15e6, 30e6),
        ("125m", 32000, 100e6, 200e6),
        ("350m", 32000, 250e6, 450e6),
        ("1b", 128256, 1.0e9, 1.6e9),
    ],
)
def test_named_sizes_on_meta(name, vocab, lo, hi):
    cfg = LlamaConfig.from_size(name, vocab_size=vocab, max_seq_len=4096)
    with torch.device("meta"):
        m = Llama(cfg)
    assert all(p.is_meta for p in m.parameters()) and all(b.is_meta for b in m.buffers())
    n = sum(p.numel() for p in m.parameters())
    assert lo < n < hi and n == num_params(cfg)
    assert len(m.layers) == SIZES[name]["n_layers"] and m.config.dim == SIZES[name]["dim"]
    if name == "1b":
        assert n == 1_235_814_400  # Llama-3.2-1B's published count
    # the meta model takes meta tokens and gives the right shape
    assert m(torch.zeros(2, 16, dtype=torch.long, device="meta")).shape == (2, 16, vocab)


def test_meta_model_materialises_with_reset_parameters():
    with torch.device("meta"):
        m = Llama(tiny_config())
    assert m.output.weight is m.tok_embeddings.weight
    m.to_empty(device="cpu")  # unties shared parameters and leaves garbage in the buffers
    m.reset_parameters()
    ref = tiny(seed=0)
    assert m.output.weight is m.tok_embeddings.weight
    assert torch.equal(m.rope_cos, ref.rope_cos) and torch.equal(m.rope_sin, ref.rope_sin)
    assert all(torch.equal(layer.ffn_norm.weight, torch.ones(64)) for layer in m.layers)
    assert 0.018 < m.layers[0].feed_forward.w1.weight.std().item() < 0.022
    # the RoPE buffers are not in the state_dict: equal logits mean they were rebuilt correctly
    m.load_state_dict(ref.state_dict())
    x = tokens(1, 8)
    assert torch.equal(m(x), ref(x))


def test_init_statistics():
    torch.manual_seed(0)
    m = Llama(LlamaConfig.from_size("small", vocab_size=512, max_seq_len=16))
    std, resid = 0.02, 0.02 / math.sqrt(2 * 4)
    for name, p in m.named_parameters():
        if p.dim() == 1:
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            want = resid if name.endswith(("wo.weight", "w2.weight")) else std
            assert abs(p.std().item() / want - 1) < 0.05, name
            assert abs(p.mean().item()) < 0.05 * want, name


# ---------------------------------------------------------------- AdaHOP conversion and training


@pytest.mark.parametrize("recipe", list(adahop.RECIPES))
def test_conversion_converts_exactly_the_block_linears(recipe):
    m = tiny()
    adahop.convert_to_adahop_training(m, config=adahop.AdaHOPConfig.from_recipe_name(recipe))
    layers = adahop.adahop_layers(m)
    want = {
        f"layers.{i}.{sub}.{lin}"
        for i in range(m.config.n_layers)
        for sub, lins in (("attention", ("wq", "wk", "wv", "wo")), ("feed_forward", ("w1", "w2", "w3")))
        for lin in lins
    }
    assert set(layers) == want and len(layers) == 7 * m.config.n_layers
    assert all(isinstance(lay, adahop.AdaHOPLinear) for lay in layers.values())
    assert type(m.output) is nn.Linear and m.output.weight is m.tok_embeddings.weight
    assert type(m.tok_embeddings) is nn.Embedding
    y = m(tokens(2, 8))
    assert y.shape == (2, 8, VOCAB) and torch.isfinite(y).all()
    y.float().pow(2).mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())


def sqnr_db(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.double(), got.double()
    noise = (ref - got).square().sum().item()
    return math.inf if noise == 0 else 10 * math.log10(ref.square().sum().item() / noise)


# Logits of the tiny model against its float32 logits (seeds 0-2): bf16 autocast alone 50.4-50.7
# dB; the converted model's MXFP4 GEMMs under autocast 21.2-22.9 dB from the bf16 logits, for
# every recipe. An unconverted model would be infinitely close to the bf16 logits, a converted
# one whose GEMMs ran in bf16 ~50 dB.
QUANTIZED_LOGITS_DB = (15.0, 30.0)
BF16_AUTOCAST_MIN_DB = 45.0


def assert_quantized_logits(m, y_bf16, ref_fp32, y):
    """``m``'s block linears are AdaHOP layers with frozen MXFP4 modes, and ``y`` (their logits
    under autocast) is as far from the unconverted model's autocast logits ``y_bf16`` as MXFP4
    makes it, while bf16 alone is close to the float32 logits."""
    layers = adahop.adahop_layers(m)
    assert len(layers) == len(BLOCK_LINEARS) * m.config.n_layers
    for name, layer in layers.items():
        assert not layer.calibrating, name
        assert any(mode != "bf16" for mode in layer.modes.values()), (name, layer.modes)
    assert sqnr_db(ref_fp32, y_bf16) >= BF16_AUTOCAST_MIN_DB
    lo, hi = QUANTIZED_LOGITS_DB
    s = sqnr_db(y_bf16, y)
    assert lo <= s <= hi, f"converted logits {s:.1f} dB from the bf16 model's, expected MXFP4's [{lo}, {hi}]"


@pytest.mark.parametrize("recipe", ["mxfp4_iht", "adahop_lv1"])
def test_converted_model_under_cpu_autocast(recipe):
    m = tiny()
    x = tokens(2, 16)
    ref = m(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_bf16 = m(x)
    cfg = adahop.AdaHOPConfig.from_recipe_name(recipe, calibration_steps=1).with_gemm_settings(oe_k=4)
    adahop.convert_to_adahop_training(m, config=cfg)
    for _ in range(2):  # adahop_lv1: one calibration step, then its MXFP4 modes
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = m(x)
        assert y.dtype == torch.bfloat16
        y.float().pow(2).mean().backward()  # no optimizer step: the weights stay those of ref
    assert adahop.is_calibrated(m)
    assert all(torch.isfinite(p.grad).all() for p in m.parameters())
    assert_quantized_logits(m, ref_bf16, ref, y)


def test_conversion_leaves_an_untied_head_alone():
    m = tiny(tie_embeddings=False)
    adahop.convert_to_adahop_training(m, config=adahop.AdaHOPConfig.from_recipe_name("mxfp4"))
    assert len(adahop.adahop_layers(m)) == 14 and type(m.output) is nn.Linear


def _train(model, steps, lr=1e-2):
    x = tokens(4, 32, seed=7)
    inputs, targets = x[:, :-1], x[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(inputs).float().flatten(0, 1), targets.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("recipe", ["bf16", "adahop_lv2"])
def test_training_reduces_the_loss(recipe):
    m = tiny()
    cfg = adahop.AdaHOPConfig.from_recipe_name(recipe, calibration_steps=2).with_gemm_settings(oe_k=4)
    adahop.convert_to_adahop_training(m, config=cfg)
    losses = _train(m, steps=12)
    assert all(math.isfinite(v) for v in losses)
    assert losses[0] == pytest.approx(math.log(VOCAB), abs=0.3)  # near-uniform at init
    assert losses[-1] < losses[0] - 1.0, losses
    if recipe == "adahop_lv2":
        assert adahop.is_calibrated(m)  # the last 10 steps ran with frozen (MXFP4) modes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_autocast_and_conversion():
    m = tiny().cuda()
    x = tokens(2, 16).cuda()
    ref = m(x)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref_bf16 = m(x)
    adahop.convert_to_adahop_training(m, config=adahop.AdaHOPConfig.from_recipe_name("mxfp4_iht"))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = m(x)
    assert y.dtype == torch.bfloat16 and y.device.type == "cuda"
    assert_quantized_logits(m, ref_bf16, ref, y)
    y.float().sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters())


# ---------------------------------------------------------------- bad input


def test_bad_tokens():
    m = tiny()
    with pytest.raises(ValueError, match="max_seq_len=32"):
        m(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match="int64 or int32"):
        m(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="int64 or int32"):
        m(torch.zeros(1, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"\[0, 97\)"):
        m(torch.full((1, 4), 97))
    with pytest.raises(ValueError, match=r"\[0, 97\)"):
        m(torch.tensor([[3, -1, 5]]))
    with pytest.raises(ValueError, match="shape"):
        m(torch.zeros(8, dtype=torch.long))
    with pytest.raises(ValueError, match="shape"):
        m(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="Tensor"):
        m([[1, 2, 3]])


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(n_heads=5), "multiple of n_heads"),
        (dict(n_kv_heads=3), "multiple of n_kv_heads"),
        (dict(dim=96, n_heads=32, n_kv_heads=8), "even for RoPE"),
        (dict(n_layers=0), "n_layers must be a positive int"),
        (dict(vocab_size=-3), "vocab_size must be a positive int"),
        (dict(dim=64.0), "dim must be a positive int"),
        (dict(max_seq_len=True), "max_seq_len must be a positive int"),
        (dict(rope_theta=0.0), "rope_theta must be a finite number > 0"),
        (dict(norm_eps=float("nan")), "norm_eps"),
        (dict(tie_embeddings=1), "tie_embeddings must be a bool"),
    ],
)
def test_bad_config(change, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(tiny_config(), **change)


def test_bad_size_and_frozen_config():
    with pytest.raises(ValueError, match=r"known sizes: \('tiny', 'small', '20m', '125m', '350m', '1b'\)"):
        LlamaConfig.from_size("7b", vocab_size=10, max_seq_len=8)
    with pytest.raises(ValueError, match="unknown LlamaConfig field"):
        LlamaConfig.from_size("tiny", vocab_size=10, max_seq_len=8, n_head=4)
    with pytest.raises(ValueError, match="LlamaConfig"):
        Llama(SIZES["tiny"])
    cfg = tiny_config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.dim = 128
    # overrides apply on top of the named size
    assert LlamaConfig.from_size("1b", vocab_size=10, max_seq_len=8, n_layers=2).n_layers == 2


def test_token_ids_are_checked_on_the_cpu_and_the_whole_model_compiles_without_a_break():
    """Eager, on a CPU tensor: an id outside the vocabulary is a ValueError. Under torch.compile
    the check reads nothing back, so the unconverted model traces as one graph (fullgraph=True
    raises on any graph break)."""
    model = tiny()
    bad = tokens(2, 8)
    bad[1, 3] = VOCAB
    with pytest.raises(ValueError, match=rf"token ids must be in \[0, {VOCAB}\)"):
        model(bad)
    bad[1, 3] = -1
    with pytest.raises(ValueError, match="got ids in \\[-1,"):
        model(bad)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    x = tokens(2, 8)
    assert torch.equal(compiled(x), model(x))
