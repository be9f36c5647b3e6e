"""The harness's data: text sources from pinned registry packages (``sources``), tokenizers
(``tokenizer``, named by a spec in ``tokenizer_spec``), the token corpus built from them and read
in windows (``corpus``), the zero-shot tasks' items (``tasks``), and the pinned SmolLM2 file and
GGUF tokenizers (``smollm2``, ``gguf``), whose tokenizer is data even though its weights are a
model's (``adahop.llama.pretrained`` loads those).

Harness, not library: ``adahop train``, ``adahop data`` and ``adahop eval`` read it. It imports
only the library (``atomic_io``, ``safe_paths``), never ``llama``, ``train``, ``analyze`` or
``cli``, which sit above it (tests/test_layout.py).
"""
