#!/usr/bin/env bash
# The conformance suite on CUDA graphs (tests/test_cuda_conformance.py: every class of the
# coverage page, drawn calls, options, refills and reads against the unwrapped twin), then,
# given "cuda" as the first argument, the rest of the CUDA-marked tests. Under $OUT (or
# ./gpu-results): log.txt and the JUnit XML of each pytest run.
source "$(dirname "$0")/h200_setup.sh" none
step 500 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_conformance.py \
  -o junit_family=legacy --junitxml "$out/conformance.xml"
if [[ ${1:-} == cuda ]]; then
  step 500 python3 -m pytest -q -p no:cacheprovider -m cuda tests \
    --deselect tests/test_cuda_conformance.py -o junit_family=legacy --junitxml "$out/cuda.xml"
fi
tail -n 40 "$log"
