"""Host side of the kernel launches: a launcher with less host time per call, and the small
helpers every launching function uses (``cdiv``, ``next_power_of_2``, ``dummy_pointer``,
``nan_bytes_view``).

An AdaHOP linear makes about a dozen Triton launches per forward + backward. Below the largest
shapes the layer is bound by the host, not the GPU: at (N, K) = (2048, 768), T = 16384 on the H200
its kernels take 0.65 ms and enqueueing them 3.2-4.0 ms (docs/kernels.md, 'Host time and the
launcher'). Triton 3.6's ``kernel[grid](...)`` spends about 45 us of that per launch before the
driver call (cProfile on the H200's host): it binds the arguments, computes each one's
specialization (type, 16-byte alignment, divisibility by 16) and hashes them into the cache key of
the compiled kernel.

``FastLauncher`` keeps Triton's compiled kernels and skips that step for call signatures it has
seen: its own key is a tuple with, per argument, at least what Triton specializes on (a tensor's
dtype and whether its address is a multiple of 16; an int's range class, whether it is a
multiple of 16 and whether it is 1; the type of anything else), plus the constexpr and launch
options and the device. The first call with a new key goes through Triton (compiling if needed)
and keeps the compiled kernel it returns; later calls with that key hand the arguments straight
to its launcher. Since the key distinguishes everything Triton's does, a kept kernel is the one
Triton would have picked.

It falls back to Triton's path under the interpreter (``TRITON_INTERPRET=1``: no compiled
kernel), when a launch hook is installed (profilers), for arguments of other kinds, and on any
Triton but the minor version it was written and tested against (``TESTED_TRITON``): the compiled
kernel's ``run`` signature and the launch-hook knobs are Triton's internals, not its API.
Measured on the H200 at the (2048, 768) layer above: enqueueing its forward + backward takes
3.02 ms without it and 2.16 ms with it and one launch fewer (a single chunk for rows up to
2,048), the two measured together.
"""

from __future__ import annotations

import os

import torch
import triton
from triton.runtime import driver

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # read once, as triton.jit does
TESTED_TRITON = (3, 6)  # the minor version whose launch internals the fast path calls
FAST_PATH = tuple(int(v) for v in triton.__version__.split(".")[:2]) == TESTED_TRITON
_INT32 = (-(2**31), 2**31)
_DUMMY: dict = {}


def _arg_key(a):
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if type(a) is int:
        return (_INT32[0] <= a < _INT32[1], a % 16 == 0, a == 1)
    if type(a) is float:
        return float
    return None  # anything else: Triton's own path


def cdiv(a: int, b: int) -> int:
    """``triton.cdiv`` for host code: that one is a ``triton.jit`` function, and calling one
    from Python costs about 4 us (its arguments are unwrapped as constexprs)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2`` for host code (see ``cdiv``); 1 for n <= 1."""
    return 1 << max(n - 1, 0).bit_length()


def nan_bytes_view(t: torch.Tensor) -> torch.Tensor:
    """The uint8 view through which the interpreter's twin of an e4m3 store writes NaN bytes
    (``NAN_BY_CAST=False``); compiled kernels cast NaN themselves and never use it, so they get
    the tensor as it is (a view costs host time per call)."""
    return t.view(torch.uint8) if INTERPRETED else t


def dummy_pointer(device: torch.device) -> torch.Tensor:
    """A one-byte tensor for pointer arguments a launch does not use: one kept per CPU device, a
    fresh one per call on a GPU. (A kept one made inside a compiled step would live in the memory
    pool of its CUDA graphs, which must hold nothing but the graphs' own tensors: torch's
    cudagraph trees refuse to replay then. An allocation from the caching allocator costs a few
    microseconds of host time.)"""
    device = torch.device(device)
    if device.type != "cpu":
        return torch.empty((1,), dtype=torch.uint8, device=device)
    t = _DUMMY.get(device)
    if t is None:
        t = _DUMMY[device] = torch.empty((1,), dtype=torch.uint8, device=device)
    return t


def _launch_hooks_installed() -> bool:
    """Whether a launch hook (a profiler's) is registered: Triton 3.6 keeps them in a chain
    object that is never None, empty when there are none."""
    from triton import knobs

    hook = knobs.runtime.launch_enter_hook
    return hook is not None and bool(getattr(hook, "calls", True))


class FastLauncher:
    """``FastLauncher(kernel)[grid](*runtime_args, **constexprs_and_options)``: as
    ``kernel[grid](...)``, with the runtime arguments positional and every constexpr parameter
    given by keyword (module doc)."""

    def __init__(self, fn):
        self.fn = fn
        self.compiled: dict = {}
        self.fast_launches = 0  # launches that took the kept kernel (for tests and benchmarks)
        params = getattr(fn, "params", None)  # None under the interpreter: always Triton's path
        self.n_runtime = -1
        if params is not None:
            self.n_runtime = sum(1 for p in params if not p.is_constexpr)
            if any(p.is_constexpr for p in params[: self.n_runtime]):
                raise ValueError(f"{fn.__name__}: FastLauncher needs the constexpr parameters last")
            self.constexpr_names = tuple(p.name for p in params[self.n_runtime:])

    def __getitem__(self, grid):
        return lambda *args, **kw: self.launch(grid, args, kw)

    def launch(self, grid, args, kw):
        if not FAST_PATH or len(args) != self.n_runtime or _launch_hooks_installed():
            return self.fn[grid](*args, **kw)
        arg_keys = tuple(map(_arg_key, args))
        if None in arg_keys:
            return self.fn[grid](*args, **kw)
        device = torch.cuda.current_device()
        key = (device, tuple(kw.items()), arg_keys)
        kernel = self.compiled.get(key)
        if kernel is None:
            kernel = self.fn[grid](*args, **kw)
            if hasattr(kernel, "result"):
                kernel = kernel.result()
            if all(name in kw for name in self.constexpr_names):
                self.compiled[key] = kernel
            return kernel
        full = args + tuple(kw[name] for name in self.constexpr_names)
        stream = driver.active.get_current_stream(device)
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        kernel.run(grid[0], g1, g2, stream, kernel.function, kernel.packed_metadata, None, None, None, *full)
        self.fast_launches += 1
        return kernel
