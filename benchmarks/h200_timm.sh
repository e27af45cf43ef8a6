#!/usr/bin/env bash
# A GPU run of timm's families (the timm adapter's models captured whole, with the speed
# options where their layout allows), each model one `layergraph bench` at batches 1, 8 and 32:
# eager, the hand-written graph, layergraph and torch.compile(mode="reduce-overhead"), each call
# waited for and in a loop; errors against a float32 copy. Parts, each one device call:
#   convnets:     ConvNeXt-T and -B, ResNet-50, EfficientViT-B2, MaxViT-T;
#   transformers: Swin-T, SwinV2-S, BEiT-B, Hiera-S;
#   sam:          SAM ViT-B at 1024x1024 (batches 1 and 8), bf16 and float16;
#   sam32:        SAM ViT-B at 1024x1024, batch 32 (benchmarks/large_batch.py: each column
#                 alone, since one forward fills most of the device), bf16 with torch.compile
#                 and float16;
#   fp16:         the convnets and transformers again in float16, without torch.compile;
#   naflex:       NaFlexVit-B on batches of mixed image sizes (benchmarks/naflex_mixed.py),
#                 with its two graphs profiled; naflex16: the same in float16;
#   tuned:        ConvNeXt-B, ResNet-50 and SwinV2-S in bf16 with layergraph's whole region
#                 compiled (--compile-region) beside torch.compile;
#   layout:       ResNet-50, ConvNeXt-B and EfficientViT-B2 converted to channels-last, beside
#                 the layout they are built in (benchmarks/channels_last.py);
#   latency:      ConvNeXt-B, Hiera-S and ResNet-50 at batch 1 (benchmarks/call_latency.py):
#                 waited and looped, against a hand-written graph that clones its output as
#                 layergraph does, and the wrapper's host work per call profiled;
#   tests:        the CUDA-marked timm tests and those of failed captures.
# Usage: benchmarks/h200_timm.sh PART...   (results under $OUT, or ./gpu-results); CONVNETS and
# TRANSFORMERS, given, name the models of those parts instead.
source "$(dirname "$0")/h200_setup.sh" none
CONVNETS="${CONVNETS:-convnext_tiny convnext_base resnet50 efficientvit_b2 maxvit_tiny_tf_224}"
TRANSFORMERS="${TRANSFORMERS:-swin_tiny_patch4_window7_224 swinv2_small_window8_256 beit_base_patch16_224 hiera_small_224}"
bench() {  # bench LIMIT MODEL BATCHES DTYPE [FLAGS...]
  local limit=$1 model=$2 batches=$3 dtype=$4
  shift 4
  step "$limit" layergraph bench --model "timm:$model" --batch-sizes "$batches" --dtype "$dtype" \
    --iters 50 "$@" --json "$out/$model-$dtype.json"
}
for part in "$@"; do
  case $part in
    convnets) for m in $CONVNETS; do bench 110 "$m" 1,8,32 bf16 --compile; done ;;
    transformers) for m in $TRANSFORMERS; do bench 140 "$m" 1,8,32 bf16 --compile; done ;;
    sam) bench 220 samvit_base_patch16 1,8 bf16 --compile; bench 90 samvit_base_patch16 1,8 fp16 ;;
    sam32) step 330 python3 benchmarks/large_batch.py --model timm:samvit_base_patch16 --batch 32 \
        --compile --json "$out/sam32-bf16.json"
      step 200 python3 benchmarks/large_batch.py --model timm:samvit_base_patch16 --batch 32 \
        --dtype fp16 --json "$out/sam32-fp16.json" ;;
    tuned) for m in convnext_base resnet50 swinv2_small_window8_256; do
        bench 170 "$m" 1,8,32 bf16 --compile --compile-region; done ;;
    layout) step 300 python3 benchmarks/channels_last.py --compile --json "$out/channels-last.json" ;;
    fp16) for m in $CONVNETS $TRANSFORMERS; do bench 60 "$m" 1,8,32 fp16; done ;;
    naflex) step 240 python3 benchmarks/naflex_mixed.py --compile --profile --json "$out/naflex-bf16.json" ;;
    naflex16) step 240 python3 benchmarks/naflex_mixed.py --dtype fp16 --profile --json "$out/naflex-fp16.json" ;;
    latency) step 150 python3 benchmarks/call_latency.py --batch-sizes 1 --iters 500 --host-profile 300 \
        --models timm:convnext_base,timm:hiera_small_224,timm:resnet50 --json "$out/latency.json" ;;
    tests)
      step 150 python3 -m pytest -q -p no:cacheprovider --timeout 120 -m cuda tests \
        -k "timm or capture_failures" -o junit_family=legacy --junitxml "$out/cuda-timm.xml" ;;
    *) echo "unknown part: $part" >>"$log" ;;
  esac
done
tail -n 80 "$log"
