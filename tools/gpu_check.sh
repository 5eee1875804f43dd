#!/usr/bin/env bash
# The GPU checks of the README's "GPU (CUDA)" section in one command, each part bounded in time and
# logged as it goes, so a run cut short still says which tests passed and failed.
#
#   bash tools/gpu_check.sh [PARTS] [OUT]
#
# PARTS: comma-separated, in order (default tier,main):
#   tier            the cuda tier (python -m pytest -m cuda) on $JOBS processes (pytest-xdist), one line
#                   per test as it ends (tier.log), each failure's traceback and each test's seconds
#                   as it ends (tier-failures.txt, tier-durations.txt: tests/run_log.py), tracebacks again
#                   at the end, JUnit XML (tier.xml)
#   main            the README's GPU main job: ovqflex train --device cuda + eval at 64..1024 (main.log)
#   routing|stages|op-ovq|op-kvm|op-vq|dynamic|train
#                   that part of profiles/gpu.toml (bench.log; its JSON and plot in OUT/bench/PART/, so
#                   that the parts of one call keep theirs), at the lengths $BENCH_SEQ_LENS if set
#                   (comma-separated: ovqflex bench --seq-lens; not for train, which has none)
#   decode-single|decode-batched|generate
#                   that part of profiles/decode.toml (the same)
#   experiment      one slice of ovqflex experiment $EXP (default icr) --scale $EXP_SCALE (default gpu)
#                   in $EXP_DIR (default runs/experiments/$EXP-$EXP_SCALE), resumed if it holds one, with
#                   --drop-checkpoints; only $EXP_MODELS / $EXP_SEEDS if set (comma-separated; a resume may
#                   add models and seeds, not drop them: list the earlier slices' too), --steps $EXP_STEPS
#                   and --jobs $EXP_JOBS if set (experiment.log). Then EXP_DIR is packed for the next
#                   slice, on this machine or a fresh one, as OUT/experiment.tgz.00, .01, ... (gzip'd
#                   tar cut into pieces of $EXP_PIECE_MB MiB, default 15): the finished runs' reports
#                   and logs, and the newest checkpoint of a run cut off in training, so that the next
#                   slice continues it from its last step (the icr gpu scale's `tiny` run's is ~5 MB, so
#                   --jobs 5 carries at most ~25 MB; a `small` run's is ~39 MB, 3 pieces, so there use
#                   --jobs 1: a call brings back at most 8 files, 64 MiB). $EXP_FROM, a folder
#                   holding such pieces, is unpacked into EXP_DIR first; EXP_DIR must then not hold an
#                   experiment yet
#   profile         ovqflex profile of the OVQ (N = 2048) and KVM (power law 16 sqrt(ctx), uncapped) layers at
#                   $PROFILE_T tokens (default 65536; H = 8, d = 64, chunk 128, fp32, forward without grad) on
#                   $DEVICE, $PROFILE_KERNELS kernels a stage (default 8; profile.log, traces in /tmp): each
#                   stage's device busy time and span and its kernels' time (a CUDA graph's kernels count in
#                   the stage that replayed it), so whether the routing graph is bound by its kernels (busy
#                   ~ span) or by their launches (span >> busy); both layers within one PART_S
#   pilot           ovqflex pilot $EXP --scale $EXP_SCALE (defaults as above) --models $PILOT_MODELS
#                   (default: all) --lrs $PILOT_LRS (default 5e-3: the icr gpu scale's) --stop-after
#                   $PILOT_STEPS (default 600: the icr gpu scale's steps at its first warm-up length) into
#                   $PILOT_DIR (default runs/experiments/$EXP-$EXP_SCALE-pilot; pilot.log, and its pilot.md
#                   and pilot.json copied to OUT): whether each model (at each learning rate) leaves the
#                   no-recall plateau in a run's first steps, before whole runs are paid for
# OUT: the folder for the logs (default gpu-check-out). Each part gets at most $PART_S seconds
# (default 420), every test of the tier at most $TEST_S (default 300); $JOBS defaults to the CPU count
# less one, at most 15; $DEVICE (default cuda) is the device of the main job, the experiment and the
# benches (the tier's is OVQFLEX_CUDA_TIER_DEVICE, tests/cuda/conftest.py); $COMMIT names the code
# measured where the copy has no git history. Needs a CUDA build of torch and the project with its gpu
# and test extras (pip install -e ".[gpu,test]": the tier's pytest-xdist and pytest-timeout come with
# them).
set -u
cd "$(dirname "$0")/.."
PARTS=${1:-tier,main}
OUT=${2:-gpu-check-out}
PART_S=${PART_S:-420}
DEVICE=${DEVICE:-cuda}
TEST_S=${TEST_S:-300}
JOBS=${JOBS:-$(( $(nproc) > 16 ? 15 : $(nproc) - 1 ))}
GPU_PARTS="routing stages op-ovq op-kvm op-vq dynamic train"
DECODE_PARTS="decode-single decode-batched generate"
OWN_PARTS="tier main experiment pilot profile"
in_list() { case " $2 " in *" $1 "*) return 0 ;; esac; return 1; }  # in_list WORD "WORD WORD ..."

