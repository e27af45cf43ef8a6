# Sourced by the benchmarks/h200_*.sh device calls: the output folder ($OUT, or ./gpu-results)
# and its log.txt, `step LIMIT COMMAND...` (the command under a time limit, its output and exit
# status in the log), the project installed without downloads, the machine and versions logged,
# and, given "tests" as the call's first argument, the CUDA-marked tests.
set -uo pipefail
out="${OUT:-gpu-results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 COLUMNS=160
log="$out/log.txt"
step() { local limit=$1; shift; echo "\$ $*  # $(date -u +%T)" >>"$log"; timeout -k 5 "$limit" "$@" >>"$log" 2>&1; echo "rc=$? at $(date -u +%T)" >>"$log"; }
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >>"$log" 2>&1
{ date -u +"date: %Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c 'import platform, torch, transformers, triton; print("python", platform.python_version(), "| torch", torch.__version__, "| transformers", transformers.__version__, "| triton", triton.__version__)'
} >>"$log" 2>&1
if [[ ${1:-tests} == tests ]]; then
  step 330 python3 -m pytest -q -m cuda tests -p no:cacheprovider -x
fi
