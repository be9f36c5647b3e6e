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
