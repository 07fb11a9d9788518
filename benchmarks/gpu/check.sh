#!/usr/bin/env bash
# Every check that needs a GPU, in one run (under 10 minutes on one H200: the sections' limits add up to 590 s),
# written to one report:
#   1. the gpu-marked tests (cuda-ipc weights, in one process and across two);
#   2. the SAO learner step on a ~0.5B random-weight model of the default architecture (qwen2), bf16,
#      FSDP2 on NCCL: tokens/s and MFU against the GPU's dense bf16 peak, eager and then with the
#      bodies compiled as trainer.compile does (learner_step.py --compile), eager on twice the rollouts (does the
#      MFU grow with the batch?), and one step under the profiler
#      (how much of it the GPU was busy, which kernels took the time: what limits the MFU);
#   3. the native engine's throughput (both KV layouts) against transformers' generate, and vLLM's where it imports
#      (engines.py), and one request through each under the profiler (GPU-busy share, host waits per token);
#   4. publish-to-serve time of one version through the file, shm:// and cuda-ipc:// stores (transports.py).
# Each section runs in its own process with its own time limit; one that fails or runs out of time
# is reported as such and the others still run. Exit status 1 when any section failed.
#
#   benchmarks/gpu/check.sh [--dry-run] [--no-compile] [--out FILE] [--wheels DIR] [--sections LIST] [--work DIR]
#
# --dry-run: the same code paths on a CPU in about a minute (tiny model, few steps, gloo instead of
#   NCCL, the gpu tests collected but not run); the default test run runs it
#   (tests/benchmarks/test_gpu_check.py). Its report says it is a dry run and carries no GPU numbers.
# --no-compile: leave out the learner's compiled steps (trainer.compile): torch.compile traces through
#   FSDP2 for about a minute even on the dry run's tiny model; the report says they were not run.
# --out: the report (default benchmarks/results/gpu.md; a dry run's default is under /tmp).
# --wheels DIR: install these wheels first (no index, into a temporary directory put on PYTHONPATH):
#   for a machine without network access whose Python lacks some of the project's packages;
#   benchmarks/gpu/wheels.sh downloads them where there is network.
# --sections LIST: only these, comma-separated (gpu_tests,learner_step,engines,transports; default all): to rerun
#   the ones that failed within what is left of a GPU lease. The report names the ones left out.
# --work DIR: keep each section's log, status and result (JSON, JUnit) in DIR, to bring back with the report
#   (default: a new temporary directory under TMPDIR; the --wheels install lands in it too).
# PYTHON: the interpreter (default .venv/bin/python when it exists, else python3).
set -uo pipefail

DRY_RUN=0
COMPILE=--compile
OUT=""
WHEELS=""
WORK=""
SECTIONS=gpu_tests,learner_step,engines,transports
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY_RUN=1 ;;
        --no-compile) COMPILE="" ;;
        --out) OUT="$2"; shift ;;
        --wheels) WHEELS="$2"; shift ;;
        --sections) SECTIONS="$2"; shift ;;
        --work) WORK="$2"; shift ;;
        *) echo "unknown argument: $1" >&2; exit 2 ;;
    esac
    shift
done
[ -n "$OUT" ] && OUT=$(realpath -m "$OUT")
[ -n "$WHEELS" ] && WHEELS=$(realpath -m "$WHEELS")
[ -n "$WORK" ] && WORK=$(realpath -m "$WORK")
cd "$(dirname "$0")/../.."
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
if [ -n "$WORK" ]; then mkdir -p "$WORK" || exit 2
else WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX"); fi
if [ -z "$OUT" ]; then
    if [ "$DRY_RUN" = 1 ]; then OUT="$WORK/gpu.md"; else OUT=benchmarks/results/gpu.md; fi
fi
if [ -n "$WHEELS" ]; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$WORK/site" "$WHEELS"/*.whl || exit 2
    export PYTHONPATH="$WORK/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1

if [ "$DRY_RUN" = 1 ]; then
    MODE=dry-run
    MODEL=(--size tiny --dtype float32)
    LEARNER=(--rollouts 4 --prompt-tokens 8 --action-tokens 24 --steps 2 $COMPILE)
    ENGINES=(--new-tokens 8 --concurrency 1,4 --generate-prompts 2)
    TRANSPORTS=(--repeats 2)
else
    MODE=gpu
    MODEL=(--size half-b --dtype bfloat16)
    LEARNER=(--rollouts 32 --prompt-tokens 128 --action-tokens 384 --steps 5 $COMPILE)
    ENGINES=(--new-tokens 128 --concurrency 1,16,64 --generate-prompts 4)
    TRANSPORTS=(--repeats 2)
fi

# section NAME SECONDS COMMAND...: run it with a time limit, its output in $WORK/NAME.log, its status in $WORK/NAME.status
section() {
    local name=$1 limit=$2
    shift 2
    [[ ",$SECTIONS," == *",$name,"* ]] || return 0
    echo "== $name (at most ${limit} s)"
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$WORK/$name.log" 2>&1
    local status=$?
    echo "$status $((SECONDS - start))" >"$WORK/$name.status"
    tail -n 3 "$WORK/$name.log"
    echo "== $name: exit status $status after $((SECONDS - start)) s"
}

GPU_TESTS=$(grep -rlE "pytest\.mark\.gpu" tests --include='test_*.py' | sort)
MARKERS=gpu
if ! command -v java >/dev/null; then  # a GPU image without Java cannot start the Kafka broker those tests use
    MARKERS="gpu and not kafka"
    echo "kafka-marked gpu tests deselected: no java on this machine, so no Kafka broker" >"$WORK/gpu_tests.note"
fi
if [ "$DRY_RUN" = 1 ]; then
    section gpu_tests 60 "$PYTHON" -m pytest -p no:cacheprovider --collect-only -q -m "$MARKERS" $GPU_TESTS
else
    section gpu_tests 60 "$PYTHON" -m pytest -p no:cacheprovider -q -rA -m "$MARKERS" --junitxml "$WORK/gpu_tests.xml" \
        $GPU_TESTS
fi
section learner_step 200 "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node 1 \
    benchmarks/gpu/learner_step.py --out "$WORK/learner_step.json" "${MODEL[@]}" "${LEARNER[@]}"
section engines 210 "$PYTHON" benchmarks/gpu/engines.py --out "$WORK/engines.json" "${MODEL[@]}" "${ENGINES[@]}"
section transports 120 "$PYTHON" benchmarks/gpu/transports.py --out "$WORK/transports.json" "${MODEL[@]}" "${TRANSPORTS[@]}"

COMMAND="benchmarks/gpu/check.sh"
[ "$DRY_RUN" = 1 ] && COMMAND="$COMMAND --dry-run"
[ -z "$COMPILE" ] && COMMAND="$COMMAND --no-compile"
[ -n "$WHEELS" ] && COMMAND="$COMMAND --wheels $(basename "$WHEELS")"
COMMAND="$COMMAND --sections $SECTIONS"
"$PYTHON" benchmarks/gpu/report.py --work "$WORK" --out "$OUT" --mode "$MODE" --command "$COMMAND" \
    --sections "$SECTIONS"
status=$?
echo "report: $OUT"
exit $status
