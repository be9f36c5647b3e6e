"""FSDP2 all-gathers each AdaHOP layer's weight already quantized: fprop's MXFP4 operand, 4 bits
per value and one E8M0 byte per 32 values (4.25 bits), instead of the bf16 weight (16 bits) that
the layer would quantize after the gather (docs/distributed.md, 'The quantized all-gather').

The switch is the layers' option, beside them as torchao keeps its float8 all-gather beside its
linear: ``AdaHOPConfig(quantized_all_gather=True)``. ``convert_to_adahop_training`` then makes each
converted weight a ``ShardedWeight`` (``install``), and FSDP2's own ``fully_shard`` gathers it
quantized. ``adahop train`` turns it on with ``--quantized-all-gather`` too (its ``TrainConfig``
field, the same switch) and installs it at its sharding (``install(model, world)``).

Shapes: w_NK is a layer's weight (N output features, K input features). FSDP2 shards it along
N (dim 0): rank r of W holds rows [r N/W, (r+1) N/W).

Why it is exact
---------------
With ``AdaHOPConfig(dgrad_weight="forward")`` a layer needs one thing of W in a step: fprop's B
operand, W quantized along K (after fprop's Hadamard along K in an IHT mode). dgrad multiplies by
that operand dequantized and rotated back (``layer.gemms.forward_weight``); wgrad does not read W.
Quantizing along K is row-local: a row's blocks of 32 and its Hadamard blocks lie inside the
row. So each rank quantizes its own rows (``fprop_operand``), and the gathered codes and scales
are those of the gathered weight, bit for bit. A plain ``mxfp4`` fprop quantizes W with one
scale per 32 x 32 tile (``formats.mxfp4.fake_quantize_mxfp4_tiles``), which is row-local where
every shard holds whole tiles: N / W a multiple of 32. Each rank quantizes in the dtype FSDP2
gathers in (``MixedPrecisionPolicy.param_dtype``), which must be the layer's compute dtype (the
trainer's setting: bf16 parameters with bf16 autocast), so the bits are those of quantizing the
bf16 weight that the ordinary gather would deliver.

What the layer receives
-----------------------
The gathered codes and scales themselves, as a ``GatheredFpropWeight``: a tensor subclass with
the weight's shape and dtype that holds fprop's B (an ``MXFP4Tensor`` over FSDP2's all-gather
buffers, no copy). The layer's two custom ops, called with it, run their implementations with
that operand (``__torch_dispatch__`` -> ``layer.ops.run_forward`` / ``run_backward``): fprop
feeds it to the GEMM as it is and dgrad dequantizes it and rotates it back. A dequantized float
weight for the layer to quantize again would not do: for IHT the operand is Q(W H), and a float
W' = Q(W H) H^T only gives Q(W' H) = Q(W H) up to the rounding of H^T H = I (a block whose
maximum lands just below a power of two changes scale); and it would spend a dequantization, a
second quantization and 16 bits of memory per weight between the gather and the reshard, where
the operand costs 4.25.

When a layer gathers in high precision
--------------------------------------
Decided per layer at each all-gather, from the layer's state then (``gather_format``); the
ordinary gather (the shard in ``param_dtype``) where the layer needs W itself:

* while it calibrates (it observes W and runs its GEMMs in high precision);
* fprop in ``bf16``; ``iht+oe_left`` (its k extracted rows of x multiply W in high precision);
  ``iht+oe_right`` (it picks W's k rows by their norms over the whole weight, and multiplies them
  in high precision);
* plain ``mxfp4`` whose shards are not whole 32-row tiles; a one-process world (FSDP2 copies a
  single input there).

A layer whose N does not split evenly over the ranks gathers in high precision: FSDP2 requires
an extension's inputs to have the padded shard's shape, which codes cannot have. ``install`` with
the world size leaves such a layer to FSDP2's own gather; installed without it (at conversion,
the world not known yet), its shard is padded to that shape at each gather, as FSDP2 pads it.

The switch when modes freeze
----------------------------
A calibrating layer gathers bf16, and MXFP4 from the first gather after its modes freeze (or
back, when the BF16 phase sends fprop to bf16). FSDP2 (torch 2.13) sizes a parameter's
all-gather outputs at its first all-gather and builds the unsharded parameter once from them
(``FSDPParam.init_all_gather_outputs`` returns early once they exist); a gather whose inputs
change shape or dtype therefore drops both first (``_GatherState.reset``), so that FSDP2
rebuilds them as on its first gather. The modes change between a backward and the next forward
(the freeze follows the backward), when the parameter is sharded and holds no gradient. The
weight finds its FSDP2 parameter among the FSDP2 modules of the model it was installed in
(``attach``), at its first switch if ``attach`` was not called after ``fully_shard``.

Bytes
-----
Each sharded weight counts the bytes of the all-gather inputs it gives FSDP2 (``gather_report``:
what this rank sends for it), and ``AllGatherMeter`` (FSDP2's ``set_custom_all_gather``) counts
every collective's input, norms and embeddings included.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather  # the interface of set_custom_all_gather
from torch.utils._pytree import tree_map_only

from adahop.formats.mxfp4 import MXFP4Tensor, fake_quantize_mxfp4_tiles
from adahop.layer.ops import run_backward, run_forward
from adahop.layer.plan import layer_plan
from adahop.linear import AdaHOPLinear

aten = torch.ops.aten
HIGH_PRECISION, MXFP4 = "high precision", "mxfp4"  # the two formats of a gather


def _adahop_layers(model: nn.Module) -> dict[str, AdaHOPLinear]:
    """``convert.adahop_layers``, which this module cannot import: ``convert`` imports it (for
    ``AdaHOPConfig.quantized_all_gather``), and the layering allows no cycle (tests/test_layout.py)."""
    return {fqn: m for fqn, m in model.named_modules() if isinstance(m, AdaHOPLinear)}


def check_config(parallel: str, adahop_config, compile_mode: str = "none") -> None:
    """The run can gather quantized: FSDP2, eager layers (``compile_mode``: what the run compiles,
    ``trainer.resolve_compile``), and a config that allows it (``AdaHOPConfig.quantized_all_gather``
    checks dgrad by the forward's weight and MXFP4 GEMMs)."""
    if parallel != "fsdp2":
        raise ValueError(f"quantized_all_gather shards the weights' all-gather: it needs parallel 'fsdp2', "
                         f"got {parallel!r}")
    adahop_config.replace(quantized_all_gather=True)  # (its own checks)
    if compile_mode != "none":
        # torch.compile would trace the gathered weight's dispatch, which runs the GEMMs on real
        # tensors: not traced or tested yet.
        raise ValueError(f"quantized_all_gather runs the layers eagerly: give --compile none (this run compiles "
                         f"{compile_mode!r})")


# ---- which format a gather takes -------------------------------------------------------------------
def gather_format(layer: nn.Module, shard_rows: int, world: int) -> tuple[str, str]:
    """``(format, why)`` of ``layer``'s next all-gather: ``MXFP4`` where its fprop needs only its
    quantized B, else ``HIGH_PRECISION`` (module doc); ``shard_rows``: the rows of one shard."""
    if world == 1:
        return HIGH_PRECISION, "one process: nothing is gathered"
    if not isinstance(layer, AdaHOPLinear) or layer.runs_plain_linear:
        return HIGH_PRECISION, "a high-precision layer"
    if layer.calibrating:
        return HIGH_PRECISION, "calibrating: the layer observes W and runs high-precision GEMMs"
    if layer.config.dgrad_weight != "forward":
        return HIGH_PRECISION, "dgrad multiplies by the master weight (dgrad_weight 'master')"
    mode, block = layer.modes["fprop"], layer.config.fprop.block_size
    if mode == "bf16":
        return HIGH_PRECISION, "fprop runs in bf16"
    if mode == "iht+oe_left":
        return HIGH_PRECISION, "fprop's OE-left multiplies its extracted rows of x by W in high precision"
    if mode == "iht+oe_right":
        return HIGH_PRECISION, "fprop's OE-right picks W's rows by their norms over the whole weight"
    if mode == "mxfp4" and shard_rows % block:
        return HIGH_PRECISION, (f"fprop's {block} x {block} weight tiles straddle the shards "
                                f"({shard_rows} rows each)")
    return MXFP4, f"fprop {mode}"


def fprop_operand(w_shard: torch.Tensor, layer: AdaHOPLinear, dtype: torch.dtype) -> MXFP4Tensor:
    """fprop's B of these rows of ``layer``'s weight (plain ``mxfp4`` or ``iht`` fprop), packed:
    the rows of what the layer's forward quantizes from the whole weight in ``dtype``."""
    plan = layer_plan(layer.numerics, layer.rng_state, w_shard.device, False)
    fp = plan.fprop
    w = w_shard.to(dtype)
    if fp.mode == "mxfp4":  # (dgrad_weight "forward": one scale per tile, layer.gemms.forward_weight)
        w = fake_quantize_mxfp4_tiles(w, block_size=fp.b.block_size, scale_mode=fp.b.scale_mode)
    return plan.backend.quantize_packed(w, 1, fp.b, cast_to=dtype)


# ---- the sharded weight: what FSDP2 holds and gathers ----------------------------------------------
@dataclass
class _GatherState:
    """One weight's gathering, shared by every ``ShardedWeight`` made from it (FSDP2 and the
    optimizer make new ones: views, detached copies)."""

    name: str
    root: weakref.ref | None = None  # the model it was installed in (where ``attach`` looks)
    fsdp_param: object = None  # FSDP2's FSDPParam of the weight (``attach``)
    signature: tuple | None = None  # the shapes and dtypes of the last gather's inputs
    format: str | None = None
    why: str = ""
    gathers: dict = field(default_factory=dict)  # format -> [gathers, bytes this rank sent]

    def reset(self) -> None:
        """Drop FSDP2's all-gather outputs and unsharded parameter (module doc, 'The switch')."""
        if self.fsdp_param is None and self.root is not None and self.root() is not None:
            attach(self.root())
        p = self.fsdp_param
        if p is None:
            raise RuntimeError(f"{self.name}: the quantized all-gather found no FSDP2 parameter of this weight in the "
                               "model it was converted in; call adahop.quantized_all_gather.attach(model) after "
                               "fully_shard, with the model FSDP2 sharded")
        p.all_gather_outputs = []
        p._unsharded_inner_tensors = []
        if hasattr(p, "_unsharded_param"):
            del p._unsharded_param


# The ops FSDP2 runs on a sharded parameter while it chunks, pads and copies it, and the copies a
# checkpoint load makes into it: their results stay ShardedWeights (torchao.float8's list). Any
# other op (the optimizer's arithmetic) runs on the plain tensor inside and returns plain tensors.
_KEEP = {
    aten.empty_like.default, aten.new_zeros.default, aten.slice.Tensor, aten.copy_.default, aten.view.default,
    aten.as_strided.default, aten._to_copy.default, aten._pin_memory.default, aten.split.Tensor,
    aten.clone.default, aten.detach.default, aten.alias.default,
}


class ShardedWeight(torch.Tensor):
    """A layer's float weight (or FSDP2's shard of it) that FSDP2 all-gathers as fprop's MXFP4
    operand when the layer's modes allow (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``,
    the all-gather extension of FSDP2's ``FSDPParam``)."""

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, state: _GatherState):
        return torch.Tensor._make_wrapper_subclass(
            cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype, layout=tensor.layout, device=tensor.device, requires_grad=tensor.requires_grad)

    def __init__(self, tensor: torch.Tensor, state: _GatherState):
        self._tensor = tensor
        self._state = state

    def __repr__(self):
        return f"ShardedWeight({self._state.name}, {self._tensor!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        state = None

        def unwrap(t):
            nonlocal state
            state = t._state
            return t._tensor

        args, kwargs = tree_map_only(ShardedWeight, unwrap, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _KEEP:
            return out
        return tree_map_only(torch.Tensor, lambda t: ShardedWeight(t, state), out)

    def __tensor_flatten__(self):
        return ["_tensor"], self._state

    @staticmethod
    def __tensor_unflatten__(inner, state, outer_size, outer_stride):
        return ShardedWeight(inner["_tensor"], state)

    def __reduce_ex__(self, protocol):
        # A checkpoint holds the plain weight: it loads anywhere, with or without this gather.
        return self._tensor.__reduce_ex__(protocol)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        dtype = mp_policy.param_dtype or self.dtype
        state = self._state
        rows, world = outer_size[0], mesh.size()
        if rows % world:  # (decided alike on every rank: the ranks' shards differ in rows here)
            fmt, why = HIGH_PRECISION, f"its {rows} rows do not split evenly over {world} ranks"
        else:
            fmt, why = gather_format(module, rows // world, world)
        if fmt == MXFP4:
            q = fprop_operand(self._tensor, module, dtype)
            inputs, metadata = (q.codes, q.scale_e8m0), (MXFP4, module.numerics, q.block_size)
        else:
            # FSDP2's own gather: the shard in param_dtype, padded to the first rank's rows as
            # FSDP2 pads it (the padding, at the end of the last shards, lies past the weight's rows)
            w = self._tensor.to(dtype)
            padded = -(-rows // world)
            if w.shape[0] != padded:
                w = torch.cat((w, w.new_zeros(padded - w.shape[0], *w.shape[1:])))
            inputs, metadata = (w,), (HIGH_PRECISION,)
        signature = tuple((t.shape, t.dtype) for t in inputs)
        if state.signature is not None and signature != state.signature:
            state.reset()
        state.signature, state.format, state.why = signature, fmt, why
        count = state.gathers.setdefault(fmt, [0, 0])
        count[0] += 1
        count[1] += sum(t.numel() * t.element_size() for t in inputs)
        return inputs, metadata

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        if metadata[0] == HIGH_PRECISION:
            (w,) = outputs
            # With ``out`` (FSDP2's unsharded parameter from an earlier gather) the buffer it
            # views has been refilled in place.
            return None if out is not None else (w, (w,))
        codes, scales = outputs
        _, numerics, block_size = metadata
        if out is not None:  # the same buffers, refilled: only the numerics may have changed
            out.numerics = numerics
            return None
        shape = torch.Size((codes.shape[0], self.shape[1]))
        return GatheredFpropWeight(codes, scales, shape, param_dtype, numerics, block_size), (codes, scales)


# ---- the gathered weight: what the layer multiplies by ---------------------------------------------
class GatheredFpropWeight(torch.Tensor):
    """The whole weight as fprop's B operand, gathered: MXFP4 codes and scales along K
    (``operand``), posing as the [N, K] weight in the gather's dtype. Only the AdaHOP layer's ops
    read it (module doc, 'What the layer receives'); its gradient is a plain [N, K] tensor."""

    @staticmethod
    def __new__(cls, codes, scales, shape, dtype, numerics, block_size, requires_grad=False):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=codes.device,
                                                   requires_grad=requires_grad)

    def __init__(self, codes, scales, shape, dtype, numerics, block_size, requires_grad=False):
        self.codes, self.scales = codes, scales
        self.numerics = numerics  # the layer's numerics key it was quantized for
        self.block_size = block_size

    def __repr__(self):
        return (f"GatheredFpropWeight(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"MXFP4 codes {tuple(self.codes.shape)})")

    @property
    def operand(self) -> MXFP4Tensor:
        return MXFP4Tensor(self.codes, self.scales, self.shape, 1, self.block_size)

    def _same(self) -> GatheredFpropWeight:
        return GatheredFpropWeight(self.codes, self.scales, self.shape, self.dtype, self.numerics, self.block_size)

    def check(self, numerics: str, dtype: torch.dtype, what: str) -> None:
        if numerics != self.numerics:
            raise RuntimeError(f"{what}: the gathered weight was quantized for other numerics than the layer "
                               "runs now (its modes changed between the all-gather and the GEMM)")
        if dtype != self.dtype:
            raise ValueError(f"{what} computes in {dtype} but FSDP2 gathered its weight in {self.dtype}: the "
                             "quantized all-gather quantizes in FSDP2's param_dtype, which must be the compute "
                             "dtype (bf16 parameters with bf16 autocast, float32 without)")

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        kwargs = kwargs or {}
        w = args[0] if isinstance(args[0], GatheredFpropWeight) else args[1]
        if func in (aten.detach.default, aten.alias.default):  # nn.Parameter(...), autograd
            return w._same()
        if func is aten.as_strided.default or func is aten.view.default:  # FSDP2: the unsharded param
            size = torch.Size(args[1])
            if size == w.shape and (func is aten.view.default or tuple(args[2]) == w.stride()):
                return w._same()
        if func is torch.ops.adahop.linear_forward.default:
            x, _, rng_state, numerics, needs_backward, x_bound = args
            w.check(numerics, x.dtype, "an AdaHOP layer")
            return run_forward(x, w.operand, rng_state, numerics, needs_backward, x_bound)
        if func is torch.ops.adahop.linear_backward.default:
            numerics = args[8]
            w.check(numerics, args[0].dtype, "an AdaHOP layer's backward")
            return run_backward(args[0], w.operand, *args[2:11], dw_dtype=w.dtype, g_bounds=tuple(args[11:13]),
                                x_col_bound=args[13])
        raise NotImplementedError(f"{func}: a weight gathered in MXFP4 (FSDP2's quantized all-gather) is read only "
                                  "by its AdaHOP layer's GEMMs")


# ---- setting it up ---------------------------------------------------------------------------------
def install(model: nn.Module, world: int | None = None, *, layers: dict | None = None) -> dict[str, str]:
    """Before ``fully_shard``: each AdaHOP layer's weight becomes a ``ShardedWeight`` (a new
    parameter holding the same tensor: build the optimizer after). ``world``: the ranks FSDP2
    shards over; a layer whose rows they do not split evenly is left to FSDP2's own gather (a
    weight already installed goes back to a plain parameter); None (not known yet, as at
    conversion): such a layer gathers its padded shard in high precision (module doc).
    ``layers``: those to install, by name (default: every AdaHOP layer of ``model``). Returns
    the layers left to FSDP2's own gather, with why."""
    counts: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    left = {}
    for fqn, layer in (_adahop_layers(model) if layers is None else layers).items():
        w = layer.weight
        uneven = world is not None and w.shape[0] % world
        if isinstance(w, ShardedWeight):
            if uneven:
                layer.weight = nn.Parameter(w._tensor, requires_grad=w.requires_grad)
                left[fqn] = f"its {w.shape[0]} rows do not split evenly over {world} ranks"
        elif layer.runs_plain_linear:
            left[fqn] = "a high-precision layer"
        elif counts[id(w)] > 1:
            left[fqn] = "its weight is shared with another module"
        elif uneven:
            left[fqn] = f"its {w.shape[0]} rows do not split evenly over {world} ranks"
        else:
            state = _GatherState(fqn, root=weakref.ref(model))
            layer.weight = nn.Parameter(ShardedWeight(w.data, state), requires_grad=w.requires_grad)
    return left


def attach(model: nn.Module) -> None:
    """After ``fully_shard``: each sharded weight of ``model`` learns its FSDP2 parameter (for the
    switch; a weight that was not attached looks for it at its first switch)."""
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in _param_groups(module._get_fsdp_state()):
            for fsdp_param in group.fsdp_params:
                local = fsdp_param._sharded_local_tensor
                if isinstance(local, ShardedWeight):
                    local._state.fsdp_param = fsdp_param


def _param_groups(state) -> list:
    """An FSDP2 module's parameter groups: a list from torch 2.13 (``_fsdp_param_groups``), one
    group or None before (``_fsdp_param_group``; the GPU machines' torch 2.11). FSDP2's internals,
    which the switch needs (there is no public handle on a sharded parameter's FSDP2 record)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return list(groups)


def gather_report(model: nn.Module) -> dict[str, dict]:
    """Per layer with a quantized all-gather: the format of its last gather and why, and per
    format the gathers so far and the bytes this rank sent in them."""
    out = {}
    for fqn, layer in _adahop_layers(model).items():
        local = getattr(layer.weight, "_local_tensor", layer.weight)
        if isinstance(local, ShardedWeight):
            s = local._state
            out[fqn] = {"format": s.format, "why": s.why,
                        "gathers": {f: {"count": c, "bytes": b} for f, (c, b) in s.gathers.items()}}
    return out


class AllGatherMeter(AllGather):
    """FSDP2's all-gather (``dist.all_gather_single``, as its default; ``all_gather_into_tensor``
    before torch 2.13) with a count of the
    bytes this rank sends, its input, per call: ``install(model)`` on every FSDP2 module of
    ``model`` (``FSDPModule.set_custom_all_gather``)."""

    def __init__(self):
        self.calls = 0
        self.bytes = 0

    def install(self, model: nn.Module) -> None:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_all_gather(self)

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.calls += 1
        self.bytes += input_tensor.numel() * input_tensor.element_size()
        return _all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


# torch >= 2.13 names it all_gather_single (all_gather_into_tensor is deprecated there); before,
# e.g. the GPU machines' torch 2.11, only all_gather_into_tensor exists. The same collective.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
