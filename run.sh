#!/usr/bin/env bash
# SWEET-RL on ColBench, the whole loop: tasks -> warm-up -> rollouts -> critics -> turn labels -> DPO -> test.
#   bash run.sh | SMALL=1 bash run.sh | TASK_TYPE=html bash run.sh | BASELINES=1 bash run.sh    (README)
# The embedded CPU default; config/*.sh hold the sizes of SMALL=1, of html and of ColBench files (the released
# recipe). Every stage skips or resumes work already on disk under $RUN, so a rerun continues.
set -euo pipefail
cd "$(dirname "$0")"
TASK_TYPE=${TASK_TYPE:-code}          # code | html
TRAIN_TASKS=${TRAIN_TASKS:-} TEST_TASKS=${TEST_TASKS:-}  # ColBench data (a JSONL or a `datasets` folder) instead of procedural tasks
[ "${SMALL:-0}" = 1 ] && . config/small.sh  # small sizes: a check that the loop runs
[ -n "$TRAIN_TASKS$TEST_TASKS" ] && . config/colbench.sh
[ "$TASK_TYPE" = html ] && . config/html.sh
MODEL=${MODEL:-embedded}              # the starting policy (HF path or id)
RUN=${RUN:-runs/$([ "${SMALL:-0}" = 1 ] && echo small || echo default)}
SEED=${SEED:-0}                       # the draw: train tasks, sampling, critic, updates; test tasks use SEED+1
SIMULATOR_URL=${SIMULATOR_URL:-} NPROC=${NPROC:-1}  # empty: the scripted human; GPUs per stage (torchrun, FSDP2, shards)
AGENT_BACKEND=${AGENT_BACKEND:-}      # hf | vllm (empty: vllm for a non-embedded MODEL)
BASELINES=${BASELINES:-0}             # 1: also multi-turn DPO and rejection fine-tuning
ABLATIONS=${ABLATIONS:-0}             # 1: also the no-information critic, the Monte-Carlo values, the viewer's colours
PROMPT_DIR=${PROMPT_DIR:-} CLIP_MODEL=${CLIP_MODEL:-}  # prompt templates replacing ours; html: a local CLIP model
N_TRAIN=${N_TRAIN:-60} N_TEST=${N_TEST:-200} N_VAL=${N_VAL:-50} N_WARMUP=${N_WARMUP:-240}  # tasks (N_WARMUP=0: no
# warm-up; N_TEST=0 on procedural tasks: a tuning draw, trained and selected but not tested, bench/tune_lr.sh)
SAMPLES=${SAMPLES:-4} CANDIDATES=${CANDIDATES:-8}  # rollouts per train task; candidate turns per state (released: 3, 16)
DATA_FRACTION=${DATA_FRACTION:-0.2}   # label_turns: share of train trajectories labelled (released: 0.1)
MC_STATES=${MC_STATES:-$([ "$ABLATIONS" = 1 ] && [ "${MODEL:-embedded}" = embedded ] && echo 12 || echo 0)}  # ABLATIONS=1:
# labelled states whose candidates are valued by 16 continuations each (credit_accuracy; at scale ~400 dialogues of
# the 70B human, so 0 unless set)
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-96}  # longest agent turn
LR_CRITIC=${LR_CRITIC:-1e-4}          # released: 2e-7
LR_DPO=${LR_DPO:-6e-7} LR_MTDPO=${LR_MTDPO:-2e-6} LR_RFT=${LR_RFT:-6e-5}  # SWEET-RL, the baselines: one grid
# chose each (bench/tune_lr.sh, docs/log.md; released: DPO 2e-7, and the paper gives no RFT rate)
TRAIN_TRAJECTORIES=${TRAIN_TRAJECTORIES:-}  # trajectories in the released schema to train from, instead of train rollouts
PY=${PY:-}                            # a python with the requirements (empty: setup.sh makes .venv)
if [ -z "$PY" ]; then bash setup.sh; PY=.venv/bin/python; fi
EMB=$([ "$MODEL" = embedded ] && echo 1 || echo 0)
TRAIN_LAYERS=$([ "$EMB" = 1 ] && echo 10 || echo 0)  # the embedded run trains the top 10 of 30 layers (README, deviations)
CRITIC_EPOCHS=$([ "$EMB" = 1 ] && echo 2 || echo 4)  # released: 4; and at scale the released optimizer
TRAIN_ARGS=$([ "$EMB" = 1 ] && echo "--schedule constant" || true)
if [ -z "$AGENT_BACKEND" ]; then AGENT_BACKEND=hf
  if [ "$EMB" = 0 ] && "$PY" -c 'import vllm' 2>/dev/null; then AGENT_BACKEND=vllm
  elif [ "$EMB" = 0 ] && nvidia-smi -L >/dev/null 2>&1; then echo "run.sh: $MODEL on a" \
    "GPU without vLLM: install requirements-gpu.txt, or set AGENT_BACKEND=hf to decode token by token on purpose" >&2; exit 1; fi; fi
