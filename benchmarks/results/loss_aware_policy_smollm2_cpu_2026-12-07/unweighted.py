"""pretrained_forward.py with the loss-aware policy's exposure set to 1 for every layer: the same
whole-model knapsack over the forward's predicted NSRs, without the loss weighting."""
import runpy
import sys

import adahop.loss_aware_policy as lap

lap.loss_exposure = lambda summary: 1.0
sys.argv = ["benchmarks/pretrained_forward.py", *sys.argv[1:]]
runpy.run_path("benchmarks/pretrained_forward.py", run_name="__main__")
