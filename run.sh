#!/usr/bin/env bash
# SWEET-RL on ColBench, the whole loop top to bottom: tasks, warm-up (the shared start), rollouts, critic, turn labels,
# turn-level DPO, baselines, test.  bash run.sh | SMALL=1 bash run.sh | TASK_TYPE=html bash run.sh | BASELINES=1 ...
# Every stage skips or resumes work already on disk under $RUN, so a rerun continues. config/protocol.sh holds the
# machinery that is not the loop (the stages' shared flags, the simulated human, the start's calibration, validation
# selection); config/*.sh the sizes of SMALL=1, of html and of ColBench files (the released recipe).
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
PAIRS_PER_STATE=4 BATCH=8 SNAPSHOTS=2  # turn pairs per labelled state; every update's batch; snapshots for selection
TEMPERATURE=1.0                       # every sampling: rollouts and candidate turns (top_p 1)
DATA_FRACTION=${DATA_FRACTION:-0.2}   # label_turns: share of train trajectories labelled (released: 0.1)
MC_STATES=${MC_STATES:-$([ "$ABLATIONS" = 1 ] && [ "${MODEL:-embedded}" = embedded ] && echo 12 || echo 0)}  # ABLATIONS=1:
# labelled states whose candidates are valued by 16 continuations each (credit_accuracy; at scale ~400 dialogues of
# the 70B human, so 0 unless set)
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-96}  # longest agent turn
LR_CRITIC=${LR_CRITIC:-1e-4}          # released: 2e-7
CRITIC_ARGS=${CRITIC_ARGS:-}          # more train_critic.py flags: a critic variant (the start is reused)
LR_DPO=${LR_DPO:-2e-5} LR_MTDPO=${LR_MTDPO:-6e-5} LR_RFT=${LR_RFT:-6e-5}  # SWEET-RL, the baselines; and each DPO
NLL_DPO=${NLL_DPO:-1} NLL_MTDPO=${NLL_MTDPO:-1}  # method's NLL weight (paper: 0.01): one grid chose each
# (bench/tune_lr.sh, docs/log.md; released: DPO 2e-7, and the paper gives no RFT rate)
TRAIN_TRAJECTORIES=${TRAIN_TRAJECTORIES:-}  # trajectories in the released schema to train from, instead of train rollouts
REPORT_DIALOGUES=40                   # dialogues of each run in the viewer
PY=${PY:-}                            # a python with the requirements (empty: setup.sh makes .venv)
if [ -z "$PY" ]; then bash setup.sh; PY=.venv/bin/python; fi
. config/protocol.sh  # derived settings, the stages' shared flags, the simulated human; the functions used below

log "tasks"; G=$RUN/train_graded.jsonl T=$RUN/test_tasks.jsonl
if [ -n "$TEST_TASKS" ]; then gen "$T" --source file --input "$TEST_TASKS" --num_tasks "$N_TEST"
else gen "$T" --num_tasks "$N_TEST" --seed $((SEED + 1)) --split test; fi  # never a task any draw trains on
shared_start  # S: the start's directory (procedural tasks: start-HASH beside $RUN, shared by every draw)
V=$S/val_tasks.jsonl NOTV=$([ "$N_VAL" -gt 0 ] && echo "$V" || true)  # what train and warm-up tasks exclude
if [ -n "$TRAIN_TASKS" ]; then  # validation = the first N_VAL train-file tasks, held out of training
  [ "$N_VAL" -gt 0 ] && gen "$V" --source file --input "$TRAIN_TASKS" --num_tasks "$N_VAL" --exclude "$T"
  gen "$RUN/train_tasks.jsonl" --source file --input "$TRAIN_TASKS" --num_tasks 0 --exclude "$T,$NOTV"
else
  [ "$N_VAL" -gt 0 ] && gen "$V" --num_tasks "$N_VAL" --seed "$VAL_SEED" --split train
  gen "$RUN/train_tasks.jsonl" --num_tasks "$N_TRAIN" --seed $((SEED + 2)) --split train --exclude "$NOTV"
fi

log "warm-up: SFT on oracle dialogues, the starting policy of every method (docs/curriculum.md)"
warm_up  # POLICY: the start (MODEL itself with N_WARMUP=0 or ColBench files); its validation success

if [ -n "$TRAIN_TRAJECTORIES" ]; then log "train trajectories: $TRAIN_TRAJECTORIES (graded here)"
  evaluate "$TRAIN_TRAJECTORIES" "$RUN/train"
else log "rollouts on train tasks ($SAMPLES per task) with $POLICY"
  rollout "$POLICY" "$RUN/train_tasks.jsonl" "$RUN/train_rollouts.jsonl" --samples "$SAMPLES"
  evaluate "$RUN/train_rollouts.jsonl" "$RUN/train" --k "$SAMPLES"; fi

