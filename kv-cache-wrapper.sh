#!/usr/bin/env bash
# kv-cache-wrapper.sh: detect the hardware, then run the KV-cache benchmark's scenario suite
# and compare the runs. Needs bash, coreutils and python3 (with the project's requirements).
#
#   ./kv-cache-wrapper.sh                          # all scenarios, defaults
#   ./kv-cache-wrapper.sh -w storage-only,production -t 60
#   ./kv-cache-wrapper.sh -m tiny-1b -t 5 -s 5 -r 5 -a 20 -w cpu-only,storage-only,production -o out
#   ./kv-cache-wrapper.sh -w mlperf_submission     # MLPerf submission: 300 s runs, 5/5/3 trials (~65 min)
#   ./kv-cache-wrapper.sh -n                       # print the commands, run nothing
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BENCH="${SCRIPT_DIR}/kv-cache.py"
PYTHON="${PYTHON:-python3}"
SEED=42

ALL_WORKLOADS="gpu-only cpu-only storage-only gpu-cpu cpu-storage gpu-cpu-storage storage-saturation production autoscale capacity-autoscale mlperf_submission"
GPU_WORKLOADS=" gpu-only gpu-cpu gpu-cpu-storage "
# The storage tier is always the cache's last tier, but only these scenarios are built to put
# the KV cache on it: small or no memory budgets (storage-only, cpu-storage, gpu-cpu-storage,
# storage-saturation, capacity-autoscale, the MLPerf submission options) or the full three-tier
# hierarchy under growing or production load (production, autoscale). gpu-only, cpu-only and
# gpu-cpu compare the memory tiers; storage there is only an overflow the comparison avoids.
STORAGE_WORKLOADS=" storage-only cpu-storage gpu-cpu-storage storage-saturation production autoscale capacity-autoscale mlperf_submission "

MODEL="llama3.1-8b"
TIER_S=120
SATURATION_S=180
SUBMISSION_S=300        # seed 001, MLPerf Submission Guidelines: --duration 300; -s sets it too
PRODUCTION_S=180
AUTOSCALE_S=300
WORKLOADS=""
WORKLOADS_GIVEN=0
USERS=""
HIGH_USERS=""
CPU_MEM_GB=""
RAG=0
RAG_DOCS=10
CACHE_DIR=""
RESULTS_DIR=""
# Trials per MLPerf submission option, in run order (seed 001: options 1 and 2 loop over
# trials 1-5, option 3 over 1-3); -T sets one count for all. Reported as the median.
SUBMISSION_OPTIONS=(stress8b throughput8b stress70b)
declare -A SUBMISSION_TRIALS=([stress8b]=5 [throughput8b]=5 [stress70b]=3)
DRY_RUN=0

