#!/usr/bin/env bash
# A device call that runs the CUDA-marked tests (with "tests") and measures SigLIP2 NaFlex and
# LFM2-VL one call at a time under each attention backend forced and under auto, whole graphs
# against the hand-written graph, so that auto's choice per budget can be read against what each
# backend gives. Writes under $OUT (or ./gpu-results): log.txt, and one JSON per tower.
# Usage: benchmarks/h200_attention_sweep.sh [tests|notests] [ATTENTION,...]
source "$(dirname "$0")/h200_setup.sh"
backends="${2:-auto,fa3,sdpa_dense_masked,triton}"
for tower in siglip2-so400m lfm2-vl-1.6b; do
  step 150 python3 benchmarks/siglip2_naflex.py --tower "$tower" --seconds 0.2 --no-stream \
    --attention "$backends" --json "$out/sweep-$tower.json"
done
tail -n 40 "$log"
