"""The Llama-style model: shapes, causality, RoPE, GQA, sizes, conversion, bad input."""

import pytest
import torch

import adahop
from adahop.train.model import SIZES, Llama, LlamaConfig, apply_rope, rope_tables


def tiny(**kw):
    torch.manual_seed(0)
    return Llama(LlamaConfig.from_size("tiny", vocab_size=97, max_seq_len=32, **kw))


def test_shapes_and_causality():
    m = tiny()
    x = torch.randint(0, 97, (2, 16))
    y = m(x)
    assert y.shape == (2, 16, 97) and y.dtype == torch.float32
    x2 = x.clone()
    x2[:, 10] = (x2[:, 10] + 1) % 97
    y2 = m(x2)
    assert torch.equal(y[:, :10], y2[:, :10]) and not torch.equal(y[:, 10:], y2[:, 10:])


def test_rope_preserves_norms_and_depends_on_offsets_only():
    cos, sin = rope_tables(8, 64, 10000.0)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
    def rot(v, pos):
        return apply_rope(v, cos[pos:pos + 1], sin[pos:pos + 1])
    assert torch.allclose(rot(q, 5).norm(), q.norm(), rtol=1e-5)
    dots = [(rot(q, p + 3) * rot(k, p)).sum().item() for p in (0, 7, 20)]
    assert max(dots) - min(dots) < 1e-4


def test_gqa_equals_mha_with_repeated_kv_heads():
    torch.manual_seed(0)
    gqa = Llama(LlamaConfig.from_size("tiny", vocab_size=50, max_seq_len=16))
    mha = Llama(LlamaConfig.from_size("tiny", vocab_size=50, max_seq_len=16, n_kv_heads=4))
    sd = gqa.state_dict()
    rep = {}
    hd = gqa.config.head_dim
    for k, v in sd.items():
        if k.endswith(("attention.wk.weight", "attention.wv.weight")):
            v = v.view(2, hd, -1).repeat_interleave(2, dim=0).reshape(4 * hd, -1)
        rep[k] = v
    mha.load_state_dict(rep)
    x = torch.randint(0, 50, (2, 12))
    assert torch.allclose(gqa(x), mha(x), atol=1e-5)


def test_tied_and_untied_and_param_count():
    m = tiny()
    assert m.output.weight is m.tok_embeddings.weight
    assert sum(p.numel() for p in m.parameters()) == m.config.num_params()
    u = tiny(tie_embeddings=False)
    assert u.output.weight is not u.tok_embeddings.weight
    assert sum(p.numel() for p in u.parameters()) == u.config.num_params()
    # tiny by hand: emb 97*64; block: wq,wo 64*64 each, wk,wv 64*32 each, 3*64*192, 2 norms; final norm
    assert m.config.num_params() == 97 * 64 + 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 192 + 2 * 64) + 64


@pytest.mark.parametrize("name,vocab,lo,hi", [("125m", 32000, 100e6, 200e6), ("1b", 128256, 1.0e9, 1.6e9)])
def test_named_sizes_on_meta(name, vocab, lo, hi):
    with torch.device("meta"):
        m = Llama(LlamaConfig.from_size(name, vocab_size=vocab, max_seq_len=4096))
    n = sum(p.numel() for p in m.parameters())
    assert lo < n < hi and n == m.config.num_params()
    assert set(SIZES) >= {"tiny", "small", "20m", "125m", "350m", "1b"}


@pytest.mark.parametrize("recipe", list(adahop.RECIPES))
def test_conversion_converts_block_linears_only(recipe):
    m = tiny()
    adahop.convert_to_adahop_training(m, config=adahop.AdaHOPConfig.from_recipe_name(recipe))
    layers = adahop.adahop_layers(m)
    assert len(layers) == 7 * m.config.n_layers
    assert type(m.output) is torch.nn.Linear
    assert m(torch.randint(0, 97, (1, 8))).shape == (1, 8, 97)


def test_bad_input_and_config():
    m = tiny()
    with pytest.raises(ValueError, match="max_seq_len"):
        m(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match="int64"):
        m(torch.zeros(1, 4))
    with pytest.raises(ValueError, match=r"\[0, 97\)"):
        m(torch.full((1, 4), 97))
    with pytest.raises(ValueError, match="n_kv_heads"):
        LlamaConfig(vocab_size=10, dim=64, n_layers=1, n_heads=4, n_kv_heads=3, ffn_dim=8, max_seq_len=8)
    with pytest.raises(ValueError, match="known"):
        LlamaConfig.from_size("7b", vocab_size=10, max_seq_len=8)
