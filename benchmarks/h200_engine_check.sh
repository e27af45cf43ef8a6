#!/usr/bin/env bash
# A device call that checks the engine and the packed-tower kit on a GPU and measures the packed
# towers against their previous runs: the CUDA-marked tests, then the SigLIP2 NaFlex and LFM2-VL
# tower benchmarks and the packed towers' benchmark of the towers named (default:
# qwen2.5-vl-7b; "-" for none), then, given a time limit, the fixed-resolution families at
# batch 1, each step under its own time limit. Writes under $OUT (or ./gpu-results): log.txt,
# and one JSON per benchmark.
# Usage: benchmarks/h200_engine_check.sh [tests|notests] [TOWER,...] [FAMILIES_SECONDS]
source "$(dirname "$0")/h200_setup.sh"
step 90 python3 benchmarks/siglip2_naflex.py --tower lfm2-vl-1.6b --seconds 0.3 --json "$out/lfm2-vl-1.6b.json"
step 90 python3 benchmarks/siglip2_naflex.py --tower siglip2-so400m --seconds 0.2 --json "$out/siglip2-so400m.json"
if [[ ${2:-} != - ]]; then
  step 260 python3 benchmarks/packed_towers.py --towers "${2:-qwen2.5-vl-7b}" --seconds 0.3 --json "$out/packed-towers.json"
fi
if [[ -n ${3:-} ]]; then
  step "$3" python3 benchmarks/families.py --json "$out/families.json" --markdown "$out/families.md"
fi
tail -n 60 "$log"
