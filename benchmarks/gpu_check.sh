#!/usr/bin/env bash
# One-shot GPU check (docs/architecture.md §9): the `gpu`/`te` tests, then the GPU parts of the
# benchmarks that exist, in well under 8 minutes on one H200. Results go to the directory given as
# the first argument (default benchmarks/out/gpu_check); a short table is printed last.
#
#   bash benchmarks/gpu_check.sh [RESULTS_DIR]
#
# A benchmark that is missing, or that has no GPU mode yet, is listed as "skipped"; it never fails
# the script. The exit status is non-zero when the tests or a benchmark that ran failed.
# Environment: PYTHON (default: python), PYTEST_TIMEOUT_S (300), BENCH_TIMEOUT_S (180).
set -uo pipefail
cd "$(dirname "$0")/.."

out="${1:-benchmarks/out/gpu_check}"
mkdir -p "$out"
python_bin="${PYTHON:-python}"
pytest_timeout="${PYTEST_TIMEOUT_S:-300}"
bench_timeout="${BENCH_TIMEOUT_S:-180}"
status=0
rows=()

record() {  # name, status, seconds, detail
    rows+=("$(printf '%-28s %-8s %6ss  %s' "$1" "$2" "$3" "$4")")
}

run_step() {  # name, timeout seconds, log file, command...
    local name="$1" seconds="$2" log="$3"
    shift 3
    local start=$SECONDS rc
    timeout --signal=TERM --kill-after=15 "$seconds" "$@" >"$log" 2>&1
    rc=$?
    local took=$((SECONDS - start))
    if [ "$rc" -eq 0 ]; then
        record "$name" "ok" "$took" "$log"
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        record "$name" "TIMEOUT" "$took" "$log"
        status=1
    else
        record "$name" "FAILED" "$took" "$log (rc=$rc)"
        status=1
    fi
    return "$rc"
}

"$python_bin" - >"$out/environment.txt" 2>&1 <<'EOF'
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
print("gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
EOF

# 1. Tests marked gpu or te (tests/conftest.py turns missing hardware into skips with a reason).
# Among them what the CPU scale tests (tests/scale/, fake tensors: bytes and collectives only)
# cannot show, in tests/parallel/test_scale_gpu.py (about half a minute, one fake rank of 8 on this
# GPU): the setup peak of torch.cuda.max_memory_allocated against the rank's shard, and FSDP2
# preparing each block's all-gather on its own stream while the previous block computes.
# Only the files that hold such tests are collected: others may import what a GPU image lacks
# (jsonargparse for the CLI tests), and one collection error would stop the whole run.
mapfile -t gpu_test_files < <(grep -rlE 'pytest\.mark\.(gpu|te)\b' tests --include='test_*.py' | sort)
run_step "pytest -m 'gpu or te'" "$pytest_timeout" "$out/pytest.log" \
    "$python_bin" -m pytest "${gpu_test_files[@]}" -m "gpu or te" -q -rs -p no:cacheprovider \
    --junitxml="$out/pytest.xml"
pytest_summary=$(grep -E '(passed|failed|skipped|error)' "$out/pytest.log" | tail -1)
# The GPU-path checks by name, each one or more of the tests above.
"$python_bin" benchmarks/gpu_path_report.py "$out/pytest.xml" >"$out/gpu_path.txt" 2>&1

# 2. Benchmarks with a GPU mode. Each runs only if the file exists and supports --device cuda.
has_cuda=$("$python_bin" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)
bench() {  # name, script, extra args...
    local name="$1" script="$2"
    shift 2
    if [ "$has_cuda" != "1" ]; then
        record "$name" "skipped" 0 "no CUDA device"
        return
    fi
    if [ ! -f "$script" ]; then
        record "$name" "skipped" 0 "$script not found"
        return
    fi
    if ! grep -q -- '--device' "$script"; then
        record "$name" "skipped" 0 "$script has no --device option yet"
        return
    fi
    run_step "$name" "$bench_timeout" "$out/$name.log" "$python_bin" "$script" --device cuda --output "$out/$name.md" "$@"
}

bench moe_layer benchmarks/moe_layer.py
bench cp_attention benchmarks/cp_attention.py --seq 8192 --batch 2 --heads 16 --head-dim 128
# TODO(benchmarks issue): dispatch bytes/time on NCCL (benchmarks/dispatch.py has no GPU mode yet).
bench dispatch benchmarks/dispatch.py
# TODO(benchmarks issue): end-to-end tokens/s on GPU (benchmarks/train_throughput.py is CPU-only today).
bench train_throughput benchmarks/train_throughput.py
# Saved-activation bytes (benchmarks/memory.py) are exact and device independent: measured on CPU;
# the GPU behaviour of recompute/offload (streams, overlap, gradients) is covered by the gpu tests.

# 3. The plan against a real step on this GPU (benchmarks/plan_gpu_check.py): `lightning-moe plan`'s
# peak for tiny_cpu.yaml on one GPU (TP=1, EP=1, bf16-mixed) beside torch.cuda.max_memory_allocated
# over the same optimizer step of a real 1-GPU fit; fails outside [0.8, 1.25]. The planner and the
# fit parse the configuration with jsonargparse (and its `signatures` extra), which a bare GPU
# image may lack: then it is installed here, without an index, from the wheels in $WHEELS_DIR
# (default benchmarks/wheels, git-ignored; fill it on a machine with network with
# `pip download --no-deps -d benchmarks/wheels jsonargparse typeshed_client docstring_parser`).
# Skipped without a CUDA device, or without jsonargparse and its wheels.
plan_check() {
    local name="plan_vs_gpu" wheels="${WHEELS_DIR:-benchmarks/wheels}"
    if [ "$has_cuda" != "1" ]; then
        record "$name" "skipped" 0 "no CUDA device"
        return
    fi
    if ! "$python_bin" -c 'import jsonargparse, docstring_parser, typeshed_client' 2>/dev/null; then
        if ! compgen -G "$wheels/jsonargparse-*.whl" >/dev/null; then
            record "$name" "skipped" 0 "jsonargparse is not installed and $wheels holds no wheel of it"
            return
        fi
        if ! "$python_bin" -m pip install --no-index --no-deps --find-links "$wheels" \
            jsonargparse typeshed_client docstring_parser >"$out/$name-install.log" 2>&1; then
            record "$name" "skipped" 0 "installing jsonargparse from $wheels failed: $out/$name-install.log"
            return
        fi
    fi
    run_step "$name" "$bench_timeout" "$out/$name.log" \
        env PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$python_bin" benchmarks/plan_gpu_check.py
}
plan_check

echo
echo "GPU check: results in $out"
echo "pytest: ${pytest_summary:-no summary (see $out/pytest.log)}"
cat "$out/gpu_path.txt"
if [ -f "$out/plan_vs_gpu.log" ]; then
    grep -E '^(planned|measured|  outside|ratio|raw ratio|plan_gpu_check)' "$out/plan_vs_gpu.log"
fi
printf '%-28s %-8s %7s  %s\n' "step" "status" "time" "log"
for row in "${rows[@]}"; do
    echo "$row"
done
exit "$status"