usage() {
    cat <<EOF
Usage: $(basename "$0") [options]
  -m MODEL   model (default: ${MODEL})
  -t SECONDS duration of the tier comparison tests (default: ${TIER_S})
  -s SECONDS duration of the storage saturation test (default: ${SATURATION_S})
             and of each MLPerf submission run (default: ${SUBMISSION_S})
  -r SECONDS duration of the production test (default: ${PRODUCTION_S})
  -a SECONDS duration of the autoscaling tests (default: ${AUTOSCALE_S})
  -w LIST    comma-separated workloads (default: all):
             ${ALL_WORKLOADS// /, }
  -u USERS   baseline user count (default: from RAM)
  -U USERS   high-load user count (default: from RAM)
  -C GB      CPU tier budget in GiB, taken whole by each run that has the tier
             (default: a quarter of RAM, at most 32)
  -R         add the RAG workload to every run
  -D DOCS    RAG documents (default: ${RAG_DOCS})
  -c DIR     cache directory on the storage under test (default: /mnt/nvme, /mnt/ssd, else a temporary directory)
  -o DIR     results directory (default: ./kv_cache_results_<timestamp>)
  -T N       trials of every MLPerf submission option, reported as the median
             (default: ${SUBMISSION_TRIALS[stress8b]}, ${SUBMISSION_TRIALS[throughput8b]} and ${SUBMISSION_TRIALS[stress70b]} for options 1-3: ${SUBMISSION_OPTIONS[*]})
  -n         dry run: print the commands, run nothing
  -h         this help
EOF
}

die_usage() {
    echo "$(basename "$0"): error: $*" >&2
    usage >&2
    exit 2
}

is_positive_int() { [[ "$1" =~ ^[1-9][0-9]{0,8}$ ]]; }      # nine digits at most: bash arithmetic never overflows

# check_int NAME VALUE MAX: VALUE is an integer from 1 to MAX, else exit 2 naming NAME
check_int() {
    is_positive_int "$2" && (( $2 <= $3 )) || die_usage "$1 needs an integer from 1 to $3, got '$2'"
}

set_submission_trials() {   # set_submission_trials N: -T, N trials for every submission option
    local option
    for option in "${SUBMISSION_OPTIONS[@]}"; do SUBMISSION_TRIALS[$option]="$1"; done
}

parse_args() {
    local opt
    while getopts ":m:t:s:r:a:w:u:U:C:RD:c:o:T:nh" opt; do
        case "$opt" in
            m) MODEL="$OPTARG" ;;
            t) TIER_S="$OPTARG" ;;
            s) SATURATION_S="$OPTARG"; SUBMISSION_S="$OPTARG" ;;
            r) PRODUCTION_S="$OPTARG" ;;
            a) AUTOSCALE_S="$OPTARG" ;;
            w) WORKLOADS="${OPTARG//,/ }"; WORKLOADS_GIVEN=1 ;;
            u) USERS="$OPTARG" ;;
            U) HIGH_USERS="$OPTARG" ;;
            C) CPU_MEM_GB="$OPTARG" ;;
            R) RAG=1 ;;
            D) RAG_DOCS="$OPTARG" ;;
            c) CACHE_DIR="$OPTARG" ;;
            o) RESULTS_DIR="$OPTARG" ;;
            T) set_submission_trials "$OPTARG" ;;
            n) DRY_RUN=1 ;;
            h) usage; exit 0 ;;
            :) die_usage "option -$OPTARG needs a value" ;;
            *) die_usage "unknown option -$OPTARG" ;;
        esac
    done
    shift $((OPTIND - 1))
    [ $# -eq 0 ] || die_usage "unexpected argument: $1"
    local value
    for value in "$TIER_S" "$SATURATION_S" "$SUBMISSION_S" "$PRODUCTION_S" "$AUTOSCALE_S" "$RAG_DOCS" \
                 "${SUBMISSION_TRIALS[@]}"; do
        is_positive_int "$value" || die_usage "a positive integer is needed, got '${value}'"
    done
    for value in "$TIER_S" "$SATURATION_S" "$SUBMISSION_S" "$PRODUCTION_S" "$AUTOSCALE_S"; do
        check_int "a duration" "$value" 86400            # kv-cache.py's --duration limit
    done
    for value in "$USERS" "$HIGH_USERS"; do
        [ -z "$value" ] || [[ "$value" =~ ^[0-9]+$ ]] || die_usage "user counts must be positive integers, got '${value}'"
        [ -z "$value" ] || check_int "a user count" "$value" 100000        # kv-cache.py's --num-users limit
    done
    if [ -n "$CPU_MEM_GB" ]; then
        [[ "$CPU_MEM_GB" =~ ^[0-9]+$ ]] || die_usage "-C needs a positive integer (GiB), got '${CPU_MEM_GB}'"
        check_int "-C" "$CPU_MEM_GB" 16384                # kv-cache.py's --cpu-mem-gb limit
    fi
    check_int "-D" "$RAG_DOCS" 1000000
    for value in "${SUBMISSION_TRIALS[@]}"; do check_int "-T" "$value" 1000; done
    if (( WORKLOADS_GIVEN )) && [ -z "${WORKLOADS// /}" ]; then die_usage "-w needs at least one workload"; fi
    WORKLOADS="${WORKLOADS:-$ALL_WORKLOADS}"
    local w
    for w in $WORKLOADS; do
        [[ " $ALL_WORKLOADS " == *" $w "* ]] || die_usage "unknown workload '$w'"
    done
    if [ -n "$RESULTS_DIR" ] && [ -e "$RESULTS_DIR" ] && [ ! -d "$RESULTS_DIR" ]; then
        die_usage "-o ${RESULTS_DIR} exists and is not a directory"
    fi
}

# check_python: python3 can load kv-cache.py and knows MODEL; else one line and exit 2, before any run.
check_python() {
    local why
    why="$("$PYTHON" - "$BENCH" "$MODEL" 2>&1 <<'PYEOF'
import importlib.util, sys
try:
    spec = importlib.util.spec_from_file_location("kv_cache", sys.argv[1])
    kv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kv)
