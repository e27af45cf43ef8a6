#!/usr/bin/env bash
# A GPU run of compiled layers with dynamic shapes (benchmarks/dynamic_layers.py): the CUDA
# tests of compiled layers and of FLOPs, then SigLIP-so400m@384 and Whisper large-v3's encoder
# at batches 1, 8 and 32, each wrapped with the defaults, with compiled layers of one
# version for every size and with compiled layers per size; starts, replays, errors, FLOPs and
# the rate against the card's matrix-product rate. Results under $OUT (or ./gpu-results).
source "$(dirname "$0")/h200_setup.sh" none
step 150 python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_cuda_graphs.py \
  tests/test_cuda_internvl.py -k "compile or flops"
step 400 python3 benchmarks/dynamic_layers.py \
  --models "${MODELS:-siglip-so400m-384,whisper-large-v3-encoder}" \
  --batch-sizes "${BATCHES:-1,8,32}" --json "$out/dynamic-layers.json"
