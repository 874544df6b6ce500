# run.sh's machinery, sourced by it after its settings: what is not the loop itself. The settings it derives, the
# stages' shared command lines (train, sample, rollout, evaluate, gen), the simulated human for this run, the shared
# start (warm-up on oracle dialogues, calibrated into a band of validation success, built once for these settings and
# shared by every draw), and validation selection among a method's snapshots (best_of).
EMB=$([ "$MODEL" = embedded ] && echo 1 || echo 0)
TRAIN_LAYERS=$([ "$EMB" = 1 ] && echo 10 || echo 0)  # the embedded run trains the top 10 of 30 layers (README, deviations)
CRITIC_EPOCHS=$([ "$EMB" = 1 ] && echo 2 || echo 4)  # released: 4; and at scale the released optimizer
TRAIN_ARGS=$([ "$EMB" = 1 ] && echo "--schedule constant" || true)
if [ -z "$AGENT_BACKEND" ]; then AGENT_BACKEND=hf
  if [ "$EMB" = 0 ] && "$PY" -c 'import vllm' 2>/dev/null; then AGENT_BACKEND=vllm
  elif [ "$EMB" = 0 ] && nvidia-smi -L >/dev/null 2>&1; then echo "run.sh: $MODEL on a" \
    "GPU without vLLM: install requirements-gpu.txt, or set AGENT_BACKEND=hf to decode token by token on purpose" >&2; exit 1; fi; fi
# the warm-up: its starting share of hasty oracle dialogues, its chance of a turn mistake, the band its validation
# success should land in, retries, its SFT rate and task seed; procedural tasks: a budget of 4 agent turns for
# their 2 hidden facts (docs/curriculum.md, docs/frontend.md). Validation: its task seed and dialogues per task;
# rollouts' batch.
HASTY=0.15 MISTAKE=0.2 BAND=0.25,0.55 TRIES=2 TURNS=10 WARMUP_LR=1e-4 WARMUP_SEED=3 VAL_SEED=4 VAL_SAMPLES=2
ROLLOUT_BATCH=64
[ -z "$TRAIN_TASKS$TEST_TASKS" ] && TURNS=4
echo "run.sh: run directory $RUN$([ -d "$RUN" ] && echo ' (exists: finished stages are reused)')"
for v in TASK_TYPE SMALL SEED MODEL TRAIN_TASKS TEST_TASKS SIMULATOR_URL NPROC AGENT_BACKEND BASELINES ABLATIONS PROMPT_DIR CLIP_MODEL \
  N_TRAIN N_TEST N_VAL N_WARMUP SAMPLES CANDIDATES DATA_FRACTION MC_STATES MAX_NEW_TOKENS LR_CRITIC CRITIC_ARGS LR_DPO LR_MTDPO LR_RFT NLL_DPO NLL_MTDPO TRAIN_TRAJECTORIES; do
  printf '  %s=%s\n' "$v" "${!v-}"; done
mkdir -p "$RUN"; free_kb=$(df -Pk "$RUN" | awk 'NR == 2 {print $4}')  # a whole embedded run writes 3.6 GB
[ "$EMB" = 1 ] && [ "${free_kb:-0}" -lt 6291456 ] && echo "run.sh: warning: $((free_kb / 1048576)) GB free for $RUN (set RUN=dir)" >&2

