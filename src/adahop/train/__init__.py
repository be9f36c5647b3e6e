"""Training and evaluation on real text (``adahop train`` / ``adahop eval``): a Llama-style model,
a corpus built from pinned registry packages, the training loop with exact resume, evaluation."""
