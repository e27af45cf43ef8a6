#!/usr/bin/env bash
# One device call for the embedding users' models: open_clip installed from wheels carried in
# build/wheels (the H200 image has no open_clip), the CUDA tests when the first argument is
# "tests", then the benchmarks named by the second argument (towers, service, or both; "-"
# for none). Results and log.txt under $OUT.
#   bash benchmarks/h200_embeddings.sh tests towers
out="${OUT:-gpu-results}"
mkdir -p "$out"
python3 -m pip install -q --no-deps --no-index build/wheels/*.whl >"$out/wheels.txt" 2>&1
# shellcheck source=benchmarks/h200_setup.sh
source benchmarks/h200_setup.sh "${1:-tests}"
export HF_HUB_OFFLINE=1
case "${2:-both}" in
  towers|both) step 420 python3 benchmarks/open_clip_towers.py ${TOWERS_ARGS:-} --json "$out/open-clip-towers.json" ;;&
  service|both) step 420 python3 benchmarks/embedding_service.py ${SERVICE_ARGS:-} --json "$out/embedding-service.json" ;;
esac
tail -n 80 "$log"
