#!/usr/bin/env bash
# A device call that runs the CUDA-marked tests (with "tests") and measures SigLIP2 NaFlex and
# LFM2-VL one call at a time under each attention backend forced and under auto, whole graphs
# against the hand-written graph, so that auto's choice per budget can be read against what each
# backend gives. Writes under $OUT (or ./gpu-results): log.txt, and one JSON per tower.
# Usage: benchmarks/h200_attention_sweep.sh [tests|notests] [ATTENTION,...]
set -uo pipefail
out="${OUT:-gpu-results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 COLUMNS=160
log="$out/log.txt"
step() { local limit=$1; shift; echo "\$ $*" >>"$log"; timeout -k 5 "$limit" "$@" >>"$log" 2>&1; echo "rc=$?" >>"$log"; }
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >>"$log" 2>&1
{ date -u +"date: %Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c 'import platform, torch, transformers, triton; print("python", platform.python_version(), "| torch", torch.__version__, "| transformers", transformers.__version__, "| triton", triton.__version__)'
} >>"$log" 2>&1
if [[ ${1:-tests} == tests ]]; then
  step 330 python3 -m pytest -q -m cuda tests -p no:cacheprovider -x
fi
backends="${2:-auto,fa3,sdpa_dense_masked,triton}"
for tower in siglip2-so400m lfm2-vl-1.6b; do
  step 150 python3 benchmarks/siglip2_naflex.py --tower "$tower" --seconds 0.2 --no-stream \
    --attention "$backends" --json "$out/sweep-$tower.json"
done
tail -n 40 "$log"
