#!/usr/bin/env bash
# The GPU run, in parts:
#   checks:  versions, the CUDA-marked tests, the torch.compile coexistence diagnostics, the demo
#            in fp16, the attention-kernel, InternViT and SigLIP/CLIP benchmarks;
#   tests:   the tests not marked cuda, which take their GPU paths where there is a GPU (about
#            3 minutes on an H200);
#   profile: where a replay's time goes, per benchmark model: every speed option and
#            torch.compile at batch 1, every speed option at batch 32;
#   bench:   `layergraph bench` for the three benchmark models at six batch sizes: eager,
#            layergraph, the hand-written graph, layergraph tuned (compiled region with
#            Inductor's coordinate-descent tuning, patch matmul, fused GELU, and fused q/k/v for
#            the transformers towers) and torch.compile reduce-overhead; bench:MODEL runs one;
#   tp:      InternViT-6B split across every GPU of the machine, and on one GPU alone;
#   cuda:    the CUDA-marked tests alone (the first step of checks);
#   traffic: InternViT-300M serving a stream of 120 requests of 1 to 13 tiles (eager, default
#            wrap, buckets of powers of two, exact keys, and default wrap with the speed
#            options), then the speed options' cold and warm start at batches 1 and 8;
#   fixed:MODEL: `layergraph bench` of MODEL at batches 1 to 64, eager against default wrap and
#            the hand-written graph, with a wait per call and in a loop (no compiling);
#   families: every tower family's usual configuration at batch 1 (benchmarks/families.py:
#            eager, hand-written graph, layergraph; the JSON and the docs section), after the
#            families' CUDA tests.
# Pass part names to run only those (default: all). Parts other than tp run side by side, one
# per GPU, in waves of as many parts as the machine has GPUs; tp runs last, on every GPU, and
# is stopped if it runs past 4 minutes. All of them take longer than one 10-minute device
# call. On an H200 with a cold Inductor cache, checks take under 10 minutes (the tests about 4)
# and bench 4 to 7 per model, most of it compiling: on two GPUs, run
# `checks bench:vit_base_patch16_224` in one call, `bench:siglip-so400m-384
# bench:internvit-300m` in the next, and `tests profile` and `tp` in further calls.
# Under $OUT (or ./gpu-results when OUT is unset): log-<part>.txt with each part's console
# output, and results.tgz with every JSON written. At most 8 files come back: keep it so.
set -uo pipefail
out="${OUT:-gpu-results}"
mkdir -p "$out"
out=$(cd "$out" && pwd)
results=$(mktemp -d)
parts=("${@:-checks tests profile bench tp}")
read -r -a parts <<<"${parts[*]}"
export PYTHONUNBUFFERED=1 COLUMNS=160
gpus=$(nvidia-smi -L | wc -l)

# step LOG COMMAND...: run COMMAND, appending the command line and its output to LOG.
step() { local log=$1; shift; echo "\$ $*" >>"$log"; "$@" >>"$log" 2>&1; }
pack() { flock "$results/.lock" tar -C "$results" --exclude=.lock -czf "$out/results.tgz" .; }

python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >>"$out/log-install.txt" 2>&1 \
  || { cat "$out/log-install.txt"; exit 1; }
rm -f "$out/log-install.txt"

versions() {
  date -u +"date: %Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import platform, torch, timm, transformers, triton, pluggy
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| timm", timm.__version__, "| transformers", transformers.__version__,
      "| triton", triton.__version__, "| pluggy", pluggy.__version__)'
}

checks() {
  local log="$out/log-checks.txt" status=0
  versions >>"$log" 2>&1
  step "$log" python3 -m pytest -q -m cuda tests -p no:cacheprovider --junitxml "$results/cuda-tests.xml" || status=1
  for disturb in clear-cublas compile-without-trees; do  # beside the tests' disturbances
    step "$log" timeout 300 python3 benchmarks/compile_coexistence.py --disturb "$disturb" \
      || status=1
  done
  step "$log" layergraph demo --dtype float16 || status=1
  step "$log" python3 benchmarks/attention_kernel.py || status=1
  step "$log" python3 benchmarks/internvl.py --json "$results/internvl.json" || status=1
  step "$log" python3 benchmarks/towers.py || status=1
  pack
  return $status
}

tests() {
  local log="$out/log-tests.txt"
  versions >>"$log" 2>&1
  step "$log" python3 -m pytest -q -m "not cuda" tests -p no:cacheprovider \
    --junitxml "$results/tests.xml"
  local status=$?
  pack
  return $status
}

