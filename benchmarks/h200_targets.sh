#!/usr/bin/env bash
# A device call measuring the packed towers against their targets, with cuDNN's ragged SDPA
# installed (nvidia-cudnn-frontend from build/wheels, when carried there). Parts, in order:
#   towers:  benchmarks/packed_towers.py, every packed tower (one image per size against eager
#            and the hand-written graph; the stream of 100 requests); about 6 minutes;
#   prefill: layergraph bench --prefill (a Qwen2.5-VL-3B-sized VLM's time to first token);
#   start:   benchmarks/packed_start.py (cold and warm start of Qwen2.5-VL-7B's budgets);
#   fixed:   InternViT-300M and SigLIP-so400m at batch 32, the defaults against eager, and
#            fuse_gelu="approximate" against the defaults (benchmarks/option_ab.py);
#   siglip2: SigLIP2 so400m NaFlex's calls against eager and the hand-written graph, with the
#            defaults and with fuse_norm and fuse_gelu (benchmarks/siglip2_naflex.py).
# Each part under its own time limit; writes log.txt and one JSON per part under $OUT (or
# ./gpu-results). Usage: benchmarks/h200_targets.sh [PART ...] (default: towers)
source "$(dirname "$0")/h200_setup.sh" notests
shopt -s nullglob
for wheel in build/wheels/nvidia_cudnn_frontend-*.whl; do
  python3 -m pip install -q --no-deps --no-index "$wheel" >>"$log" 2>&1
done
python3 -c 'import cudnn; print("cudnn frontend", cudnn.__version__)' >>"$log" 2>&1
for part in "${@:-towers}"; do
  case $part in
    towers) step 480 python3 benchmarks/packed_towers.py --json "$out/packed-towers.json" ;;
    prefill) step 200 python3 -m layergraph.cli bench --prefill 60 --json "$out/vlm-prefill.json" ;;
    start) step 200 python3 benchmarks/packed_start.py --tower qwen2.5-vl-7b \
      --json "$out/packed-start.json" ;;
    fixed) step 200 python3 benchmarks/option_ab.py --option fuse_gelu --baseline auto \
      --value approximate --models internvit-300m,siglip-so400m-384 --batch-sizes 32 --profile \
      --json "$out/fixed-b32.json" ;;
    siglip2)
      step 200 python3 benchmarks/siglip2_naflex.py --no-stream --attention auto \
        --json "$out/siglip2-defaults.json"
      step 200 python3 benchmarks/siglip2_naflex.py --no-stream --attention auto \
        --options fuse_norm=auto,fuse_gelu=auto --json "$out/siglip2-fused.json" ;;
    *) echo "unknown part: $part" >>"$log" ;;
  esac
done
tail -n 80 "$log"
