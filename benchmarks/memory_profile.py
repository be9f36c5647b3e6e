"""The device memory of one training step at its peak, by kind: parameters, gradients, optimizer
state, the activations saved for the backward (by dtype and shape), the rest by where it was
allocated; from a ``torch.cuda.memory`` snapshot recorded over the step.

    python benchmarks/memory_profile.py SNAPSHOT.pickle [--tensors TENSORS.json] [--out SUMMARY.json]

bench_train_speed.py --memory-snapshot records one steady step of each run (``StepMemory``) and
puts this summary into the run's row (``--memory-pickle-dir`` keeps the snapshots themselves,
large at 1B, for ``torch.cuda._memory_viz`` or https://pytorch.org/memory_viz). This script
summarises a snapshot saved so, with the list of the step's tensors the pickle carries.

The snapshot (``torch.cuda.memory._snapshot()``, recorded with ``_record_memory_history``) holds
the allocator's segments and blocks at its end and ``device_traces``: each device's alloc and
free events in order, each with the address, the block's size and the Python frames of the call
(innermost first). The allocator knows sizes, not tensors, so the summary replays the trace:

- the blocks alive when the recording began are those freed in the trace before any alloc at
  their address, and those alive at the end never touched by it;
- a block counts from its ``alloc`` to its ``free_requested`` (the allocator's
  ``allocated_bytes``, what ``torch.cuda.max_memory_allocated`` reads), so the largest total over
  the trace is the step's peak;
- kinds come from a list of tensors (address, bytes, kind, dtype, shape) taken where they are
  known: the parameters, gradients and optimizer state at the end of the step (matched to the
  block alive at the end at that address), the tensors the autograd graph saved, walked from the
  loss before its backward (matched to the block alive then: the step allocates a one-element
  marker there, ``MARKER`` in its frames; with several micro-batches, the first loss's). A block
  matched to no tensor is ``other``: the
  forward's temporaries, the logits and the loss, the backward's buffers, workspaces;
- every block alive at the peak is also counted by its kind and allocation site, from its
  innermost frame: an adahop or torch function, or code Inductor generated (a compiled
  forward or backward).
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
from collections import Counter, defaultdict
from pathlib import Path

import torch

MARKER = "memory_profile_backward_marker"
KINDS = ("parameter", "gradient", "optimizer_state", "saved_activation", "other")
# Trace entries kept per recording (a ring buffer): far more than one step allocates.
MAX_ENTRIES = 2_000_000


# ---- the tensors whose kind is known ------------------------------------------------------------------------
def tensor_entry(t: torch.Tensor, kind: str, at: str) -> dict:
    """One tensor of the list ``summarize`` takes: its storage's address and bytes (the block the
    allocator gave it), kind, dtype, shape, and ``at``: ``end`` (alive at the end of the step) or
    ``backward`` (alive when the backward began)."""
    storage = t.untyped_storage()
    return {"address": storage.data_ptr(), "bytes": storage.nbytes(), "kind": kind,
            "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "at": at}


def end_of_step_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> list[dict]:
    """The parameters, their gradients and the optimizer's state tensors, as ``tensor_entry``s."""
    out = []
    for p in model.parameters():
        out.append(tensor_entry(p, "parameter", "end"))
        if p.grad is not None:
            out.append(tensor_entry(p.grad, "gradient", "end"))
    if optimizer is not None:
        for state in optimizer.state.values():
            out.extend(tensor_entry(v, "optimizer_state", "end") for v in state.values() if isinstance(v, torch.Tensor))
    return out


def saved_tensors(loss: torch.Tensor) -> list[dict]:
    """The tensors the autograd graph of ``loss`` holds for its backward, as ``tensor_entry``s
    (``saved_activation``; one per storage): the ``_saved_*`` attributes of the built-in nodes
    and the ``saved_tensors`` of custom Functions (AdaHOP's layers, a compiled graph's
    CompiledFunction). Call it before the backward frees them."""
    seen_nodes, seen_storages, out = set(), set(), []
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        for t in _saved_of(node):
            key = t.untyped_storage().data_ptr()
            if key not in seen_storages:
                seen_storages.add(key)
                out.append({**tensor_entry(t, "saved_activation", "backward"), "node": type(node).__name__})
        stack.extend(nxt for nxt, _ in node.next_functions)
    return out


