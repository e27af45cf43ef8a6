#!/usr/bin/env bash
# A GPU run of the audio encoders and the new tower families, in parts, each one device call:
#   tests:  the CUDA-marked tests of the audio encoders and several towers, and the CUDA
#           conformance suite's cases of the families added with them (DeiT, BEiT, I-JEPA,
#           ViT-MSN, DINOv3, TIPSv2, Pixio, MLCD, BLIP, the CLIP copies, the Omni thinkers);
#   audio:  layergraph bench on Whisper large-v3's encoder (distil-whisper large-v3's is the
#           same), Qwen2-Audio's and Whisper base's, batches 1, 4 and 16: eager, the
#           hand-written graph, layergraph and torch.compile(mode="reduce-overhead"), each call
#           waited for and in a loop, JSON per model;
#   omni:   the CUDA tests of the Omni audio towers and the padded wav2vec 2.0 calls, then
#           benchmarks/audio_towers.py (Qwen2.5-Omni's and Qwen3-Omni's audio towers, wav2vec
#           2.0 large), one JSON file;
#   wav2vec2: the CUDA test of padded wav2vec 2.0 calls, then wav2vec 2.0 large alone;
#   serving: benchmarks/audio_serving.py's Omni thinker prefill and long video;
#   asr:    benchmarks/audio_serving.py's ASR path of Whisper large-v3 and distil-whisper.
# Usage: benchmarks/h200_audio.sh PART...   (results under $OUT, or ./gpu-results)
source "$(dirname "$0")/h200_setup.sh" none
NEW_FAMILIES="Deit or Beit or Data2Vec or IJepa or ViTMSN or DINOv3 or Tipsv2 or Pixio or MLCD"
NEW_FAMILIES="$NEW_FAMILIES or Blip or MetaClip2 or AltCLIP or ChineseCLIP or CLIPSeg or Omni"
for part in "$@"; do
  case $part in
    tests)
      step 300 python3 -m pytest -q -p no:cacheprovider --timeout 120 tests/test_cuda_audio.py \
        -o junit_family=legacy --junitxml "$out/cuda-audio.xml"
      step 420 python3 -m pytest -q -p no:cacheprovider --timeout 120 \
        tests/test_cuda_conformance.py -k "$NEW_FAMILIES" -o junit_family=legacy \
        --junitxml "$out/conformance-new.xml" ;;
    audio)
      for model in whisper-base-encoder whisper-large-v3-encoder qwen2-audio-encoder; do
        step 280 layergraph bench --model "$model" --batch-sizes 1,4,16 --iters 50 --compile \
          --json "$out/$model.json"
      done ;;
    omni)
      step 150 python3 -m pytest -q -p no:cacheprovider --timeout 120 tests/test_cuda_audio.py \
        -k "omni or wav2vec2" -o junit_family=legacy --junitxml "$out/cuda-omni.xml"
      step 300 python3 benchmarks/audio_towers.py --iters 10 --json "$out/audio-towers.json" ;;
    wav2vec2)
      step 150 python3 -m pytest -q -p no:cacheprovider --timeout 120 tests/test_cuda_audio.py \
        -k wav2vec2 -o junit_family=legacy --junitxml "$out/cuda-wav2vec2.xml"
      step 200 python3 benchmarks/audio_towers.py --iters 10 --only wav2vec2-large \
        --json "$out/wav2vec2.json" ;;
    serving)
      step 420 python3 benchmarks/audio_serving.py --json "$out/audio-serving.json" \
        --only omni-thinker-prefill qwen2.5-vl-7b-long-video ;;
    asr)
      step 540 python3 benchmarks/audio_serving.py --json "$out/asr.json" \
        --only distil-whisper-large-v3-asr whisper-large-v3-asr ;;
    *) echo "unknown part: $part" >>"$log" ;;
  esac
done
tail -n 80 "$log"