# the warm-up's starting share of hasty oracle dialogues, its chance of a turn mistake, the band its validation
# success should land in, retries; procedural code tasks: a budget of 4 agent turns for their 2 facts (docs/curriculum.md)
HASTY=0.15 MISTAKE=0.2 BAND=0.25,0.55 TRIES=2 TURNS=10; [ "$TASK_TYPE" = html ] && HASTY=0.5 BAND=0.15,0.5 TRIES=1
[ "$TASK_TYPE" = code ] && [ -z "$TRAIN_TASKS$TEST_TASKS" ] && TURNS=4
echo "run.sh: run directory $RUN$([ -d "$RUN" ] && echo ' (exists: finished stages are reused)')"
for v in TASK_TYPE SMALL SEED MODEL TRAIN_TASKS TEST_TASKS SIMULATOR_URL NPROC AGENT_BACKEND BASELINES ABLATIONS PROMPT_DIR CLIP_MODEL \
  N_TRAIN N_TEST N_VAL N_WARMUP SAMPLES CANDIDATES DATA_FRACTION MC_STATES MAX_NEW_TOKENS LR_CRITIC LR_DPO LR_MTDPO LR_RFT TRAIN_TRAJECTORIES; do
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
if [ -z "$SIMULATOR_URL" ]; then  # the scripted human on a free port, for this run only
  "$PY" simulator.py --port 0 ${PROMPT_DIR:+--prompt_dir "$PROMPT_DIR"} > "$RUN/simulator.log" 2>&1 & trap "kill $! 2>/dev/null || true" EXIT
  for _ in $(seq 1200); do grep -q "ready at" "$RUN/simulator.log" 2>/dev/null && break; sleep 0.1; done
  SIMULATOR_URL=$(sed -n 's/.*ready at \(http[^ ]*\)\/v1.*/\1/p' "$RUN/simulator.log")
  [ -n "$SIMULATOR_URL" ] || { echo "run.sh: the simulated human did not start in 2 min:" >&2; cat "$RUN/simulator.log" >&2; exit 1; }
fi
log "simulated human at $SIMULATOR_URL"
rollout() {  # rollout POLICY TASKS OUT [extra args, which win]
  sample "$3" rollout.py --agent_model "$1" --tasks "$2" --output "$3" --agent_backend "$AGENT_BACKEND" --simulator_url "$SIMULATOR_URL" \
    --temperature 1.0 --top_p 1.0 --max_new_tokens "$MAX_NEW_TOKENS" --max_turns "$TURNS" --batch_size 64 --seed "$SEED" --task_type "$TASK_TYPE" \
    ${PROMPT_DIR:+--prompt_dir "$PROMPT_DIR"} "${@:4}"; }
evaluate() { "$PY" evaluate.py --input "$1" --output "${2}_graded.jsonl" --summary "${2}_summary.json" \
  --task_type "$TASK_TYPE" --clip_model "$CLIP_MODEL" "${@:3}"; }  # evaluate IN OUT (OUT_graded.jsonl) [extra]
field() { "$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$1" "$2"; }
gen() { local out=$1; shift; if [ -f "$out" ]; then echo "reusing $out"; else
  "$PY" generate_tasks.py --task_type "$TASK_TYPE" --output "$out" "$@"; fi; }