profile() {
  local log="$out/log-profile.txt" status=0
  versions >>"$log" 2>&1
  for model in vit_base_patch16_224 siglip-so400m-384 internvit-300m; do
    step "$log" python3 benchmarks/profile_replay.py --models "$model" --compile \
      --json "$results/profile-b1-$model.json" || status=1
    step "$log" python3 benchmarks/profile_replay.py --models "$model" --batch 32 --iters 50 \
      --json "$results/profile-b32-$model.json" || status=1
    pack
  done
  return $status
}

bench() {  # bench [MODEL]: every benchmark model, or MODEL alone
  local log="$out/log-bench${1:+-$1}.txt" status=0 model models=("$@")
  ((${#models[@]})) || models=(vit_base_patch16_224 siglip-so400m-384 internvit-300m)
  versions >>"$log" 2>&1
  local -A tuning=(  # timm's ViT has fused q/k/v already; SigLIP's GELU is the tanh one
    [vit_base_patch16_224]="--patch-matmul --fuse-gelu approximate"
    [siglip-so400m-384]="--fuse-qkv --patch-matmul --fuse-gelu"
    [internvit-300m]="--fuse-qkv --patch-matmul --fuse-gelu approximate"
  )
  for model in "${models[@]}"; do
    read -r -a flags <<<"${tuning[$model]}"
    step "$log" layergraph bench --model "$model" --compile-region \
      --inductor-option coordinate_descent_tuning=True "${flags[@]}" --compile \
      --iters 50 --json "$results/bench-$model.json" --plot "$results/bench-$model.png" \
      || status=1
    pack
  done
  return $status
}

cuda() {
  local log="$out/log-cuda.txt" status=0
  versions >>"$log" 2>&1
  step "$log" python3 -m pytest -q -m cuda tests -p no:cacheprovider --junitxml "$results/cuda-tests.xml" || status=1
  pack
  return $status
}

traffic() {
  local log="$out/log-traffic.txt" status=0
  local speed=(--compile-region --inductor-option coordinate_descent_tuning=True --fuse-qkv
    --patch-matmul --fuse-gelu approximate)
  versions >>"$log" 2>&1
  step "$log" layergraph bench --model internvit-300m --stream 120:1-13 "${speed[@]}" \
    --json "$results/stream-internvit-300m.json" || status=1
  pack
  step "$log" layergraph bench --model internvit-300m --start 1,8 "${speed[@]}" \
    --json "$results/start-internvit-300m.json" || status=1
  pack
  return $status
}

fixed() {  # fixed MODEL
  local log="$out/log-fixed-$1.txt" status=0
  versions >>"$log" 2>&1
  step "$log" layergraph bench --model "$1" --batch-sizes 1,2,3,4,8,13,16,32,64 --iters 30 \
    --json "$results/fixed-$1.json" || status=1
  pack
  return $status
}

families() {
  local log="$out/log-families.txt" status=0
  versions >>"$log" 2>&1
  step "$log" python3 -m pytest -q tests/test_cuda_families.py -p no:cacheprovider || status=1
  step "$log" python3 benchmarks/families.py --json "$results/families.json" \
    --markdown "$results/families.md" || status=1
  pack
  return $status
}

tp() {
  local log="$out/log-tp.txt" status=0
  step "$log" timeout -k 10 240 torchrun --nproc-per-node "$gpus" benchmarks/tp_internvit.py \
    --model internvit-6b --batch-sizes 1,8 --json "$results/tp-internvit-6b.json" || status=1
  if ((gpus > 1)); then  # the same tower on one GPU, for comparison
    step "$log" timeout -k 10 240 torchrun --nproc-per-node 1 benchmarks/tp_internvit.py \
      --model internvit-6b --batch-sizes 1,8 --json "$results/tp-internvit-6b-one-gpu.json" \
      || status=1
  fi
  pack
  return $status
}

for part in "${parts[@]}"; do
  case $part in
    checks | tests | profile | bench | tp | cuda | traffic | families | bench:* | fixed:*) ;;
    *) echo "unknown part: $part" >&2; exit 2 ;;
  esac
done
status=0
wave=()
run_wave() {  # the parts in $wave side by side, part i on GPU i
  local pids=() index=0 part argument
  for part in "${wave[@]}"; do
    argument=""
    [[ $part == *:* ]] && argument=${part#*:}
    (CUDA_VISIBLE_DEVICES=$index "${part%%:*}" ${argument:+"$argument"}) & pids+=($!)
    index=$((index + 1))
  done
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  wave=()
}
for part in "${parts[@]}"; do
  [[ $part == tp ]] && continue
  wave+=("$part")
  if ((${#wave[@]} == gpus)); then run_wave; fi
done
if ((${#wave[@]})); then run_wave; fi
if [[ " ${parts[*]} " == *" tp "* ]]; then tp || status=1; fi
tail -n 5 "$out"/log-*.txt
exit $status