except Exception as exc:
    print(f"{type(exc).__name__}: {exc} (pip install -r requirements.txt)")
    sys.exit(1)
if sys.argv[2] not in kv.MODELS:
    print(f"unknown model '{sys.argv[2]}'; choose from {', '.join(sorted(kv.MODELS))}")
    sys.exit(1)
PYEOF
)" || { echo "$(basename "$0"): error: ${why:-${PYTHON} cannot run ${BENCH}}" | head -n 1 >&2; exit 2; }
}

# --- Hardware detection ---------------------------------------------------------

detect_hardware() {
    GPU_COUNT=0
    GPU_MEM_GB=0
    if command -v nvidia-smi >/dev/null 2>&1; then
        local vram_mib
        # A failing nvidia-smi (no driver) means no GPU, not the end of the suite.
        vram_mib="$( (nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null || true) | head -n 1 | tr -dc '0-9')"
        if [ -n "$vram_mib" ]; then
            GPU_COUNT="$( (nvidia-smi --list-gpus 2>/dev/null || true) | grep -c '^GPU' || true)"
        fi
        # 80 % of the first GPU's memory: the rest is the model's weights and activations.
        [ -n "$vram_mib" ] && GPU_MEM_GB=$(( vram_mib * 8 / 10 / 1024 ))
    fi
    local ram_kib
    ram_kib="$(awk '/^MemTotal:/ {print $2}' /proc/meminfo 2>/dev/null || echo 0)"
    RAM_GB=$(( ram_kib / 1024 / 1024 ))
    # A quarter of RAM for the CPU tier, at most 32 GiB, at least 1 (unless -C gave one).
    if [ -z "$CPU_MEM_GB" ]; then
        CPU_MEM_GB=$(( RAM_GB / 4 ))
        (( CPU_MEM_GB > 32 )) && CPU_MEM_GB=32
        (( CPU_MEM_GB < 1 )) && CPU_MEM_GB=1
    fi
    if (( RAM_GB >= 64 )); then
        USERS="${USERS:-50}"; HIGH_USERS="${HIGH_USERS:-150}"
    else
        USERS="${USERS:-20}"; HIGH_USERS="${HIGH_USERS:-60}"
    fi
    if [ -z "$CACHE_DIR" ]; then
        local candidate
        for candidate in /mnt/nvme /mnt/ssd; do
            if [ -d "$candidate" ] && [ -w "$candidate" ]; then CACHE_DIR="$candidate"; break; fi
        done
        CACHE_DIR="${CACHE_DIR:-${TMPDIR:-/tmp}}"
    fi
    echo "Hardware: ${GPU_COUNT} GPU(s), GPU tier budget ${GPU_MEM_GB} GB; RAM ${RAM_GB} GB, CPU tier budget ${CPU_MEM_GB} GB"
    echo "Users: baseline ${USERS}, high load ${HIGH_USERS} | cache directory: ${CACHE_DIR} | model: ${MODEL}"
}

# --- Running one benchmark -------------------------------------------------------

FAILED=()
declare -A STATUS=()

# is_storage_run NAME: is run NAME one of STORAGE_WORKLOADS (a submission trial counts as mlperf_submission)?
is_storage_run() {
    local workload="$1"
    [[ "$workload" == mlperf_submission_* ]] && workload=mlperf_submission
    [[ "$STORAGE_WORKLOADS" == *" ${workload} "* ]]
}

