"""Layers that freeze together: the calibration's end for a policy that decides over the whole
model (``loss_aware``: ``adahop.loss_aware_policy``).

A per-layer policy (the table, the measured policy) freezes each layer from its own summary when
its calibration steps are complete (``AdaHOPLinear.finish_calibration``). A whole-model policy
needs every layer's summary at once: ``convert_to_adahop_training`` puts the layers it converts
with such a config in one ``CalibrationGroup``, and each layer whose steps are complete tells
the group (``layer_complete``); when the last one does, the group reads all their summaries
(one read of the device), runs the policy once and freezes every member. In one process the
layers complete in one backward (the last calibration step's; the group freezes at its first
layer, the last the backward reaches); under data parallelism ``adahop.Calibrator`` merges the
ranks' observations of every layer first, then tells the group, so every rank decides from the
same numbers. ``freeze`` decides now, from the steps seen so far (``adahop.finish_calibration``).

A member that never sees a backward pass holds the group's decision back (a per-layer policy
would hold only that layer); ``adahop.finish_calibration(model)`` then freezes the group, and
raises naming a member that observed nothing, as a single layer's freeze does.
"""

from __future__ import annotations

from adahop.patterns.calibration import read_calibrations


class CalibrationGroup:
    """The layers of one conversion whose policy decides over all of them (module doc). Holds
    the layers (``AdaHOPLinear``), in conversion order."""

    def __init__(self, layers=()):
        self.layers = []
        for layer in layers:
            self.add(layer)

    def add(self, layer) -> None:
        self.layers.append(layer)
        layer.calibration_group = self

    def layer_complete(self, layer) -> bool:
        """``layer``'s calibration steps are complete: freeze the group if every calibrating
        member's are. Returns whether it froze."""
        waiting = [m for m in self.layers if m.calibrating]
        if any(m.calibration.steps < m.config.calibration_steps for m in waiting):
            return False
        self.freeze()
        return True

    def freeze(self) -> None:
        """Decide the modes of every calibrating member now, from the steps seen so far, with the
        policy of their config (``AdaHOPConfig.model_policy``), and freeze them."""
        members = [m for m in self.layers if m.calibrating]
        if not members:
            return
        for m in members:
            if m.calibration.steps == 0:
                raise ValueError(f"layer {m.layer_name!r} has observed no backward pass yet")
        read_calibrations(m.calibration for m in members)  # one read for all
        summaries = {i: m.calibration.summary() for i, m in enumerate(members)}
        result = members[0].config.model_policy(summaries)
        for i, m in enumerate(members):
            m.freeze_with(summaries[i], result[i])
