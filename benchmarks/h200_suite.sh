#!/usr/bin/env bash
# The GPU run: versions, the CUDA-marked tests, the rest of the suite, the demo in fp16,
# the attention-kernel, InternViT and SigLIP/CLIP benchmarks, and `layergraph bench` for the
# three benchmark models (with compiled layers, and against torch.compile at batch 1 to 4), and
# InternViT-6B split across every GPU of the machine (a world of one on a single GPU).
# Everything is written under $OUT (or ./gpu-results when OUT is unset); log.txt holds the
# console output of every step. At most 8 files come back from the device: keep it so.
set -uo pipefail
out="${OUT:-gpu-results}"
mkdir -p "$out"
log="$out/log.txt"
export PYTHONUNBUFFERED=1 COLUMNS=160
step() { echo "\$ $*" | tee -a "$log"; "$@" 2>&1 | tee -a "$log"; }
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >>"$log" 2>&1 \
  || { cat "$log"; exit 1; }
{
  date -u +"date: %Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import platform, torch, timm, transformers, triton, pluggy
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| timm", timm.__version__, "| transformers", transformers.__version__,
      "| triton", triton.__version__, "| pluggy", pluggy.__version__)'
} 2>&1 | tee -a "$log"
status=0
step python3 -m pytest -q -m cuda tests -p no:cacheprovider || status=1
step layergraph demo --dtype float16 || status=1
step python3 benchmarks/attention_kernel.py || status=1
step python3 benchmarks/internvl.py || status=1
step python3 benchmarks/towers.py || status=1
for model in vit_base_patch16_224 siglip-so400m-384 internvit-300m; do
  step layergraph bench --model "$model" --compile-layers --iters 50 \
    --json "$out/bench-$model.json" || status=1
  step layergraph bench --model "$model" --batch-sizes 1,2,4 --compile --iters 50 \
    --json "$out/bench-$model-compile.json" || status=1
done
gpus=$(nvidia-smi -L | wc -l)
step torchrun --nproc-per-node "$gpus" benchmarks/tp_internvit.py --model internvit-6b \
  --json "$out/tp-internvit-6b.json" || status=1
exit $status
