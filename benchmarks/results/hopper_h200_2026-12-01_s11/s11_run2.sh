# Session 11, device run 2: host time per call; graphed vs eager layer (the host's share);
# the layer old tree vs new tree back to back.
export PYTHONUNBUFFERED=1
PYTHONPATH=$PWD/src timeout 150 python .carry/scripts/s11_host.py $OUT 2>&1 | grep -E "host|rowmax|Error"
mkdir -p $OUT/old $OUT/new $OUT/graph
PYTHONPATH=$PWD/src timeout 150 python benchmarks/bench_hopper.py --sections graph --shapes 14336,4096 \
  --recipes adahop_lv2,mxfp4 --rep 100 --out $OUT/graph 2>&1 | grep -E "graph|Error"
for i in 1 2; do for t in old new; do
  [ $t = old ] && P=$PWD/.carry/old/src || P=$PWD/src
  PYTHONPATH=$P timeout 100 python benchmarks/bench_hopper.py --sections linear --shapes 14336,4096 \
    --recipes adahop_lv2,mxfp4 --no-emulation --rep 100 --out $OUT/$t 2>&1 | grep -E "linear|Error" | sed "s/^/$t$i /"
done; done
