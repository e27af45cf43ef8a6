#!/usr/bin/env bash
# A device call for the packed towers' fused kernels (fuse_rotary, fuse_gate) and the dense
# block-mask attention: given "tests" as the first argument, the kernels' tests on the GPU and
# the options' CUDA tests, then each option against the same tower without it (the attention
# against "auto"), in turns (benchmarks/option_ab.py), one image of each size.
# Each step under its own time limit; writes log.txt and one JSON per option under $OUT (or
# ./gpu-results).
# Usage: benchmarks/h200_fusions.sh [tests|notests] [SIZES]
source "$(dirname "$0")/h200_setup.sh" notests
sizes="${2:-448x448,896x896,1344x1008}"
if [[ ${1:-tests} == tests ]]; then
  step 200 python3 -m pytest -q -p no:cacheprovider tests/test_rotary_kernel.py \
    tests/test_gated_kernel.py tests/test_add_norm_kernel.py tests/test_cuda_packed_fusions.py
fi
step 200 python3 benchmarks/option_ab.py --option fuse_rotary --value true \
  --towers qwen2.5-vl-7b,qwen3-vl-8b,glm-4.1v-9b --sizes "$sizes" --json "$out/fuse-rotary-ab.json"
step 150 python3 benchmarks/option_ab.py --option fuse_gate --value true \
  --towers qwen2.5-vl-7b,glm-4.1v-9b --sizes "$sizes" --json "$out/fuse-gate-ab.json"
step 150 python3 benchmarks/option_ab.py --option attention --baseline auto \
  --value sdpa_dense_masked --towers qwen3-vl-8b,qwen2.5-vl-7b --sizes 448x448,896x896 \
  --json "$out/dense-attention-ab.json"
tail -n 60 "$log"
