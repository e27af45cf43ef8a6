#!/usr/bin/env bash
# A device call for the packed towers' speed options and attention backends: given "tests" as
# the first argument, the kernels' and options' CUDA tests (the cudnn backend's with
# nvidia-cudnn-frontend, installed from build/wheels when carried there); then, in turns
# (benchmarks/option_ab.py, one image of each size, each call profiled by kernel class), the
# packed patch product against the convolution, GLM's position table resampled by a product
# against grid_sample, and attention "auto" (cuDNN's ragged SDPA
# among its candidates) against the varlen flash kernel; and the attention kernels alone
# (benchmarks/ragged_attention.py).
# Each step under its own time limit; writes log.txt and one JSON per step under $OUT (or
# ./gpu-results).
# Usage: benchmarks/h200_fusions.sh [tests|notests] [SIZES]
source "$(dirname "$0")/h200_setup.sh" notests
sizes="${2:-448x448,896x896,1344x1008}"
shopt -s nullglob
for wheel in build/wheels/nvidia_cudnn_frontend-*.whl; do
  python3 -m pip install -q --no-deps --no-index "$wheel" >>"$log" 2>&1
done
python3 -c 'import cudnn; print("cudnn frontend", cudnn.__version__)' >>"$log" 2>&1
if [[ ${1:-tests} == tests ]]; then
  step 200 python3 -m pytest -q -p no:cacheprovider tests/test_rotary_kernel.py \
    tests/test_gated_kernel.py tests/test_add_norm_kernel.py tests/test_cuda_packed_fusions.py \
    tests/test_cuda_cudnn_ragged.py tests/test_cudnn_ragged.py tests/test_cuda_lfm2_vl.py \
    tests/test_siglip2_speed_options.py tests/test_packed_casts.py tests/test_bench_packed.py
fi
step 200 python3 benchmarks/option_ab.py --option patch_matmul --value true --profile \
  --towers qwen2.5-vl-7b,qwen3-vl-8b,glm-4.1v-9b --sizes "$sizes" --json "$out/patch-matmul-ab.json"
step 100 python3 benchmarks/option_ab.py --option positions_matmul --value true --profile \
  --towers glm-4.1v-9b --sizes "$sizes" --json "$out/positions-matmul-ab.json"
step 150 python3 benchmarks/option_ab.py --option attention --baseline fa3 --value auto \
  --towers qwen3-vl-8b,qwen3.5 --sizes "$sizes" --json "$out/cudnn-auto-ab.json"
step 100 python3 benchmarks/ragged_attention.py --json "$out/ragged-attention.json"
tail -n 60 "$log"