def _saved_of(node) -> list[torch.Tensor]:
    values = []
    for name in dir(node):
        if name.startswith("_saved_"):
            try:
                values.append(getattr(node, name))
            except RuntimeError:  # already freed
                pass
    try:
        values.extend(getattr(node, "saved_tensors", ()) or ())
    except (RuntimeError, AttributeError):  # freed, or a node whose Function saved none
        pass
    flat = []
    for v in values:
        flat.extend(v if isinstance(v, (tuple, list)) else [v])
    return [t for v in flat if isinstance(v, torch.Tensor) for t in _plain(v) if t.untyped_storage().nbytes() > 0]


def _plain(t: torch.Tensor) -> list[torch.Tensor]:
    """A tensor subclass that wraps others (torchao's float8 tensors run eagerly) as the plain
    tensors that hold its memory; a plain tensor as itself."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(t):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [inner for name in names for inner in _plain(getattr(t, name))]


# ---- the snapshot --------------------------------------------------------------------------------------------
def _instances(snapshot: dict, device: int) -> tuple[list[dict], list[dict]]:
    """(the trace's alloc/free events, every block instance: address, size, frames, start and
    end event index; -1: alive when the trace began, None: alive at its end)."""
    trace = [e for e in (snapshot.get("device_traces") or [[]] * (device + 1))[device]
             if e["action"] in ("alloc", "free_requested")]
    end_live = {}
    for seg in snapshot.get("segments", []):
        if seg.get("device", device) != device:
            continue
        address = seg.get("address", 0)
        for b in seg.get("blocks", []):
            address = b.get("address", address)
            if b["state"] == "active_allocated":
                end_live[address] = b
            address += b["size"]
    live: dict[int, dict] = {}
    instances: list[dict] = []
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            inst = {"address": e["addr"], "size": e["size"], "frames": e.get("frames", []), "start": i, "end": None}
            live[e["addr"]] = inst
            instances.append(inst)
        else:
            inst = live.pop(e["addr"], None)
            if inst is None:  # allocated before the recording began
                inst = {"address": e["addr"], "size": e["size"], "frames": [], "start": -1, "end": None}
                instances.append(inst)
            inst["end"] = i
    touched = {e["addr"] for e in trace}
    for address, b in end_live.items():
        if address not in touched:  # alive all through
            instances.append({"address": address, "size": b["size"], "frames": b.get("frames", []), "start": -1,
                              "end": None})
    return trace, instances


def _alive(inst: dict, index: int) -> bool:
    return inst["start"] <= index and (inst["end"] is None or inst["end"] > index)


def _is_marker(frames) -> bool:
    return any(f.get("name") == MARKER for f in frames)


def site(frames: list[dict]) -> str:
    """Where a block was allocated, from its innermost frame (frames come innermost first): an
    adahop or torch function (``adahop/layer/gemms.py:forward_gemms``), code Inductor generated
    (``compiled forward``/``compiled backward``: a frame of the call's stack is a backward), else
    the file and function."""
    if not frames:
        return "(allocated before the recorded step)"
    filename, name = frames[0].get("filename", "?"), frames[0].get("name", "?")
    if "torchinductor" in filename:
        phase = "backward" if any("backward" in f.get("name", "") for f in frames[1:]) else "forward"
        return f"compiled {phase} (Inductor)"
    for package in ("adahop", "torch"):
        if f"/{package}/" in filename:
            return f"{package}/{filename.rsplit(f'/{package}/', 1)[-1]}:{name}"
    return f"{filename.rsplit('/', 1)[-1]}:{name}"


def summarize(snapshot: dict, tensors: list[dict] = (), *, device: int = 0, top: int = 30) -> dict:
    """The memory at the peak of a recorded step, by kind, saved dtype and shape, and site (see
    the module doc). ``tensors``: ``tensor_entry`` dicts (``end_of_step_tensors``,
    ``saved_tensors``)."""
    trace, instances = _instances(snapshot, device)
    total = sum(i["size"] for i in instances if i["start"] == -1)
    peak, peak_index = total, -1
    for i, e in enumerate(trace):
        total += e["size"] if e["action"] == "alloc" else -e["size"]
        if total > peak:
            peak, peak_index = total, i
    marker = next((i for i, e in enumerate(trace) if e["action"] == "alloc" and _is_marker(e.get("frames", []))),
                  None)
    by_address = defaultdict(list)
    for inst in instances:
        by_address[inst["address"]].append(inst)
    kind_of: dict[int, dict] = {}  # id(instance) -> tensor entry
    for at, when in (("backward", marker if marker is not None else peak_index), ("end", None)):
        for t in tensors:
            if t["at"] != at:
                continue
            for inst in by_address.get(t["address"], ()):
                fits = t["bytes"] <= inst["size"]
                if fits and (inst["end"] is None if when is None else _alive(inst, when)):
                    kind_of[id(inst)] = t  # "end" second: a parameter saved for the backward is a parameter
    at_peak = [inst for inst in instances if _alive(inst, peak_index) and not _is_marker(inst["frames"])]
    by_kind = dict.fromkeys(KINDS, 0)
    saved_dtype: Counter = Counter()
    saved_shape: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
    sites: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for inst in at_peak:
        t = kind_of.get(id(inst))
        kind = t["kind"] if t else "other"
        by_kind[kind] += inst["size"]
        if kind == "saved_activation":
            saved_dtype[t["dtype"]] += inst["size"]
            entry = saved_shape[(t["dtype"], tuple(t["shape"]))]
            entry[0] += inst["size"]
            entry[1] += 1
        s = sites[f"{kind}: {site(inst['frames'])}"]
        s[0] += inst["size"]
        s[1] += 1
    return {
        "device": device, "events": len(trace), "peak_bytes": peak, "peak_event": peak_index,
        "peak_in": None if marker is None else ("forward" if peak_index < marker else "backward"),
        "backward_start_bytes": None if marker is None else sum(
            i["size"] for i in instances if _alive(i, marker) and not _is_marker(i["frames"])),
        "by_kind": by_kind,
        "saved_by_dtype": dict(saved_dtype.most_common()),
        "saved_by_shape": [[dtype, list(shape), b, n] for (dtype, shape), (b, n) in
                           sorted(saved_shape.items(), key=lambda kv: -kv[1][0])[:top]],
        "by_site": [[name, b, n] for name, (b, n) in sorted(sites.items(), key=lambda kv: -kv[1][0])[:top]],
    }


def markdown(summary: dict, title: str = "memory at the peak of the step") -> str:
    """The summary as Markdown tables."""
    gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
    peak = summary["peak_bytes"]
    share = lambda b: f"{b / peak:.1%}" if peak else "-"  # noqa: E731
    head = f"### {title}: {gib(peak)}"
    if summary.get("measured_peak_bytes") is not None:
        head += f" (max_memory_allocated over the step: {gib(summary['measured_peak_bytes'])})"
    if summary.get("peak_in"):
        head += f", in the {summary['peak_in']}"
    lines = [head, "", "| kind | memory | share |", "|---|---|---|"]
    lines += [f"| {k} | {gib(b)} | {share(b)} |" for k, b in summary["by_kind"].items()]
    lines += ["", "| saved for the backward: dtype | memory |", "|---|---|"]
    lines += [f"| {d} | {gib(b)} |" for d, b in summary["saved_by_dtype"].items()]
    lines += ["", "| saved: dtype, shape | memory | tensors |", "|---|---|---|"]
    lines += [f"| {d} {shape} | {gib(b)} | {n} |" for d, shape, b, n in summary["saved_by_shape"][:12]]
    lines += ["", "| kind: allocation site | memory | blocks |", "|---|---|---|"]
    lines += [f"| {name} | {gib(b)} | {n} |" for name, b, n in summary["by_site"][:20]]
    return "\n".join(lines)


# ---- recording (CUDA) ----------------------------------------------------------------------------------------
class StepMemory:
    """Records one training step's device memory: ``start()`` before the step (history on, the
    loss's saved tensors captured when ``torch.nn.functional.cross_entropy`` returns it, with the
    marker), ``stop(model, optimizer)`` after it: the summary (with ``measured_peak_bytes``) and
    the snapshot. The trainer computes its loss with ``nn.functional.cross_entropy`` outside the
    compiled model, so the wrapper sees the loss of every micro-batch of the step."""

    def __init__(self, device: torch.device, max_entries: int = MAX_ENTRIES):
        self.device, self.max_entries = torch.device(device), max_entries
        self.saved: list[dict] = []
        self.error: Exception | None = None
        self._real_ce = None

    def start(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        torch.cuda.memory._record_memory_history("all", context="alloc", stacks="python",
                                                 max_entries=self.max_entries, device=self.device)
        real = self._real_ce = torch.nn.functional.cross_entropy

        def cross_entropy(*args, **kwargs):
            loss = real(*args, **kwargs)
            if loss.requires_grad and self.error is None:
                try:
                    self.saved.extend(saved_tensors(loss))
                    memory_profile_backward_marker(self.device)
                except Exception as e:  # the training step goes on; stop() raises it
                    self.error = e
            return loss

        torch.nn.functional.cross_entropy = cross_entropy

    def stop(self, model, optimizer) -> tuple[dict, dict]:
        torch.nn.functional.cross_entropy = self._real_ce
        if self.error is not None:
            torch.cuda.memory._record_memory_history(None)
            raise RuntimeError(f"listing the tensors saved for the backward failed: {self.error!r}") from self.error
        torch.cuda.synchronize(self.device)
        measured = torch.cuda.max_memory_allocated(self.device)
        tensors = end_of_step_tensors(model, optimizer) + self.saved
        snapshot = torch.cuda.memory._snapshot(self.device)
        torch.cuda.memory._record_memory_history(None)
        summary = summarize(snapshot, tensors, device=self.device.index or 0)
        summary["measured_peak_bytes"] = measured
        snapshot["memory_profile_tensors"] = tensors  # what main() reads back from a saved snapshot
        return summary, snapshot


def memory_profile_backward_marker(device) -> None:
    """A one-element allocation whose frames carry this function's name (``MARKER``): where the
    backward begins, in the trace."""
    torch.empty(1, device=device)


# ---- command line --------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    doc = __doc__.split("\n\n")
    p = argparse.ArgumentParser(description=doc[0], epilog="\n\n".join(doc[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("snapshot", help="a pickled torch.cuda.memory._snapshot() (bench_train_speed.py "
                                    "--memory-pickle-dir writes them, with the step's tensors inside)")
    p.add_argument("--tensors", default=None,
                   help="JSON list of tensor entries (address, bytes, kind, dtype, shape, at) to name the kinds "
                        "(default: the list inside the snapshot, if any)")
    p.add_argument("--device", type=int, default=0, help="the device index whose trace to read (default: 0)")
    p.add_argument("--out", default=None, help="write the summary as JSON here (default: only print it)")
    args = p.parse_args(argv)
    try:
        with open(args.snapshot, "rb") as f:
            snapshot = pickle.load(f)
        if not isinstance(snapshot, dict) or "segments" not in snapshot:
            raise ValueError(f"{args.snapshot} is not a torch.cuda.memory snapshot (a dict with 'segments')")
        tensors = snapshot.get("memory_profile_tensors", [])
        if args.tensors:
            tensors = json.loads(Path(args.tensors).read_text())
    except (OSError, ValueError, pickle.UnpicklingError, EOFError) as e:
        print(f"memory_profile.py: {e}", file=sys.stderr)
        return 2
    summary = summarize(snapshot, tensors, device=args.device)
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))
    print(markdown(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