# run_bench NAME MODEL ARGS...: one kv-cache.py run writing results_NAME.json (and .xlsx);
# a storage run also keeps fio_NAME.fio, an fio job replaying its storage I/O, beside them.
run_bench() {
    local name="$1" model="$2"; shift 2
    local cmd=("$PYTHON" "$BENCH" --model "$model" --cache-dir "$CACHE_DIR" --seed "$SEED"
               --output "${RESULTS_DIR}/results_${name}.json" --xlsx-output "${RESULTS_DIR}/results_${name}.xlsx" "$@")
    if (( RAG )); then cmd+=(--enable-rag --rag-num-docs "$RAG_DOCS"); fi
    if is_storage_run "$name"; then cmd+=(--fio-job "${RESULTS_DIR}/fio_${name}.fio"); fi
    echo
    echo ">>> ${name}: ${cmd[*]}"
    (( DRY_RUN )) && return 0
    local rc=0
    # In the background and waited for, so that a signal to the wrapper runs its trap at once
    # (bash runs traps only between commands); the trap passes the signal on to the run.
    "${cmd[@]}" > "${RESULTS_DIR}/log_${name}.txt" 2>&1 &
    CHILD=$!
    while true; do
        rc=0; wait "$CHILD" || rc=$?
        kill -0 "$CHILD" 2>/dev/null || break            # ended; else a trapped signal woke us
    done
    CHILD=""
    if [ -n "$STOPPED_BY" ]; then
        STATUS[$name]="interrupted (SIG${STOPPED_BY}, exit ${rc})"; FAILED+=("$name")
    elif (( rc == 0 )); then
        STATUS[$name]="ok"
    elif (( rc == 1 )) && [ "$(run_problems "$name")" = "fio_job_nothing_to_replay" ] \
            && ! grep -q "could not write the" "${RESULTS_DIR}/log_${name}.txt"; then
        STATUS[$name]="ok"                               # the suite asked for the fio job, not the run
        echo "    ${name}: nothing reached the storage tier, so no fio job was written (exit 1 ignored)"
    elif (( rc == 1 )) && [ -f "${RESULTS_DIR}/results_${name}.json" ]; then
        STATUS[$name]="degraded"; FAILED+=("$name")
    else
        STATUS[$name]="failed (exit ${rc})"; FAILED+=("$name")
    fi
    printf '%s\t%s\n' "$name" "${STATUS[$name]}" >> "${RESULTS_DIR}/status.tsv"
    echo "<<< ${name}: ${STATUS[$name]} (log: ${RESULTS_DIR}/log_${name}.txt)"
    tail -n 3 "${RESULTS_DIR}/log_${name}.txt" | sed 's/^/    /'
    if [ -n "$STOPPED_BY" ]; then
        echo "Stopped by SIG${STOPPED_BY}: no further scenario runs." >&2
        exit_for_signal
    fi
}

# run_problems NAME: why run NAME's exit status is 1, from its results file, as kv-cache.py says
# (comma-separated; empty when the file cannot be read).
run_problems() {
    "$PYTHON" - "$BENCH" "${RESULTS_DIR}/results_$1.json" 2>/dev/null <<'PYEOF' || true
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("kv_cache", sys.argv[1])
kv = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kv)
with open(sys.argv[2]) as f:
    print(",".join(kv.run_problems(json.load(f))))
PYEOF
}

# on_signal NAME: SIGINT/SIGTERM to the wrapper (or Ctrl-C to its group): pass it on to the
# run in progress, which writes its partial results; then the suite ends (run_bench exits).
CHILD=""
STOPPED_BY=""
on_signal() {
    STOPPED_BY="$1"
    if [ -n "$CHILD" ]; then
        kill -"$1" "$CHILD" 2>/dev/null || true
    else
        echo "Stopped by SIG$1." >&2
        exit_for_signal
    fi
}

exit_for_signal() { if [ "$STOPPED_BY" = INT ]; then exit 130; else exit 143; fi; }

# --- Scenarios (seed 000, section 4) ------------------------------------------------

tier_args() {   # tier_args GPU_GB CPU_GB USERS DURATION
    echo --gpu-mem-gb "$1" --cpu-mem-gb "$2" --num-users "$3" --duration "$4" --generation-mode fast
}

