"""The one dispatch point: which implementation quantizes operands and runs the MXFP4 GEMMs.

A backend is a module of this package: a ``protocol.Backend`` subclass (what a backend does:
``protocol``'s doc) and a ``protocol.BackendEntry`` (its name, why it cannot run on a device,
how to make one, the options an instance takes, its place in ``auto``'s order), registered below,
one line each:

* ``reference``: pure PyTorch, CPU and any GPU; the numerics every other backend reproduces;
* ``triton``: the fused Triton quantize kernel + the reference GEMM; also under
  ``TRITON_INTERPRET=1`` on the CPU;
* ``hopper_fp8``: Triton quantize to e4m3 + row scales, ``torch._scaled_mm`` on FP8 tensor cores
  (CUDA GPUs of compute capability 8.9 or more);
* ``native_mx``: the packed MXFP4 operands into ``tl.dot_scaled``: only GPUs with MX tensor cores
  that Triton lowers it to natively (NVIDIA compute capability 10.x, AMD gfx950), refused
  elsewhere, even when asked for by name.

``auto`` picks ``native_mx`` on MX tensor cores, else ``hopper_fp8`` on FP8 tensor cores, else
``reference``. Asking for a backend that cannot run is an error naming why, never a silent
fallback. Adding a backend (or a second format) is one new module here, imported and registered
by one ``register_backend`` line below; ``register_backend`` also takes one from outside the package.
"""

from __future__ import annotations

import torch

from adahop.ops.backends import hopper_fp8, native_mx, reference, triton
from adahop.ops.backends.native_mx import native_mx_arch  # noqa: F401  (public here)
from adahop.ops.backends.protocol import Backend, BackendEntry, triton_available  # noqa: F401  (public here)
from adahop.ops.backends.reference import ReferenceBackend  # noqa: F401  (public here)

_REGISTRY: dict[str, BackendEntry] = {}  # name -> entry, in the order registered


def register_backend(entry: BackendEntry) -> None:
    """Make ``entry``'s backend selectable by its name (and by ``auto`` where it has a rank)."""
    if not isinstance(entry, BackendEntry):
        raise ValueError(f"register_backend takes a BackendEntry, got {type(entry).__name__}")
    if entry.name == "auto" or entry.name in _REGISTRY:
        raise ValueError(f"backend name {entry.name!r} is taken; registered: {backend_names()}")
    _REGISTRY[entry.name] = entry


register_backend(reference.ENTRY)
register_backend(triton.ENTRY)
register_backend(hopper_fp8.ENTRY)
register_backend(native_mx.ENTRY)


def backend_names() -> tuple[str, ...]:
    """The registered backends' names, in the order registered."""
    return tuple(_REGISTRY)


def backend_choices() -> tuple[str, ...]:
    """What ``AdaHOPConfig.backend`` accepts: ``auto`` and each registered name."""
    return ("auto", *_REGISTRY)


def _device(device) -> torch.device:
    return torch.device(device) if device is not None else torch.device("cpu")


def unavailable_reason(name: str, device=None) -> str | None:
    """Why backend ``name`` cannot run on ``device`` (None when it can)."""
    entry = _REGISTRY.get(name)
    if entry is None:
        return f"unknown backend {name!r}; known: {backend_choices()}"
    return entry.unavailable(_device(device))


def _auto(device) -> str:
    """The backend ``auto`` resolves to on ``device``: the first by rank that can run there."""
    ranked = sorted((e for e in _REGISTRY.values() if e.auto_rank is not None), key=lambda e: e.auto_rank)
    for entry in ranked:
        if unavailable_reason(entry.name, device) is None:
            return entry.name
    raise ValueError(f"no backend 'auto' may pick can run on device {_device(device)}; "
                     f"ranked: {tuple(e.name for e in ranked)}")


# (backend name, options) -> instance; (name, device, options) -> the instance it resolved to
_INSTANCES: dict = {}


def get_backend(name: str = "auto", device: torch.device | str | None = None, **options):
    """The backend called ``name`` for ``device``; ``"auto"`` picks the first of the ranked
    backends (``native_mx``, ``hopper_fp8``, ``reference``) that can run there. Each layer asks
    once per forward, so a resolved (name, device) is remembered: the checks query the device.

    ``options``: settings of the instance, those its ``BackendEntry`` lists (``hopper_fp8``:
    ``use_fast_accum``). Each distinct set of options has its own instance, fixed when made, so
    that no caller changes the backend another one (the layers, which pass none) uses."""
    opts = tuple(sorted(options.items()))
    key = (name, str(_device(device)), opts)
    found = _INSTANCES.get(key)
    if found is not None:
        return found
    resolved = _auto(device) if name == "auto" else name
    reason = unavailable_reason(resolved, device)
    if reason is not None:
        raise ValueError(reason)
    entry = _REGISTRY[resolved]
    for option in options:
        if option not in entry.options:
            raise ValueError(f"backend {resolved!r} takes no option {option!r}; "
                             f"its options: {', '.join(entry.options) or 'none'}")
    if (resolved, opts) not in _INSTANCES:
        _INSTANCES[(resolved, opts)] = entry.factory(**options)
    _INSTANCES[key] = _INSTANCES[(resolved, opts)]
    return _INSTANCES[key]


def available_backends(device=None) -> tuple[str, ...]:
    return tuple(n for n in _REGISTRY if unavailable_reason(n, device) is None)
