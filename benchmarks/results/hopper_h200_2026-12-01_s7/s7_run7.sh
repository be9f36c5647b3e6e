# Session 7, device run 7: the comparison-script test after its fix (run 6: it compared a CPU
# worker's run with a GPU run on this one-GPU machine), natively on the GPU.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
set -o pipefail
timeout 300 python -m pytest -q -p no:cacheprovider tests/test_comparison_scripts.py 2>&1 | tee $OUT/pytest_gpu_comparison.txt | tail -4