experiment_dir() { echo "${EXP_DIR:-runs/experiments/${EXP:-icr}-${EXP_SCALE:-gpu}}"; }

experiment_pieces() {  # the pieces of the pack in EXP_FROM, in order (none: nothing printed)
  local piece
  for piece in "$EXP_FROM"/experiment.tgz.[0-9][0-9]; do [ -f "$piece" ] && echo "$piece"; done
}

check_experiment_from() {  # before any part runs: EXP_FROM holds one pack, and EXP_DIR is free for it
  local dir pieces
  dir=$(experiment_dir)
  pieces=$(experiment_pieces)
  [ -n "$pieces" ] || { echo "EXP_FROM=$EXP_FROM holds no experiment.tgz.NN pieces" >&2; return 2; }
  [ ! -e "$dir/experiment.json" ] ||
    { echo "EXP_DIR=$dir already holds an experiment: EXP_FROM unpacks into an empty or new folder" >&2; return 2; }
}

IFS=, read -ra list <<< "$PARTS"
for part in "${list[@]}"; do
  in_list "$part" "$OWN_PARTS $GPU_PARTS $DECODE_PARTS" ||
    { echo "unknown part '$part' in PARTS: expected one of $OWN_PARTS $GPU_PARTS $DECODE_PARTS" >&2; exit 2; }
done
if [ -n "${EXP_FROM:-}" ] && in_list experiment "${list[*]}"; then check_experiment_from || exit 2; fi
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
start=$(date +%s)
since() { echo $(( $(date +%s) - start )); }

{
  echo "commit ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  python3 -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)" 2>&1
  echo "cpus $(nproc), parts $PARTS, $JOBS test processes"
} > "$OUT/env.txt"
cat "$OUT/env.txt"

tier() {
  # -v prints each test's outcome when it ends: a run killed by its time limit still names its failures
  rm -f "$OUT/tier-failures.txt" "$OUT/tier-durations.txt"
  OVQFLEX_FAILURE_LOG=$OUT/tier-failures.txt OVQFLEX_DURATION_LOG=$OUT/tier-durations.txt \
    timeout "$PART_S" python3 -m pytest -m cuda -v -n "$JOBS" --timeout "$TEST_S" -rfE --tb=short --durations=25 \
      --junitxml "$OUT/tier.xml" -p no:cacheprovider tests/cuda 2>&1 \
    | grep --line-buffered -v -e PytestBenchmarkWarning -e 'warner(' > "$OUT/tier.log"
  local rc=${PIPESTATUS[0]}
  echo "tier: exit $rc after $(since) s; $(grep -c ' PASSED ' "$OUT/tier.log") passed," \
       "$(grep -c ' FAILED ' "$OUT/tier.log") failed, $(grep -c ' SKIPPED ' "$OUT/tier.log") skipped" | tee -a "$OUT/tier.log"
  grep -E '^\[gw[0-9]+\].* (FAILED|ERROR) ' "$OUT/tier.log" | sed 's/^/  /'
  echo "  slowest:"; sort -rn "$OUT/tier-durations.txt" 2>/dev/null | head -5
}

