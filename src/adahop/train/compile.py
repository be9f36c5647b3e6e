"""``torch.compile`` for training: each transformer block compiled on its own (torchtitan's way).

Why: with eager PyTorch, a training step of the 1B model spends more time in small elementwise
kernels than in its GEMMs (profiled on the H200: ~300 of 546 ms per step were the fp32 residual
adds, casts and copies, RMSNorm, RoPE and SwiGLU's product, each its own kernel reading and writing
the whole activation; the same in every recipe). Inductor fuses those chains into a few kernels.

What is compiled: every ``TransformerBlock`` of a ``Llama``, in place (``nn.Module.compile``), so
the module tree, the state_dict keys and therefore checkpoints are those of the eager model. The
blocks are identical code, so one compiled graph serves them all (the parameters are graph inputs,
not constants). The embedding, the final norm and the LM head stay eager.

What is not: the quantized path of ``AdaHOPLinear`` is marked ``torch.compiler.disable`` (it
launches Triton kernels through its own launcher, draws stochastic-rounding seeds from a host
counter, and calibrates on the host), so a block of an MXFP4 recipe is compiled as the pieces
between its linear layers, and those layers run exactly as in eager mode: same kernels, same seeds,
same bits for the same inputs. A layer that is plain high precision for good (the bf16 recipe) is
``F.linear`` and is compiled with the rest, which is what a BF16 user of ``torch.compile`` gets.

Numerics: the fused elementwise kernels round differently from eager's (fp32 reductions in
another order, fewer intermediate bf16 roundings), so a compiled run's losses match an eager
run's closely, not bit for bit. Exact resume holds within compiled runs (tested on the CPU).
"""

from __future__ import annotations

from torch import nn


def compile_blocks(model: nn.Module) -> int:
    """Compile each ``TransformerBlock`` of ``model`` in place. Returns how many were compiled.

    Raises ``ValueError`` for a model without transformer blocks (nothing would be compiled)."""
    from adahop.train.model import TransformerBlock

    blocks = [m for m in model.modules() if isinstance(m, TransformerBlock)]
    if not blocks:
        raise ValueError(f"compile_blocks found no TransformerBlock in {type(model).__name__}: nothing to compile")
    for block in blocks:
        block.compile()
    return len(blocks)