scenario() {
    local w="$1" third=$(( CPU_MEM_GB / 4 > 0 ? CPU_MEM_GB / 4 : 1 ))
    # shellcheck disable=SC2046  # tier_args prints words meant to be split
    case "$w" in
        gpu-only)        run_bench "$w" "$MODEL" $(tier_args "$GPU_MEM_GB" 0 "$USERS" "$TIER_S") ;;
        cpu-only)        run_bench "$w" "$MODEL" $(tier_args 0 "$CPU_MEM_GB" "$USERS" "$TIER_S") ;;
        storage-only)    run_bench "$w" "$MODEL" $(tier_args 0 0.5 "$USERS" "$TIER_S") ;;
        gpu-cpu)         run_bench "$w" "$MODEL" $(tier_args "$GPU_MEM_GB" "$CPU_MEM_GB" "$USERS" "$TIER_S") ;;
        cpu-storage)     run_bench "$w" "$MODEL" $(tier_args 0 "$third" "$USERS" "$TIER_S") ;;
        gpu-cpu-storage) run_bench "$w" "$MODEL" $(tier_args $(( GPU_MEM_GB / 4 )) "$third" "$USERS" "$TIER_S") ;;
        storage-saturation)
            run_bench "$w" "$MODEL" --gpu-mem-gb 0 --cpu-mem-gb 0.5 --num-users "$HIGH_USERS" --duration "$SATURATION_S" \
                --generation-mode none --performance-profile throughput ;;
        production)
            run_bench "$w" "$MODEL" --gpu-mem-gb "$GPU_MEM_GB" --cpu-mem-gb "$CPU_MEM_GB" --num-users "$USERS" \
                --duration "$PRODUCTION_S" --generation-mode realistic ;;
        autoscale)
            run_bench "$w" "$MODEL" --gpu-mem-gb "$GPU_MEM_GB" --cpu-mem-gb "$CPU_MEM_GB" --num-users "$(( USERS / 2 > 0 ? USERS / 2 : 1 ))" \
                --duration "$AUTOSCALE_S" --generation-mode realistic --enable-autoscaling --autoscaler-mode qos ;;
        capacity-autoscale)
            run_bench "$w" "$MODEL" --gpu-mem-gb 0 --cpu-mem-gb 0.5 --num-users 10 --duration "$AUTOSCALE_S" \
                --generation-mode none --enable-autoscaling --autoscaler-mode capacity ;;
        mlperf_submission) mlperf_submission ;;
    esac
}

# submission_args OPTION: the model and the arguments that set MLPerf submission OPTION apart
# (seed 001, "MLPerf Submission Guidelines": options 1-3).
submission_args() {
    case "$1" in
        stress8b)     echo llama3.1-8b --num-users 200 --cpu-mem-gb 0 --max-concurrent-allocs 16 ;;
        throughput8b) echo llama3.1-8b --num-users 100 --cpu-mem-gb 4 --max-concurrent-allocs 0 ;;
        stress70b)    echo llama3.1-70b-instruct --num-users 70 --cpu-mem-gb 0 --max-concurrent-allocs 4 ;;
    esac
}

# The submission runs, SUBMISSION_TRIALS of each option. Trials are interleaved (trial 1 of every
# option, then trial 2, ...) so that slow drift of the drive (heat, SLC cache, fill) spreads over
# all options instead of weighing on the last one.
mlperf_submission() {
    local trial option most=0
    for option in "${SUBMISSION_OPTIONS[@]}"; do
        (( SUBMISSION_TRIALS[$option] > most )) && most="${SUBMISSION_TRIALS[$option]}"
    done
    for (( trial = 1; trial <= most; trial++ )); do
        for option in "${SUBMISSION_OPTIONS[@]}"; do
            (( trial <= SUBMISSION_TRIALS[$option] )) || continue
            # shellcheck disable=SC2046  # submission_args prints words meant to be split
            run_bench "mlperf_submission_${option}_trial${trial}" $(submission_args "$option") \
                --duration "$SUBMISSION_S" --gpu-mem-gb 0 --generation-mode none
        done
    done
}

# --- Comparison ---------------------------------------------------------------------

compare_runs() {
    (( DRY_RUN )) && return 0
    "$PYTHON" - "$BENCH" "$RESULTS_DIR" <<'PYEOF' || echo "warning: the comparison could not be made" >&2
import importlib.util, sys
spec = importlib.util.spec_from_file_location("kv_cache", sys.argv[1])
kv = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kv)
print(kv.suite_comparison(sys.argv[2]))
PYEOF
}

main() {
    trap 'on_signal INT' INT
    trap 'on_signal TERM' TERM
    parse_args "$@"
    check_python
    detect_hardware
    RESULTS_DIR="${RESULTS_DIR:-./kv_cache_results_$(date +%Y%m%d_%H%M%S)}"
    (( DRY_RUN )) || mkdir -p "$RESULTS_DIR"
    local w
    for w in $WORKLOADS; do
        if [[ "$GPU_WORKLOADS" == *" $w "* ]] && (( GPU_MEM_GB == 0 )); then
            echo
            echo "--- ${w}: skipped, no GPU detected (nvidia-smi)"
            continue
        fi
        scenario "$w"
    done
    compare_runs
    if (( ${#FAILED[@]} )); then
        echo "Runs that failed or degraded: ${FAILED[*]}" >&2
        exit 1
    fi
}

main "$@"