main_job() {
  local run=$OUT/gpu-icr t0=$(date +%s)
  rm -rf "$run"
  timeout "$PART_S" python3 -m ovqflex train --device "$DEVICE" --out "$run" --no-progress > "$OUT/main.log" 2>&1
  echo "train: exit $? in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/main.log"
  local t1=$(date +%s)
  timeout "$PART_S" python3 -m ovqflex eval "$run" --device "$DEVICE" --lengths 64,128,256,1024 >> "$OUT/main.log" 2>&1
  echo "eval: exit $? in $(( $(date +%s) - t1 )) s" | tee -a "$OUT/main.log"
  grep -E '^ *length ' "$OUT/main.log"
}

unpack_experiment() {  # EXP_FROM's pack into EXP_DIR
  local dir pieces=()
  dir=$(experiment_dir)
  mapfile -t pieces < <(experiment_pieces)
  mkdir -p "$dir" && cat "${pieces[@]}" | tar xzf - -C "$dir" ||
    { echo "unpacking ${pieces[*]} into $dir failed" >&2; return 1; }
  echo "unpacked ${#pieces[@]} piece(s), $(cat "${pieces[@]}" | wc -c) bytes, from $EXP_FROM into $dir"
}

pack_experiment() {  # EXP_DIR as OUT/experiment.tgz.NN: every run's newest complete checkpoint, no other
  local dir skip=() ck steps=() step rc kept=
  dir=$(experiment_dir)
  for ck in "$dir"/*/checkpoints; do
    [ -d "$ck" ] || continue
    skip+=("--exclude=${ck#"$dir"/}/.*")  # dot-named: a write cut off, or one being discarded
    mapfile -t steps < <(ls -1d "$ck"/step_* 2>/dev/null | sort)  # step_NNNNNNNN: sorted by step
    (( ${#steps[@]} )) || continue
    for step in "${steps[@]:0:${#steps[@]}-1}"; do skip+=("--exclude=${step#"$dir"/}"); done
    kept="$kept ${steps[-1]#"$dir"/}"
  done
  rm -f "$OUT"/experiment.tgz.[0-9][0-9]
  tar czf - "${skip[@]}" -C "$dir" . | split -b "${EXP_PIECE_MB:-15}M" -d -a 2 - "$OUT/experiment.tgz."
  rc=("${PIPESTATUS[@]}")
  [ "${rc[0]}${rc[1]}" = 00 ] || { echo "  packing $dir failed (tar exit ${rc[0]}, split exit ${rc[1]})"; return 1; }
  local pieces=("$OUT"/experiment.tgz.[0-9][0-9])
  echo "  $dir -> ${#pieces[@]} piece(s), $(cat "${pieces[@]}" | wc -c) bytes: $OUT/experiment.tgz.NN;" \
       "checkpoints kept:${kept:- none}"
}

experiment() {
  local name=${EXP:-icr} scale=${EXP_SCALE:-gpu} t0=$(date +%s) resume= dir
  dir=$(experiment_dir)
  : > "$OUT/experiment.log"
  if [ -n "${EXP_FROM:-}" ]; then
    unpack_experiment 2>&1 | tee -a "$OUT/experiment.log"
    [ "${PIPESTATUS[0]}" = 0 ] || return 1
  fi
  [ -f "$dir/experiment.json" ] && resume=--resume
  # --foreground: the signal reaches ovqflex alone, which stops its training with a checkpoint and
  # exits; sent to the whole process group it would also kill inductor's compiler subprocesses
  timeout --foreground -k 60 "$PART_S" python3 -m ovqflex experiment "$name" --scale "$scale" --device "$DEVICE" \
      --out "$dir" $resume --drop-checkpoints --no-progress ${EXP_MODELS:+--models "$EXP_MODELS"} ${EXP_SEEDS:+--seeds "$EXP_SEEDS"} \
      ${EXP_STEPS:+--steps "$EXP_STEPS"} ${EXP_JOBS:+--jobs "$EXP_JOBS"} >> "$OUT/experiment.log" 2>&1
  echo "experiment $name${resume:+ (resumed)}: exit $? in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/experiment.log"
  pack_experiment | tee -a "$OUT/experiment.log"
}

pilot() {
  local name=${EXP:-icr} scale=${EXP_SCALE:-gpu} t0=$(date +%s) dir
  dir=${PILOT_DIR:-runs/experiments/$name-$scale-pilot}  # ovqflex pilot's default
  timeout --foreground -k 60 "$PART_S" python3 -m ovqflex pilot "$name" --scale "$scale" --device "$DEVICE" \
      ${PILOT_MODELS:+--models "$PILOT_MODELS"} --lrs "${PILOT_LRS:-5e-3}" --stop-after "${PILOT_STEPS:-600}" \
      --out "$dir" > "$OUT/pilot.log" 2>&1
  echo "pilot $name: exit $? in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/pilot.log"
  cp "$dir"/pilot.md "$dir"/pilot.json "$OUT"/ 2>/dev/null && cat "$OUT/pilot.md"
}

profile_layers() {  # both layers within PART_S together
  local target opts left end=$(( $(date +%s) + PART_S ))
  : > "$OUT/profile.log"
  for target in ovq kvm; do
    left=$(( end - $(date +%s) ))
    (( left > 0 )) || { echo "profile $target: no time left of PART_S=$PART_S" | tee -a "$OUT/profile.log"; continue; }
    if [ "$target" = ovq ]; then opts=(--opt max_centroids=2048)
    else opts=(--opt budget=power_law --opt growth_factor=16.0 --opt growth_exponent=0.5 --opt max_state_chunks=null
               --opt n_bswa_chunks=2 --opt sink_len=1)
    fi
    echo "== $target" >> "$OUT/profile.log"
    timeout "$left" python3 -m ovqflex profile "$target" --device "$DEVICE" --seq-len "${PROFILE_T:-65536}" --heads 8 \
      --head-dim 64 --opt chunk_size=128 "${opts[@]}" --mode fwd --steps 2 --kernels "${PROFILE_KERNELS:-8}" \
      --trace "/tmp/gpu-check-profile-$target.json" >> "$OUT/profile.log" 2>&1
    echo "profile $target: exit $? at $(since) s" | tee -a "$OUT/profile.log"
  done
  grep -E '^(mode +stage +(calls/step|op|kernel) |fwd +routing)' "$OUT/profile.log"  # the routing rows under their headers
}

bench() {  # bench PROFILE PART
  echo "== $1 --only $2${BENCH_SEQ_LENS:+ --seq-lens $BENCH_SEQ_LENS}" >> "$OUT/bench.log"
  timeout "$PART_S" python3 -m ovqflex bench "profiles/$1.toml" --device "$DEVICE" --only "$2" --out "$OUT/bench/$2" \
    ${BENCH_SEQ_LENS:+--seq-lens "$BENCH_SEQ_LENS"} >> "$OUT/bench.log" 2>&1
  echo "$1 --only $2: exit $? at $(since) s" | tee -a "$OUT/bench.log"
}

for part in "${list[@]}"; do
  if [ "$part" = tier ]; then tier
  elif [ "$part" = main ]; then main_job
  elif [ "$part" = experiment ]; then experiment
  elif [ "$part" = pilot ]; then pilot
  elif [ "$part" = profile ]; then profile_layers
  elif in_list "$part" "$GPU_PARTS"; then bench gpu "$part"
  else bench decode "$part"  # the parts were checked above: the rest are DECODE_PARTS
  fi
done
echo "done after $(since) s; logs in $OUT"
