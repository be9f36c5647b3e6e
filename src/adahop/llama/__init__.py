"""adahop's own Llama (``model``: the harness's model, converted by the library like any other)
and the pretrained weights loaded into it (``pretrained``: SmolLM2, GGUF files, Hugging Face
folders).

One package because the loaders build this model: they sit above ``data`` (a GGUF file's
tokenizer, the SmolLM2 pin) and below ``train``, which trains either a fresh model or a loaded one
(tests/test_layout.py keeps that order).
"""