log "tasks"; G=$RUN/train_graded.jsonl T=$RUN/test_tasks.jsonl S=$RUN
if [ -n "$TEST_TASKS" ]; then gen "$T" --source file --input "$TEST_TASKS" --num_tasks "$N_TEST"
else gen "$T" --num_tasks "$N_TEST" --seed $((SEED + 1)) --split test; fi  # never a task any draw trains on
if [ -z "$TRAIN_TASKS" ]; then  # S: the starting policy and the validation tasks, built once for these settings and
  # code and shared by every draw beside this one (the paper starts every method of every draw from one model)
  S=$(dirname "$RUN")/start-$({ cat ./*.py run.sh config/*.sh; echo "$TASK_TYPE $MODEL $N_VAL $N_WARMUP" \
    "$TURNS $MAX_NEW_TOKENS $PROMPT_DIR $CLIP_MODEL $AGENT_BACKEND"; } | sha256sum | cut -c1-12); mkdir -p "$S"
  exec 9>"$S/.lock"; ! command -v flock >/dev/null || flock 9  # a draw beside this one waits, not builds it twice
  echo "run.sh: starting policy and validation tasks in $S (shared by the draws of these settings)"; fi
V=$S/val_tasks.jsonl NOTV=$([ "$N_VAL" -gt 0 ] && echo "$V" || true)  # what train and warm-up tasks exclude
if [ -n "$TRAIN_TASKS" ]; then  # validation = the first N_VAL train-file tasks, held out of training
  [ "$N_VAL" -gt 0 ] && gen "$V" --source file --input "$TRAIN_TASKS" --num_tasks "$N_VAL" --exclude "$T"
  gen "$RUN/train_tasks.jsonl" --source file --input "$TRAIN_TASKS" --num_tasks 0 \
    --exclude "$T,$NOTV"
else
  [ "$N_VAL" -gt 0 ] && gen "$V" --num_tasks "$N_VAL" --seed 4 --split train
  gen "$RUN/train_tasks.jsonl" --num_tasks "$N_TRAIN" --seed $((SEED + 2)) --split train --exclude "$NOTV"
fi
val_of() {  # val_of POLICY TAG [DIR]: POLICY on the validation tasks (2 dialogues each); VAL_SUCCESS = its success
  local d=${3:-$RUN}; rollout "$1" "$V" "$d/val_$2.jsonl" --samples 2 --seed 0  # one seed for every draw's
  evaluate "$d/val_$2.jsonl" "$d/val_$2"  # validation and the start's: they compare on the same sampling seeds
  VAL_SUCCESS=$(field "$d/val_$2_summary.json" success_rate); }
POLICY=$MODEL VAL_START=start
if [ "$N_WARMUP" -gt 0 ] && [ -z "$TRAIN_TASKS" ]; then
  log "protocol warm-up: SFT on oracle dialogues (the starting policy of every method; docs/curriculum.md)"
  gen "$S/warmup_tasks.jsonl" --num_tasks "$N_WARMUP" --seed 3 --split train --exclude "$NOTV"
  for try in $(seq 0 "$TRIES"); do  # calibration: redo the warm-up with another hasty share until the start lies in BAND
    sfx=$([ "$try" = 0 ] || echo "_hasty$HASTY"); W=$S/warmup_oracle$sfx
    rollout "$MODEL" "$S/warmup_tasks.jsonl" "$W.jsonl" --agent_backend oracle --oracle_hasty "$HASTY" \
      --oracle_mistake "$MISTAKE" --seed 0
    evaluate "$W.jsonl" "$W"
    train "$S/policy_warm$sfx" train_dpo.py --mode sft --sft_on all --trajectories "${W}_graded.jsonl" \
      --model "$MODEL" --lr 1e-4 --batch_size 8 --task_type "$TASK_TYPE"
    POLICY=$S/policy_warm$sfx; [ "$N_VAL" -gt 0 ] || break
    VAL_START=start$sfx; val_of "$POLICY" "$VAL_START" "$S"
    next=$(awk -v s="$VAL_SUCCESS" -v h="$HASTY" -v b="$BAND" 'BEGIN { split(b, r, ","); if (s < r[1]) h -= 0.1; else if (s > r[2]) h += 0.1; else exit; printf "%.2g", (h < 0 ? 0 : (h > 1 ? 1 : h)) }')
    echo "starting policy (oracle_hasty $HASTY): validation success $VAL_SUCCESS, band [$BAND]${next:+: outside}"; [ -n "$next" ] || break
    [ "$try" -lt "$TRIES" ] || { echo "run.sh: warning: the start is outside [$BAND] after $TRIES retries; used as it is" >&2; break; }; HASTY=$next
  done
fi
[ "$N_VAL" -gt 0 ] && [ ! -f "$S/val_${VAL_START}_graded.jsonl" ] && val_of "$POLICY" "$VAL_START" "$S"
exec 9>&-  # the start is built: other draws may go on
best_of() {  # best_of NAME DIR: the start, DIR's snapshots and DIR on the validation tasks; BEST = the highest (a tie: the earliest)
  local name=$1 dir=$2 runs=("start=$S/val_${VAL_START}_graded.jsonl") pols=("start=$POLICY") d tag
  BEST=$dir; [ "$N_VAL" -gt 0 ] || return 0
  for d in $(ls -d "$dir"/step-* 2>/dev/null | sort -V || true) "$dir"; do
    tag=${name}_$(basename "$d"); [ "$d" = "$dir" ] && tag=${name}_end
    val_of "$d" "$tag"
    runs+=("$tag=$RUN/val_${tag}_graded.jsonl") pols+=("$tag=$d")
  done
  "$PY" evaluate.py --compare "$(IFS=,; echo "${runs[*]}")" --policies "$(IFS=,; echo "${pols[*]}")" --select \
    --summary "$RUN/select_$name.json" | tee "$RUN/select_$name.txt"
  BEST=$(field "$RUN/select_$name.json" selected_policy)
}
SNAP=$([ "$N_VAL" -gt 0 ] && echo "--snapshots 2" || true)  # policies at 1/3 and 2/3 of the steps, for best_of
if [ -n "$TRAIN_TRAJECTORIES" ]; then log "train trajectories: $TRAIN_TRAJECTORIES (graded here)"; evaluate "$TRAIN_TRAJECTORIES" "$RUN/train"
else log "rollouts on train tasks ($SAMPLES per task) with $POLICY"; rollout "$POLICY" "$RUN/train_tasks.jsonl" "$RUN/train_rollouts.jsonl" \
  --samples "$SAMPLES"; evaluate "$RUN/train_rollouts.jsonl" "$RUN/train" --k "$SAMPLES"; fi
log "SWEET-RL: critic -> turn labels -> turn-level DPO"
critic() { train "$1" train_critic.py --trajectories "$G" --model "$POLICY" --lr "$LR_CRITIC" --epochs "$CRITIC_EPOCHS" \
  --task_type "$TASK_TYPE" --seed "$SEED" --train_layers "$TRAIN_LAYERS" "${@:2}"; }
critic "$RUN/critic"  # the SWEET critic: sees c, sum of per-turn mean log-ratios (the paper's)
ABLATION=(); if [ -z "$TRAIN_TASKS" ] && [ "$ABLATIONS" = 1 ]; then  # the no-information critic scores the same candidates
  critic "$RUN/critic_no_training_info" --no_training_info
  ABLATION=(--credit_critics "no_training_info=$RUN/critic_no_training_info"); fi
sample "$RUN/pairs.jsonl" label_turns.py --trajectories "$G" --critic "$RUN/critic" --output "$RUN/pairs.jsonl" \
  --agent_backend "$AGENT_BACKEND" --num_candidates "$CANDIDATES" --pairs_per_state 4 --data_fraction "$DATA_FRACTION" \
  --temperature 1.0 --max_new_tokens "$MAX_NEW_TOKENS" --seed "$SEED" "${ABLATION[@]}"
log "turn credit (credit.py): the labelled candidates' true classes, and those of $MC_STATES states valued by continuations"
credit() { "$PY" credit.py --pairs "$RUN/pairs.jsonl" --trajectories "$G" --max_turns "$TURNS" --seed "$SEED" \
  --states "$MC_STATES"; }
credit; MC=$RUN/pairs.jsonl.mc
if [ "$MC_STATES" -gt 0 ] && [ -s "$MC.jsonl" ]; then rollout "$POLICY" "" "${MC}_rollouts.jsonl" --prefixes "$MC.jsonl"
  [ -f "${MC}_graded.jsonl" ] || "$PY" evaluate.py --input "${MC}_rollouts.jsonl" --output "${MC}_graded.jsonl" \
    --task_type "$TASK_TYPE" --clip_model "$CLIP_MODEL"
  credit; fi  # again: the report with the values
# every method: the same optimizer steps (SWEET-RL's one pass over its pairs) at batch 8, the same snapshots
STEPS=$(( ($(wc -l < "$RUN/pairs.jsonl") + 7) / 8 ))
dpo() { train "$RUN/policy_$1" train_dpo.py --model "$POLICY" --lr "$2" --seed "$SEED" --task_type "$TASK_TYPE" \
  --train_layers "$TRAIN_LAYERS" --steps "$STEPS" --batch_size 8 $SNAP "${@:3}"; best_of "$1" "$RUN/policy_$1"; }
dpo sweet "$LR_DPO" --mode turn --pairs "$RUN/pairs.jsonl"; METHODS="zero_shot:$POLICY sweet_rl:$BEST"
if [ "$BASELINES" = 1 ]; then
  log "baselines: multi-turn DPO and rejection fine-tuning (same start, train data, $STEPS steps, selection)"
  dpo mtdpo "$LR_MTDPO" --mode trajectory --trajectories "$G"; METHODS="$METHODS multi_turn_dpo:$BEST"
  dpo rft "$LR_RFT" --mode sft --trajectories "$G"; METHODS="$METHODS rejection_ft:$BEST"
fi
if [ "$N_TEST" = 0 ] && [ -z "$TEST_TASKS" ]; then  # a tuning draw (bench/tune_lr.sh): its methods are trained and selected, never tested
  log "done ($RUN): N_TEST=0, no test rollouts; validation in $RUN/select_*.txt"; exit 0; fi
log "test rollouts (same tasks and seeds for every method)"; runs=() pols=()
for m in $METHODS; do name=${m%%:*} policy=${m#*:} ref=()
  if [ "$name" != zero_shot ] && [ "$policy" = "$POLICY" ]; then  # validation kept the start: zero_shot's dialogues
    echo "$name is the starting policy: its test dialogues are zero_shot's"
    for f in .jsonl _graded.jsonl _graded.jsonl.run_settings.json; do cp "$RUN/test_zero_shot$f" "$RUN/test_$name$f"; done
  else rollout "$policy" "$T" "$RUN/test_${name}.jsonl"; fi
  [ "$TASK_TYPE" = html ] && [ "$name" != zero_shot ] && ref=(--reference "$RUN/test_zero_shot_graded.jsonl")
  evaluate "$RUN/test_${name}.jsonl" "$RUN/test_${name}" "${ref[@]}"
  runs+=("$name=$RUN/test_${name}_graded.jsonl") pols+=("$name=$policy")
done
log "results ($RUN)"; "$PY" evaluate.py --compare "$(IFS=,; echo "${runs[*]}")" --policies "$(IFS=,; echo "${pols[*]}")" \
  --credit "$RUN/pairs.jsonl" --summary "$RUN/results.json" | tee "$RUN/results.txt"
# the teaching view: the test dialogues and the labelled states (ABLATIONS=1: every turn coloured by the critic)
COLOURS=(); [ "$ABLATIONS" = 1 ] && COLOURS=(--critic "$RUN/critic")
"$PY" view.py --trajectories "$(IFS=,; echo "${runs[*]}"),train=$G" --states "$RUN/pairs.jsonl.states.jsonl" \
  "${COLOURS[@]}" --task_type "$TASK_TYPE" --max_dialogues 40 --output "$RUN/report.html" && echo "open $RUN/report.html"
log "done ($RUN)"
