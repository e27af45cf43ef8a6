#!/usr/bin/env bash
# A GPU run of compiled layers (benchmarks/dynamic_layers.py): the CUDA tests of the families,
# of compiled layers (the default's measured choice among them) and of FLOPs, then
# SigLIP-so400m@384 and Whisper large-v3's encoder, each wrapped as built, with the defaults
# (compiled layers chosen per key by measurement), with compiled layers of one version for
# every size and with compiled layers per size (ResNet-50: as built and by default, its region
# compiled per size); starts, replays, errors, FLOPs, what each key
# kept and the rate against the card's matrix-product rate. Results under $OUT (or ./gpu-results).
source "$(dirname "$0")/h200_setup.sh" none
step 100 python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_cuda_families.py
step 160 python3 -m pytest -q -m cuda -p no:cacheprovider -s tests/test_cuda_graphs.py \
  tests/test_cuda_internvl.py -k "compile or flops or default"
step 110 python3 benchmarks/dynamic_layers.py --models siglip-so400m-384 \
  --batch-sizes "${BATCHES:-1,8,32}" --json "$out/dynamic-layers-siglip.json"
step 110 python3 benchmarks/dynamic_layers.py --models whisper-large-v3-encoder \
  --batch-sizes 1,16 --json "$out/dynamic-layers-whisper.json"
step 80 python3 benchmarks/dynamic_layers.py --models timm:resnet50 \
  --batch-sizes 1,32 --json "$out/dynamic-layers-resnet50.json"