log "SWEET-RL critic: Bradley-Terry over trajectory pairs, seeing c (train_critic.py)"
critic() { train "$1" train_critic.py --trajectories "$G" --model "$POLICY" --lr "$LR_CRITIC" --epochs "$CRITIC_EPOCHS" \
  --task_type "$TASK_TYPE" --seed "$SEED" --train_layers "$TRAIN_LAYERS" $CRITIC_ARGS "${@:2}"; }
critic "$RUN/critic"
ABLATION=(); if [ -z "$TRAIN_TASKS" ] && [ "$ABLATIONS" = 1 ]; then  # the no-information critic, same candidates
  critic "$RUN/critic_no_training_info" --no_training_info
  ABLATION=(--credit_critics "no_training_info=$RUN/critic_no_training_info"); fi

log "turn labels: candidate turns from pi_ref, ranked by the critic (label_turns.py)"
sample "$RUN/pairs.jsonl" label_turns.py --trajectories "$G" --critic "$RUN/critic" --output "$RUN/pairs.jsonl" \
  --agent_backend "$AGENT_BACKEND" --num_candidates "$CANDIDATES" --pairs_per_state "$PAIRS_PER_STATE" \
  --data_fraction "$DATA_FRACTION" --temperature "$TEMPERATURE" --max_new_tokens "$MAX_NEW_TOKENS" --seed "$SEED" "${ABLATION[@]}"

log "turn credit (credit.py): the candidates' true classes; $MC_STATES states valued by continuations"
credit() { "$PY" credit.py --pairs "$RUN/pairs.jsonl" --trajectories "$G" --max_turns "$TURNS" --seed "$SEED" \
  --states "$MC_STATES"; }
credit; MC=$RUN/pairs.jsonl.mc
if [ "$MC_STATES" -gt 0 ] && [ -s "$MC.jsonl" ]; then rollout "$POLICY" "" "${MC}_rollouts.jsonl" --prefixes "$MC.jsonl"
  [ -f "${MC}_graded.jsonl" ] || "$PY" evaluate.py --input "${MC}_rollouts.jsonl" --output "${MC}_graded.jsonl" \
    --task_type "$TASK_TYPE" --clip_model "$CLIP_MODEL"
  credit; fi  # again: the report with the values

log "SWEET-RL: turn-level DPO on the labelled pairs, selected on validation"
STEPS=$(( ($(wc -l < "$RUN/pairs.jsonl") + BATCH - 1) / BATCH ))  # every method: SWEET-RL's one pass over its pairs
SNAP=$([ "$N_VAL" -gt 0 ] && echo "--snapshots $SNAPSHOTS" || true)  # policies at 1/3 and 2/3 of the steps, for best_of
dpo() { train "$RUN/policy_$1" train_dpo.py --model "$POLICY" --lr "$2" --seed "$SEED" --task_type "$TASK_TYPE" \
  --train_layers "$TRAIN_LAYERS" --steps "$STEPS" --batch_size "$BATCH" $SNAP "${@:3}"; best_of "$1" "$RUN/policy_$1"; }
dpo sweet "$LR_DPO" --mode turn --pairs "$RUN/pairs.jsonl" --nll_coef "$NLL_DPO"; METHODS="zero_shot:$POLICY sweet_rl:$BEST"
if [ "$BASELINES" = 1 ]; then
  log "baselines: multi-turn DPO and rejection fine-tuning (same start, train data, $STEPS steps, selection)"
  dpo mtdpo "$LR_MTDPO" --mode trajectory --trajectories "$G" --nll_coef "$NLL_MTDPO"; METHODS="$METHODS multi_turn_dpo:$BEST"
  dpo rft "$LR_RFT" --mode sft --trajectories "$G"; METHODS="$METHODS rejection_ft:$BEST"
fi
if [ "$N_TEST" = 0 ] && [ -z "$TEST_TASKS" ]; then  # a tuning draw (bench/tune_lr.sh): trained, selected, never tested
  log "done ($RUN): N_TEST=0, no test rollouts; validation in $RUN/select_*.txt"; exit 0; fi

log "test rollouts (same tasks and seeds for every method)"; RUNS=() POLS=()
for m in $METHODS; do test_of "${m%%:*}" "${m#*:}"; done
log "results ($RUN)"
compare "$(IFS=,; echo "${RUNS[*]}")" "$(IFS=,; echo "${POLS[*]}")" --credit "$RUN/pairs.jsonl" \
  --summary "$RUN/results.json" | tee "$RUN/results.txt"
# the teaching view: the test dialogues and the labelled states (ABLATIONS=1: every turn coloured by the critic)
COLOURS=(); [ "$ABLATIONS" = 1 ] && COLOURS=(--critic "$RUN/critic")
"$PY" view.py --trajectories "$(IFS=,; echo "${RUNS[*]}"),train=$G" --states "$RUN/pairs.jsonl.states.jsonl" \
  "${COLOURS[@]}" --task_type "$TASK_TYPE" --max_dialogues "$REPORT_DIALOGUES" --output "$RUN/report.html"
echo "open $RUN/report.html"
log "done ($RUN)"
