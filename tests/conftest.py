import os

import torch

# The Triton kernels run on the CPU under Triton's interpreter. It must be chosen before the
# kernels are first imported (triton.jit reads it when it decorates them), hence here.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def _single_thread():
    # The reference path runs many small elementwise ops on small tensors; on a 2-core machine
    # OpenMP hand-offs made them 10-50x slower than one thread (measured while other work ran).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A byte-level corpus of three stdlib modules, built once per session: what the trainer,
    the CLI and the comparison scripts train on in tests (a file may define its own)."""
    from adahop.data import corpus as corpus_mod
    from adahop.data import sources

    out = tmp_path_factory.mktemp("corpus")
    src = sources.cpython_stdlib_source(modules=("json", "textwrap", "string"), name="stdlib-mini")
    corpus_mod.build_corpus(out, sources=[src], tokenizer="byte", progress=False)
    return out


@pytest.fixture
def no_network(monkeypatch):
    """Any registry client call (a subprocess of the corpus sources) fails the test."""
    from adahop.data import sources

    def refuse(*a, **k):
        raise AssertionError(f"tried to run {a[0] if a else k}")

    monkeypatch.setattr(sources.subprocess, "run", refuse)


@pytest.fixture
def layer_on_backend(monkeypatch):
    """``run(backend, recipe, x, w, g, modes=None, oe_k=4)``: one AdaHOPLinear (weight ``w``, no
    bias) whose dispatch point returns ``backend``, forward on ``x`` and backward with ``g``;
    returns ``(y, dx, dw)``. For comparing backends layer to layer."""
    import adahop
    import adahop.layer.plan

    def run(backend, recipe, x, w, g, modes=None, oe_k=4):
        monkeypatch.setattr(adahop.layer.plan, "get_backend", lambda name, device: backend)
        cfg = adahop.AdaHOPConfig.from_recipe_name(recipe).with_gemm_settings(oe_k=oe_k)
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device)
        lin.weight.data.copy_(w)
        layer = adahop.AdaHOPLinear.from_float(lin, config=cfg, name="probe")
        if modes:
            layer.set_modes(modes)
        xx = x.clone().requires_grad_()
        y = layer(xx)
        y.backward(g)
        return y.detach(), xx.grad, layer.weight.grad

    return run
