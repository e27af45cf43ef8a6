#!/usr/bin/env bash
# The GPU run: versions, the CUDA-marked tests, the full test suite, and the demo in fp16 and
# bf16, with everything written under $OUT (or ./gpu-results when OUT is unset).
set -uo pipefail
out="${OUT:-gpu-results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$out/install.txt" 2>&1 \
  || { cat "$out/install.txt"; exit 1; }
{
  date -u +"date: %Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 - <<'PY'
import platform, torch, timm, pluggy
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| timm", timm.__version__, "| pluggy", pluggy.__version__)
PY
} | tee "$out/versions.txt"
status=0
python3 -m pytest -q -m cuda tests 2>&1 | tee "$out/pytest-cuda.txt" || status=1
python3 -m pytest -q -m "not cuda" tests 2>&1 | tail -n 3 | tee "$out/pytest-rest.txt" || status=1
COLUMNS=160 layergraph demo --dtype float16 --json "$out/demo-fp16.json" 2>&1 | tee "$out/demo-fp16.txt" || status=1
COLUMNS=160 layergraph demo --dtype bfloat16 --json "$out/demo-bf16.json" 2>&1 | tee "$out/demo-bf16.txt" || status=1
exit $status