log() { printf '\n== %s  [%s, %d min in]\n' "$*" "$(date +%H:%M:%S)" $((SECONDS / 60)); }  # the stages' wall time
torchrun() { if [ "$NPROC" -gt 1 ]; then "$PY" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" "$@"; else "$PY" "$@"; fi; }
train() {  # train DIR SCRIPT ARGS: a finished DIR (config.json is written last) is reused, a killed one resumes
  local out=$1; shift; if [ -f "$out/config.json" ]; then echo "reusing $out (delete it to redo)"; return; fi
  torchrun "$@" --output_dir "$out" $TRAIN_ARGS $([ -d "$out/resume" ] || [ -d "$out/resume.old" ] && echo --resume || true); }
sample() {  # sample OUT SCRIPT ARGS: NPROC ranks each sample a shard; OUT (and OUT.states.jsonl) = all the shards
  local out=$1 sfx; shift; torchrun "$@"  # (of any NPROC: a rerun with another NPROC reuses what is finished)
  for sfx in "" .states.jsonl; do ! ls "$out".shard-*-of-*"$sfx" >/dev/null 2>&1 || "$PY" common.py merge "$out" "$sfx"; done
}
rollout() {  # rollout POLICY TASKS OUT [extra args, which win]
  sample "$3" rollout.py --agent_model "$1" --tasks "$2" --output "$3" --agent_backend "$AGENT_BACKEND" --simulator_url "$SIMULATOR_URL" \
    --temperature "$TEMPERATURE" --top_p 1.0 --max_new_tokens "$MAX_NEW_TOKENS" --max_turns "$TURNS" --batch_size "$ROLLOUT_BATCH" \
    --seed "$SEED" --task_type "$TASK_TYPE" ${PROMPT_DIR:+--prompt_dir "$PROMPT_DIR"} "${@:4}"; }
evaluate() { "$PY" evaluate.py --input "$1" --output "${2}_graded.jsonl" --summary "${2}_summary.json" \
  --task_type "$TASK_TYPE" --clip_model "$CLIP_MODEL" "${@:3}"; }  # evaluate IN OUT (OUT_graded.jsonl) [extra]
field() { "$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$1" "$2"; }
gen() { local out=$1; shift; if [ -f "$out" ]; then echo "reusing $out"; else
  "$PY" generate_tasks.py --task_type "$TASK_TYPE" --output "$out" "$@"; fi; }
compare() {  # compare NAME=GRADED,... NAME=POLICY,... [extra]: evaluate.py's paired comparison
  "$PY" evaluate.py --compare "$1" --policies "$2" "${@:3}"; }

if [ -z "$SIMULATOR_URL" ]; then  # the scripted human on a free port, for this run only
  "$PY" simulator.py --port 0 ${PROMPT_DIR:+--prompt_dir "$PROMPT_DIR"} > "$RUN/simulator.log" 2>&1 & trap "kill $! 2>/dev/null || true" EXIT
  for _ in $(seq 1200); do grep -q "ready at" "$RUN/simulator.log" 2>/dev/null && break; sleep 0.1; done
  SIMULATOR_URL=$(sed -n 's/.*ready at \(http[^ ]*\)\/v1.*/\1/p' "$RUN/simulator.log")
  [ -n "$SIMULATOR_URL" ] || { echo "run.sh: the simulated human did not start in 2 min:" >&2; cat "$RUN/simulator.log" >&2; exit 1; }
fi
log "simulated human at $SIMULATOR_URL"

shared_start() {  # S: where the starting policy and the validation tasks live. Procedural tasks: built once for these
  # settings and the code the start runs (not train_critic.py, label_turns.py, credit.py or view.py: a critic variant
  # reuses it), shared by every draw beside this run (the paper starts every method of every draw from one model)
  S=$RUN; [ -z "$TRAIN_TASKS" ] || return 0
  S=$(dirname "$RUN")/start-$({ cat common.py generate_tasks.py rollout.py evaluate.py train_dpo.py simulator.py \
    colbench/*.py machinery/*.py run.sh config/*.sh; echo "$TASK_TYPE $MODEL $N_VAL $N_WARMUP $TURNS $MAX_NEW_TOKENS" \
    "$PROMPT_DIR $CLIP_MODEL $AGENT_BACKEND"; } | sha256sum | cut -c1-12); mkdir -p "$S"
  exec 9>"$S/.lock"; ! command -v flock >/dev/null || flock 9  # a draw beside this one waits, not builds it twice
  echo "run.sh: starting policy and validation tasks in $S (shared by the draws of these settings)"; }
val_of() {  # val_of POLICY TAG [DIR]: POLICY on the validation tasks; VAL_SUCCESS = its success
  local d=${3:-$RUN}; rollout "$1" "$V" "$d/val_$2.jsonl" --samples "$VAL_SAMPLES" --seed 0  # one seed for every
  evaluate "$d/val_$2.jsonl" "$d/val_$2"  # draw's validation and the start's: they compare on the same sampling seeds
  VAL_SUCCESS=$(field "$d/val_$2_summary.json" success_rate); }
warm_up() {  # POLICY: SFT on oracle dialogues, calibrated: redone with another hasty share until validation is in BAND
  local try sfx W next; POLICY=$MODEL VAL_START=start
  if [ "$N_WARMUP" -gt 0 ] && [ -z "$TRAIN_TASKS" ]; then
    gen "$S/warmup_tasks.jsonl" --num_tasks "$N_WARMUP" --seed "$WARMUP_SEED" --split train --exclude "$NOTV"
    for try in $(seq 0 "$TRIES"); do
      sfx=$([ "$try" = 0 ] || echo "_hasty$HASTY"); W=$S/warmup_oracle$sfx
      rollout "$MODEL" "$S/warmup_tasks.jsonl" "$W.jsonl" --agent_backend oracle --oracle_hasty "$HASTY" \
        --oracle_mistake "$MISTAKE" --seed 0
      evaluate "$W.jsonl" "$W"
      train "$S/policy_warm$sfx" train_dpo.py --mode sft --sft_on all --trajectories "${W}_graded.jsonl" \
        --model "$MODEL" --lr "$WARMUP_LR" --batch_size "$BATCH" --task_type "$TASK_TYPE"
      POLICY=$S/policy_warm$sfx; [ "$N_VAL" -gt 0 ] || break
      VAL_START=start$sfx; val_of "$POLICY" "$VAL_START" "$S"
      next=$(awk -v s="$VAL_SUCCESS" -v h="$HASTY" -v b="$BAND" 'BEGIN { split(b, r, ","); if (s < r[1]) h -= 0.1; else if (s > r[2]) h += 0.1; else exit; printf "%.2g", (h < 0 ? 0 : (h > 1 ? 1 : h)) }')
      echo "starting policy (oracle_hasty $HASTY): validation success $VAL_SUCCESS, band [$BAND]${next:+: outside}"; [ -n "$next" ] || break
      [ "$try" -lt "$TRIES" ] || { echo "run.sh: warning: the start is outside [$BAND] after $TRIES retries; used as it is" >&2; break; }; HASTY=$next
    done
  fi
  [ "$N_VAL" -gt 0 ] && [ ! -f "$S/val_${VAL_START}_graded.jsonl" ] && val_of "$POLICY" "$VAL_START" "$S"
  exec 9>&-; }  # the start is built: other draws may go on
best_of() {  # best_of NAME DIR: the start, DIR's snapshots and DIR on the validation tasks; BEST = the highest (a tie: the earliest)
  local name=$1 dir=$2 runs=("start=$S/val_${VAL_START}_graded.jsonl") pols=("start=$POLICY") d tag
  BEST=$dir; [ "$N_VAL" -gt 0 ] || return 0
  for d in $(ls -d "$dir"/step-* 2>/dev/null | sort -V || true) "$dir"; do
    tag=${name}_$(basename "$d"); [ "$d" = "$dir" ] && tag=${name}_end
    val_of "$d" "$tag"
    runs+=("$tag=$RUN/val_${tag}_graded.jsonl") pols+=("$tag=$d")
  done
  compare "$(IFS=,; echo "${runs[*]}")" "$(IFS=,; echo "${pols[*]}")" --select --summary "$RUN/select_$name.json" \
    | tee "$RUN/select_$name.txt"
  BEST=$(field "$RUN/select_$name.json" selected_policy)
}
test_of() {  # test_of NAME POLICY: its test dialogues, graded (a method whose validation kept the start: zero_shot's)
  local name=$1 policy=$2 ref=() f
  if [ "$name" != zero_shot ] && [ "$policy" = "$POLICY" ]; then
    echo "$name is the starting policy: its test dialogues are zero_shot's"
    for f in .jsonl _graded.jsonl _graded.jsonl.run_settings.json; do cp "$RUN/test_zero_shot$f" "$RUN/test_$name$f"; done
  else rollout "$policy" "$T" "$RUN/test_${name}.jsonl"; fi
  [ "$TASK_TYPE" = html ] && [ "$name" != zero_shot ] && ref=(--reference "$RUN/test_zero_shot_graded.jsonl")
  evaluate "$RUN/test_${name}.jsonl" "$RUN/test_${name}" "${ref[@]}"
  RUNS+=("$name=$RUN/test_${name}_graded.jsonl") POLS+=("$name=$policy"); }
