#!/usr/bin/env bash
# A GPU session's checks as prepared device calls (a lease is 15 minutes, start included; a
# call at most 10):
#
#   bash benchmarks/gpu_session.sh bench      # bench_cuda.py and its --profile (< 10 min)
#   bash benchmarks/gpu_session.sh train      # train.py resumed bitwise, 6 jobs (< 10 min)
#   DEADLINE=560 bash benchmarks/gpu_session.sh "bench train profile"   # one call: all of it,
#                                             # each part cut to what is left of 560 s
#   QUICK=1 bash benchmarks/gpu_session.sh    # all, here on a CPU, tiny (~30 s)
#
# bench: bench_cuda.py's checks (PASS/FAIL) and timed tables (issue 28's flags, lean state,
# compiled mixed precision), then its --profile. train: train.py on the machine's device, one
# process: the debug job, mixed precision with remainders + bf16 moments compiled, the
# in-backward job, and AdamW with bf16 and with 8-bit moments (eager and compiled), 30 steps
# with checkpoints every 10, then the same command resumed from step 20 must log steps 21-30
# as the first run did (loss, grad norm, ...). Files go to $OUT (the device tool's folder that
# comes back: 4 here, every job's logs in train.log), else ./gpu-out; the last lines (also
# summary.txt) say what held.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
rm -f "$out/train.log"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
quick=${QUICK:+--quick}
steps=30
[ -n "$quick" ] && steps=6
every=$((steps / 3))
summary=()

parts=${1:-bench train profile}
# Seconds the whole script may take (a device call's limit less the transfers); each part's
# timeout is cut to what is left of it, so that the summary is always written.
deadline=${DEADLINE:-100000}
# limited CAP CMD...: CMD under `timeout`, at most CAP seconds and at most what is left.
limited() {
    local cap=$1 left=$((deadline - SECONDS - 5))
    shift
    ((left < cap)) && cap=$left
    ((cap < 1)) && return 124
    timeout "$cap" "$@"
}

summary+=("$($py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
    torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')")")
if [[ $parts == *bench* ]]; then
    limited 400 $py benchmarks/bench_cuda.py $quick --tables lean,check,lean 2>&1 | tee "$out/bench_cuda.txt"
    summary+=("bench_cuda: exit ${PIPESTATUS[0]} at ${SECONDS} s, $(grep -c '^PASS' "$out/bench_cuda.txt") PASS, $(grep -c '^FAIL' "$out/bench_cuda.txt") FAIL")
fi

# A run's log lines of the steps after 2/3 of the run, without what may differ on a resume
# (the time, speed and memory fields).
steps_of() {
    grep -E "INFO step +[0-9]+ " "$1" |
        sed -E 's/^.*INFO //; s/ +(tokens_per_s|step_time_s|peak_memory_gib|eta_s) [^ ]+//g' |
        awk -v from=$((2 * every)) '$2 > from'
}

# Train `name` for `steps` steps with checkpoints, then resume it from step 2/3 of the way:
# the steps after must log the same. Both runs' logs go to $out/<name>.log.
resumes() {
    local name=$1
    shift
    local dump="/tmp/gpu-session/$name"
    rm -rf "$dump"
    mkdir -p "$dump"
    local args=(--job.dump_folder "$dump" --training.steps "$steps" --metrics.log_freq 1
        --lr_scheduler.warmup_steps 2 --checkpoint.enable --checkpoint.interval "$every" "$@")
    [ -n "$quick" ] && args+=(--model.flavor tiny --training.seq_len 32 --training.local_batch_size 2)
    limited 90 $py train.py "${args[@]}" > "$dump/first.log" 2>&1
    local first=$?
    rm -rf "$dump/checkpoint/step-$steps"
    limited 90 $py train.py "${args[@]}" > "$dump/resumed.log" 2>&1
    local second=$?
    { echo "==== $name: first run"; cat "$dump/first.log"; echo "==== $name: resumed"
        cat "$dump/resumed.log"; } >> "$out/train.log"
    local a b same=FAIL
    a=$(steps_of "$dump/first.log")
    b=$(steps_of "$dump/resumed.log")
    [ -n "$a" ] && [ "$a" == "$b" ] && [ "$(echo "$b" | wc -l)" -eq "$every" ] && same=PASS
    summary+=("$same  train.py $name: exits $first/$second at ${SECONDS} s, steps $((2 * every + 1))-$steps of the resumed run as the first's ($(echo "$b" | grep -c .) lines)")
}

if [[ $parts == *train* ]]; then
    # the jobs no GPU has run yet first (AdamW's moments in 8-bit codes and in bf16, torch's
    # kernel over them where it takes them)
    resumes adamw_8bit_moments --job.config_file config/debug.toml --optimizer.moment_dtype 8bit
    resumes adamw_bf16_moments --job.config_file config/debug.toml --optimizer.moment_dtype bfloat16
    resumes adamw_8bit_moments_compiled --job.config_file config/debug.toml \
        --optimizer.moment_dtype 8bit --optimizer.implementation compiled
    resumes in_backward --job.config_file config/in_backward.toml
    resumes lean_mixed_precision --job.config_file config/mixed_precision.toml \
        --optimizer.implementation compiled --mixed_precision.store_param_remainders \
        --optimizer.moment_dtype bfloat16
    resumes debug --job.config_file config/debug.toml
fi

if [[ $parts == *profile* ]]; then
    limited 170 $py benchmarks/bench_cuda.py $quick --profile > "$out/profile.txt" 2>&1
    summary+=("bench_cuda --profile: exit $? at ${SECONDS} s")
fi

printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
