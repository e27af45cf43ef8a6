#!/usr/bin/env bash
# A GPU check of a change to the library's structure, in parts, each one device call:
#   tests:   the conformance suite on CUDA graphs and the other CUDA-marked tests, side by side
#            (two pytest processes on the one GPU; their timings are not measured);
#   retest:EXPR: the CUDA-marked tests and the conformance suite's cases that match EXPR
#            (pytest's -k), again;
#   packed[:SIZE]: benchmarks/regression.py for the packed towers at 448x448 and 896x896 (or
#            SIZE alone), batch 1, under the code before the change and after it, in turns;
#   fixed:   the same for the fixed-resolution families at batches 1 and 32;
#   fixed-rest: the same for the larger fixed-resolution towers (batches 1 and 8 for the three
#            largest, 20 calls), the Idefics3 towers without the hand-written graph (which the
#            tree before cannot capture);
#   largest: the three largest at batch 1 alone, without the hand-written graph;
#   again:   vit-base-224 at batch 1, twice more under each tree, in turns;
#   host:    host time per call before and after a second change: benchmarks/host_overhead.py
#            (fixed, packed repeated, packed mixed) on the machine's CPU, and the waited latency
#            of one fixed and one packed tower at their smallest input (hostcpu: the first
#            half alone).
# The trees before the changes are unpacked beside the repository (ignored by git):
#   git archive BEFORE -- layergraph adapters pyproject.toml README.md benchmarks examples \
#       | tar -x -C .house/before          (and .house/lean-before for host)
# and carried into the call; each tree is installed into a folder of its own, read through
# PYTHONPATH (the machine's python3 is a virtual environment already).
# Usage: benchmarks/h200_house.sh PART...   (results under $OUT, or ./gpu-results)
source "$(dirname "$0")/h200_setup.sh" none
venv() {  # venv NAME TREE: TREE installed under /tmp/site-NAME, read through PYTHONPATH
  python3 -m pip uninstall -y -q layergraph >>"$log" 2>&1  # one layergraph in sight of each
  python3 -m pip install -q --no-deps --no-build-isolation --no-index --target "/tmp/site-$1" \
    "$2" >>"$log" 2>&1
}
compare() {  # compare LIMIT OLD JSON-STEM ARGS...: each install in turn, old first
  local limit=$1 old=$2 stem=$3; shift 3
  PYTHONPATH="/tmp/site-$old" step "$limit" python3 benchmarks/regression.py \
    --json "$out/$stem-$old.json" "$@"
  PYTHONPATH=/tmp/site-after step "$limit" python3 benchmarks/regression.py \
    --json "$out/$stem-after.json" "$@"
}
PACKED=qwen2.5-vl-7b,pixtral-12b,siglip2-so400m-naflex,qwen3-vl-8b
FIXED_FAST=vit-base-224,clip-vit-l-336,siglip-so400m-384,internvit-300m,aimv2-large-224,janus-pro-384
FIXED_MORE=dinov2-large-224,dinov2-reg-large-224,idefics3-8b-364,smolvlm2-2.2b-384,llama4-scout-336
for part in "$@"; do
  case $part in
    tests)
      timeout -k 5 520 python3 -m pytest -q -p no:cacheprovider --timeout 240 \
        tests/test_cuda_conformance.py -o junit_family=legacy --junitxml "$out/conformance.xml" \
        >"$out/conformance.txt" 2>&1 &
      timeout -k 5 520 python3 -m pytest -q -p no:cacheprovider --timeout 240 -m cuda tests \
        --deselect tests/test_cuda_conformance.py --durations 15 -o junit_family=legacy \
        --junitxml "$out/cuda.xml" >"$out/cuda.txt" 2>&1
      wait
      tail -n 25 "$out/conformance.txt" "$out/cuda.txt" >>"$log" ;;
    retest:*)
      step 240 python3 -m pytest -q -p no:cacheprovider --timeout 120 -m cuda tests \
        -k "${part#retest:}" -o junit_family=legacy --junitxml "$out/retest.xml" ;;
    packed*)
      venv after . && venv before .house/before
      sizes=${part#packed}
      for size in $( [[ -n $sizes ]] && echo "${sizes:1}" || echo 448x448 896x896 ); do
        compare 150 before "packed-$size" --models "$PACKED" --batch-sizes 1 --image-size "$size"
      done ;;
    fixed)
      venv after . && venv before .house/before
      compare 150 before fixed --models "$FIXED_FAST" --batch-sizes 1,32
      compare 120 before fixed-more --models "$FIXED_MORE" --batch-sizes 1,32 ;;
    fixed-rest)
      venv after . && venv before .house/before
      compare 100 before fixed-idefics3 --models idefics3-8b-364,smolvlm2-2.2b-384 \
        --batch-sizes 1,32 --no-hand-graph
      compare 80 before fixed-llama4 --models llama4-scout-336 --batch-sizes 1,32
      compare 140 before fixed-largest --models idefics2-8b-980,mllama-11b-560,internvit-6b \
        --batch-sizes 1,8 --iters 20 ;;
    largest)
      venv after . && venv before .house/before
      compare 200 before fixed-largest-b1 --models idefics2-8b-980,mllama-11b-560,internvit-6b \
        --batch-sizes 1 --iters 20 --no-hand-graph ;;
    again)
      venv after . && venv before .house/before
      for round in 1 2; do
        compare 60 before "again-$round" --models vit-base-224 --batch-sizes 1 --iters 200
      done ;;
    host|hostcpu)
      venv after . && venv lean-before .house/lean-before
      for what in "" "--packed repeated" "--packed mixed"; do
        for tree in lean-before after; do
          # shellcheck disable=SC2086
          PYTHONPATH="/tmp/site-$tree" step 60 python3 benchmarks/host_overhead.py $what
        done
      done
      [[ $part == hostcpu ]] && continue
      compare 100 lean-before smallest-fixed --models vit-base-224 --batch-sizes 1 --iters 200
      compare 100 lean-before smallest-packed --models qwen2.5-vl-7b --batch-sizes 1 \
        --image-size 56x56 --iters 200 ;;
    *) echo "unknown part: $part" >>"$log" ;;
  esac
done
tail -n 80 "$log"
