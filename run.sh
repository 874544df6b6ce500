#!/usr/bin/env bash
# SWEET-RL on ColBench, the whole loop. The default is the embedded CPU setting (SmolLM2-135M agent,
# scripted human, procedural tasks); environment variables scale it up (see README):
#
#   bash run.sh                      # default embedded run
#   SMALL=1 bash run.sh              # a few minutes
#   BASELINES=1 bash run.sh          # + multi-turn DPO and rejection fine-tuning
#   MODEL=meta-llama/Llama-3.1-8B-Instruct SIMULATOR_URL=http://host:8000 NPROC=8 SAMPLES=3 \
#     TRAIN_TASKS=colbench_train.jsonl TEST_TASKS=colbench_test.jsonl bash run.sh   # ColBench, released settings
#
# Every stage skips or resumes work already on disk under $RUN, so a rerun continues.
set -euo pipefail
cd "$(dirname "$0")"

if [ "${SMALL:-0}" = 1 ]; then
  : "${N_TRAIN:=12}" "${N_TEST:=12}" "${N_WARMUP:=60}" "${SAMPLES:=2}" "${CANDIDATES:=4}" "${DATA_FRACTION:=0.2}"
fi
if [ "${TASK_TYPE:-code}" = html ] && [ "${SMALL:-0}" != 1 ] && [ -z "${TRAIN_TASKS:-}${TEST_TASKS:-}" ]; then
  # procedural pages (docs/frontend.md): the warm-up needs more dialogues than code's to write the stated facts
  # into its page; the rest is smaller than code's, as a page costs ~3x a code turn (the first run took ~110 min).
  # WARM_BAND: on SEED=0 the start's exact-design rate was 18% at hasty 0.6, 24% at 0.5 and 24% at 0.4, so html's
  # band starts lower than code's and hasty starts at 0.5; LR_CRITIC: html turn-credit accuracy on SEED=0's stored
  # candidates, 0.661 at 1e-4 and 0.712 at 3e-4 (docs/frontend.md)
  : "${N_TEST:=150}" "${N_WARMUP:=240}" "${ORACLE_HASTY:=0.5}" "${WARM_BAND=0.15,0.5}" "${WARMUP_TRIES:=1}"
  : "${N_TRAIN:=30}" "${N_VAL:=25}" "${CANDIDATES:=6}" "${DATA_FRACTION:=0.25}" "${LR_CRITIC:=3e-4}"
  # ORACLE_SAMPLES 1: a complete-oracle dialogue per train page gives the critic clean successes; on SEED=0's
  # stored candidates turn-credit 0.693 -> 0.736, validation +5.8 -> +8.6 (docs/frontend.md, "Off-policy oracle")
  : "${ORACLE_SAMPLES:=1}"
  # GROUP_BY_TASK 1: the critics score each trajectory once per step for all its pairs (train_critic.py
  # --group_by_task; docs/speed.md)
  : "${GROUP_BY_TASK:=1}"
  # DPO_EPOCHS 0.67 with one snapshot: validates the steps at 1/3 and 2/3 of a pass, which both html updates
  # validated best; at the pass's end 18 of the 50 validation dialogues never answered (docs/frontend.md)
  : "${DPO_EPOCHS:=0.67}" "${SNAPSHOTS:=1}"
  # DPO_CROSS_KIND decision: a pair preferring a question or draft to an answer (or the reverse) trains only the
  # turns' first lines, not the rejected page; on validation, 3 of 4 stored updates kept a better snapshot with it
  # (+12.0, +0.5, +10.7, +7.4 against +11.7, +2.1, +4.2, +6.1; docs/frontend.md, "Pairs of different kinds")
  : "${DPO_CROSS_KIND:=decision}"
  # LABEL_CROSS_KIND decision: labelling ranks a question, draft or answer by the critic's advantage on its first
  # line before the whole turn's; validation kept a better update with it on 3 of 5 draws (SEED=5, 8, 9: +5.9, +14.9,
  # +3.6 against +3.3, +3.8, the start; docs/frontend.md, "A decision ranked by its first line")
  : "${LABEL_CROSS_KIND:=decision}"
  # CRITICS 2: labelling ranks by the mean advantage of two critics of each kind (seeds SEED, SEED+1000), as one
  # critic's seed decides which kind of turn it leans to; on the stored candidates of three draws the mean scored
  # 0.737, 0.730, 0.717 turn-credit against the run's one critic's 0.703, 0.727, 0.478, and gave more right DPO
  # pairs (144, 188, 150 against 133, 184, 79); ~12 min more (docs/frontend.md, "Two critics of each kind become")
  : "${CRITICS:=2}"
  # DECISION_TERMS 1: the critics train each turn's first line, the decision LABEL_CROSS_KIND ranks by, as a term of
  # its own; on the same stored candidates the SWEET pair's mean turn-credit went 0.623 -> 0.727 (SEED=17) and
  # 0.667 -> 0.827 (SEED=18, whose whole run met both policy targets) (docs/frontend.md, "The first line as its own term")
  : "${DECISION_TERMS:=1}"
  : "${REPORT_DIALOGUES:=20}"  # the viewer over html dialogues took 3.8 min at 40 per method
  # TRAIN_DTYPE bfloat16 where the CPU has bf16 instructions: the critics and DPO under bf16 autocast (fp32
  # weights), the warm-up SFT still fp32 (WARMUP_DTYPE auto), as a bf16 warm-up is another starting policy
  # (docs/frontend.md, "bf16 critics and DPO")
  # DECODE_DTYPE, SCORE_DTYPE bfloat16 there too, for time: rollouts and labelling sample in 0.6x the time, labelling
  # scores in 0.64x (docs/speed.md). The html updates' test outcomes spread as widely with fp32 sampling as with
  # bf16 (b244b09's draw lost with one critic and won 59.7% with another; docs/frontend.md)
  BF16_CPU=$(grep -qsE 'avx512_bf16|amx_bf16' /proc/cpuinfo && echo bfloat16 || echo auto)
  : "${DECODE_DTYPE:=$BF16_CPU}" "${SCORE_DTYPE:=$BF16_CPU}"
  : "${TRAIN_DTYPE:=$BF16_CPU}" "${WARMUP_DTYPE:=auto}"
fi
TRAIN_TASKS=${TRAIN_TASKS:-}          # ColBench data (a JSONL or a `datasets` folder) instead of procedural train tasks
TEST_TASKS=${TEST_TASKS:-}            # ... and test tasks
if [ -n "$TRAIN_TASKS$TEST_TASKS" ]; then  # ColBench data: the released settings, unless set
  : "${TEMPERATURE:=1.0}" "${TRAIN_TEMPERATURE:=1.0}" "${TOP_P:=1.0}" "${MAX_NEW_TOKENS:=1024}" "${CRITIC_EPOCHS:=4}"
  : "${CANDIDATES:=16}" "${PAIRS_PER_STATE:=4}" "${DATA_FRACTION:=0.1}" "${LR_CRITIC:=2e-7}" "${LR_DPO:=2e-7}"
  : "${WARMUP:=0}" "${TRAIN_LAYERS:=0}" "${CREDIT_VARIANTS:=0}"  # turn classes need the procedural tasks' scripted human
  : "${N_VAL:=0}"                     # the released recipe selects no checkpoint
fi
RUN=${RUN:-runs/$([ "${SMALL:-0}" = 1 ] && echo small || echo default)}
MODEL=${MODEL:-embedded}              # starting policy (HF path or id)
FREE_GB=${FREE_GB:-$([ "$MODEL" != embedded ] && echo 0 || { [ "${SMALL:-0}" = 1 ] && echo 2 || echo 6; })}  # warn below this much free disk
                                      # (a whole embedded run writes 3.6 GB, code or html: checkpoints; 0: no check)
WARMUP=${WARMUP:-$([ "$MODEL" = embedded ] && echo 1 || echo 0)}  # oracle-dialogue SFT before RL (docs/curriculum.md)
N_WARMUP=${N_WARMUP:-120}             # warm-up tasks (oracle dialogues)
WARMUP_FAMILIES=${WARMUP_FAMILIES:-}  # code families of the warm-up tasks (empty: all, like train and test)
ORACLE_HASTY=${ORACLE_HASTY:-0.8}     # warm-up: share of oracle dialogues that answer before every fact is known (docs/curriculum.md)
WARM_BAND=${WARM_BAND-0.25,0.5}       # warm-up calibration: the starting policy's validation success should lie in this band (empty: no check)
WARMUP_TRIES=${WARMUP_TRIES:-2}       # ... redoing the warm-up at most this many times, ORACLE_HASTY moved by HASTY_STEP each time
HASTY_STEP=${HASTY_STEP:-0.1}
ORACLE_DETOUR=${ORACLE_DETOUR:-0.2}   # warm-up: chance that an oracle question asks about nothing the human knows
N_TRAIN=${N_TRAIN:-60}                # RL train tasks
N_TEST=${N_TEST:-200}                 # test tasks
N_VAL=${N_VAL:-$([ "${SMALL:-0}" = 1 ] && echo 8 || echo 50)}  # validation tasks, held out of train, test and warm-up: each policy update keeps its best snapshot on them (docs/curriculum.md)
VAL_SAMPLES=${VAL_SAMPLES:-2}         # rollouts per validation task
SNAPSHOTS=${SNAPSHOTS:-2}             # policy snapshots saved during each update besides its end (at 1/3 and 2/3 of the steps)
DPO_EPOCHS=${DPO_EPOCHS:-1}           # passes of each policy update over its data (a fraction ends the pass early)
SAMPLES=${SAMPLES:-4}                 # rollouts per train task
ORACLE_SAMPLES=${ORACLE_SAMPLES:-0}  # extra complete-oracle dialogues per train task (off-policy successes)
CANDIDATES=${CANDIDATES:-8}           # label_turns: candidates per state
PAIRS_PER_STATE=${PAIRS_PER_STATE:-4}  # released: 4
DATA_FRACTION=${DATA_FRACTION:-0.2}    # label_turns: share of train trajectories labelled (released: 0.1; 0.2 = ~117 states, docs/curriculum.md)
TEMPERATURE=${TEMPERATURE:-1.0}       # test rollouts: the policy samples its own distribution (docs/curriculum.md)
TRAIN_TEMPERATURE=${TRAIN_TEMPERATURE:-1.0}  # train rollouts: more varied samples give the critic pairs
TOP_P=${TOP_P:-1.0}                   # nucleus sampling of every rollout (1.0: the policy's own distribution)
MAX_TURNS=${MAX_TURNS:-10}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-$([ "${TASK_TYPE:-code}" = html ] && echo 192 || echo 96)}  # a procedural page is 122-161 tokens
LR_WARMUP=${LR_WARMUP:-1e-4}
LR_CRITIC=${LR_CRITIC:-1e-4}          # chosen by turn-credit accuracy on the stored candidates of SEED=0 (docs/curriculum.md; html: above)
SELECT_SIGNIFICANT=${SELECT_SIGNIFICANT:-0}  # 1: keep a snapshot only when its validation gain's paired 95% interval is above 0, else the start
                                      # (html, 15 updates: 5 losses and 3 wins replaced by the start; docs/frontend.md)
DPO_CROSS_KIND=${DPO_CROSS_KIND:-turn}  # SWEET-RL's DPO on pairs of different turn kinds: turn (every token) | decision (first lines; train_dpo.py)
LABEL_CROSS_KIND=${LABEL_CROSS_KIND:-turn}  # labelling ranks candidates by: turn (the whole turn's advantage, paper) | decision
                                      # (first the first line's: the question, draft or answer decided; ours; html's default)
LR_DPO=${LR_DPO:-6e-6}               # chosen on validation tasks (seed 100) over 3e-6 and 1e-5 (docs/curriculum.md, "How far turn-level DPO moves the policy")
TRAIN_LAYERS=${TRAIN_LAYERS:-$([ "$MODEL" = embedded ] && echo 10 || echo 0)}  # critic/DPO train only the top N layers (0 = all; README, deviations)
CRITIC_EPOCHS=${CRITIC_EPOCHS:-2}
FEWER_TURNS=${FEWER_TURNS:-0}         # critics: 1 also pairs two successes of a task, the shorter dialogue chosen (ours; off: html
                                      # SEED=3's turn-credit fell 0.771 -> 0.700 with it, docs/frontend.md)
SHORTCUTS=${SHORTCUTS:-0}             # critics: N also pairs each success against copies that give its answer 1..N turns sooner,
                                      # each copy chosen (ours; off: on one html draw turn-credit fell 0.783 -> 0.722 with it,
                                      # docs/frontend.md, "Sooner answers as critic pairs")
PAIR_FACTS=${PAIR_FACTS:-$([ "${TASK_TYPE:-code}" = html ] && [ -z "$TRAIN_TASKS$TEST_TASKS" ] && echo 1 || echo 0)}  # html on
                                      # procedural pages: 1 ranks the critics' trajectory pairs by design facts right, then
                                      # similarity (ours); its kept update beat the similarity pairs' on validation on four of
                                      # four draws, but met the test win-rate target on one where they met it on three (docs/frontend.md)
HOUSE_STYLE=${HOUSE_STYLE:-0}         # procedural html pages: 1 states a house style and hides changes to it, so that only the
                                      # reference tells which unstated facts are hidden (generate_tasks.py --house_style; ours)
CRITIC_CONTRAST=${CRITIC_CONTRAST:-0}  # critics: 1 adds to their pairs, per train task, a hasty oracle dialogue (answers with
                                      # unheard facts guessed) and a stalling one (never answers once told everything); ours
GROUP_BY_TASK=${GROUP_BY_TASK:-0}     # critics: a task's pairs side by side in the batches, each trajectory scored once a step
DECISION_TERMS=${DECISION_TERMS:-0}   # critics: 1 scores each turn's first line as a term of its own beside the rest of the turn
                                      # (train_critic.py --decision_terms, ours; html: 1), the term LABEL_CROSS_KIND decision ranks by
CRITICS=${CRITICS:-1}                 # critics of each kind (html: 2), trained with seeds SEED, SEED+1000, ...: 2 or more are an ensemble whose
                                      # advantage is their mean (label_turns.py; docs/frontend.md, "Critics from other seeds")
CREDIT_VARIANTS=${CREDIT_VARIANTS:-1}  # critic ablations for turn-credit accuracy: 1 without training-time information, 2 also the trajectory-mean form
BATCH_SIZE=${BATCH_SIZE:-64}          # rollout dialogues per batch
NPROC=${NPROC:-1}                     # processes (GPUs) per stage: training under torchrun + FSDP2; vLLM sampling sharded
AGENT_BACKEND=${AGENT_BACKEND:-}      # how rollouts and label_turns sample the policy: hf | vllm (empty: vllm when installed and MODEL is not embedded)
GRAD_CKPT=${GRAD_CKPT:-$([ "$MODEL" = embedded ] && echo 0 || echo 1)}  # activation checkpointing in critic and DPO training
TRAIN_DTYPE=${TRAIN_DTYPE:-auto}      # training's compute: auto (bf16 on GPU, fp32 on CPU) | bfloat16 (CPU: ~1.8x faster, docs/speed.md) | float32
WARMUP_DTYPE=${WARMUP_DTYPE:-$TRAIN_DTYPE}  # ... of the warm-up SFT alone
DECODE_DTYPE=${DECODE_DTYPE:-auto}    # sampling (rollouts, labelling; hf backend): auto (bf16 on GPU, fp32 on CPU) | bfloat16 (CPU: bf16 matmuls, bf16 KV cache) | float32
SCORE_DTYPE=${SCORE_DTYPE:-auto}      # labelling's critics and pi_ref scoring the candidates: the same choices
SEED=${SEED:-0}
SIMULATOR_URL=${SIMULATOR_URL:-}      # empty: start the embedded scripted human
BASELINES=${BASELINES:-0}
TASK_TYPE=${TASK_TYPE:-code}         # code | html
CLIP_MODEL=${CLIP_MODEL:-}            # html: a local CLIP model; empty = the named non-CLIP fallback
PROMPT_DIR=${PROMPT_DIR:-}            # prompt templates replacing ours (e.g. a released checkout's prompts/)

KNOWN="SMALL TRAIN_TASKS TEST_TASKS RUN MODEL WARMUP N_WARMUP WARMUP_FAMILIES ORACLE_HASTY WARM_BAND WARMUP_TRIES HASTY_STEP ORACLE_DETOUR N_TRAIN N_TEST N_VAL VAL_SAMPLES SNAPSHOTS SAMPLES ORACLE_SAMPLES
  CANDIDATES PAIRS_PER_STATE DATA_FRACTION DPO_EPOCHS DPO_CROSS_KIND LABEL_CROSS_KIND SELECT_SIGNIFICANT TEMPERATURE TRAIN_TEMPERATURE TOP_P MAX_TURNS MAX_NEW_TOKENS LR_WARMUP LR_CRITIC LR_DPO
  CRITIC_EPOCHS FEWER_TURNS SHORTCUTS PAIR_FACTS HOUSE_STYLE CRITIC_CONTRAST GROUP_BY_TASK DECISION_TERMS CRITICS CREDIT_VARIANTS TRAIN_LAYERS BATCH_SIZE NPROC AGENT_BACKEND GRAD_CKPT TRAIN_DTYPE WARMUP_DTYPE DECODE_DTYPE SCORE_DTYPE SEED SIMULATOR_URL BASELINES TASK_TYPE CLIP_MODEL PROMPT_DIR REPORT_DIALOGUES SETUP FREE_GB PY"
echo "run.sh: run directory $RUN$([ -d "$RUN" ] && echo ' (exists: finished stages are reused)')"
for v in OUT_DIR OUTPUT_DIR RUN_DIR OUTPUT; do  # easy mistakes: run.sh reads RUN
  if [ -n "${!v-}" ]; then echo "run.sh: warning: $v is set but run.sh does not read it; the run directory is RUN=$RUN" >&2; fi
done
for v in $KNOWN; do printf '  %s=%s\n' "$v" "${!v-}"; done
[ "${SETUP:-1}" = 1 ] && bash setup.sh
PY=${PY:-.venv/bin/python}
[ -n "$AGENT_BACKEND" ] || AGENT_BACKEND=$([ "$MODEL" != embedded ] && "$PY" -c 'import importlib.util as u, sys; sys.exit(not u.find_spec("vllm"))' \
  && echo vllm || echo hf)
echo "  AGENT_BACKEND=$AGENT_BACKEND (in use)"
mkdir -p "$RUN"
free_kb=$(df -Pk "$RUN" | awk 'NR == 2 {print $4}')  # a stage that fills the disk stops (a rerun resumes); say so before it
if [ -n "$free_kb" ] && [ "$free_kb" -lt $((FREE_GB * 1048576)) ]; then
  echo "run.sh: warning: $((free_kb / 1048576)) GB free on the disk of $RUN, under FREE_GB=$FREE_GB; free some space or set RUN=dir on another disk" >&2
fi
log() { printf '\n== %s\n' "$*"; }
train() {  # a training stage; it continues from OUTPUT_DIR/resume when a killed run left one there
  local a=("$@") i
  for ((i = 0; i + 1 < ${#a[@]}; i++)); do
    if [ "${a[i]}" = --output_dir ] && { [ -d "${a[i+1]}/resume" ] || [ -d "${a[i+1]}/resume.old" ]; }; then a+=(--resume); fi
  done
  [ "$GRAD_CKPT" = 1 ] && a+=(--grad_ckpt)
  a+=(--dtype "${STAGE_DTYPE:-$TRAIN_DTYPE}")  # STAGE_DTYPE=...: one stage's own
  if [ "$NPROC" -gt 1 ]; then "$PY" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" "${a[@]}"; else "$PY" "${a[@]}"; fi
}
sample() {  # sample OUT SCRIPT ARGS: with NPROC > 1, NPROC ranks (torchrun) each sample their shard of the work on their
            # own GPU, then OUT (and label_turns' OUT.states.jsonl) = the shards in order; else one process
  local out=$1 i part suffix; shift
  if [ "$NPROC" -le 1 ]; then "$PY" "$@"; return; fi
  "$PY" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" "$@"
  for suffix in "" .states.jsonl; do
    part=(); for ((i = 0; i < NPROC; i++)); do [ -f "$out.shard-$i-of-$NPROC$suffix" ] && part+=("$out.shard-$i-of-$NPROC$suffix"); done
    [ ${#part[@]} -eq 0 ] || cat "${part[@]}" > "$out$suffix"
  done
}
have() {  # a finished checkpoint (config.json is written last): reuse it, and say so
  if [ -f "$1/config.json" ]; then echo "reusing $1 (finished earlier; delete it to redo that stage)"; return 0; fi
  return 1
}
exists() {  # a finished file: reuse it, and say so
  if [ -f "$1" ]; then echo "reusing $1 (delete it to redo)"; return 0; fi
  return 1
}

if [ -z "$SIMULATOR_URL" ]; then
  "$PY" simulator.py --port 0 ${PROMPT_DIR:+--prompt_dir "$PROMPT_DIR"} > "$RUN/simulator.log" 2>&1 &
  SIM_PID=$!
  trap 'kill $SIM_PID 2>/dev/null || true' EXIT
  for _ in $(seq 100); do grep -q "ready at" "$RUN/simulator.log" 2>/dev/null && break; sleep 0.1; done
  SIMULATOR_URL=$(sed -n 's/.*ready at \(http[^ ]*\)\/v1.*/\1/p' "$RUN/simulator.log")
  [ -n "$SIMULATOR_URL" ] || { cat "$RUN/simulator.log"; exit 1; }
fi
log "simulated human at $SIMULATOR_URL"

rollout() {  # rollout POLICY TASKS OUT [extra args, which win]
  local policy=$1 tasks=$2 out=$3; shift 3
  sample "$out" rollout.py --tasks "$tasks" --output "$out" --agent_model "$policy" --agent_backend "$AGENT_BACKEND" --simulator_url "$SIMULATOR_URL" \
    --temperature "$TEMPERATURE" --top_p "$TOP_P" --max_turns "$MAX_TURNS" --max_new_tokens "$MAX_NEW_TOKENS" --batch_size "$BATCH_SIZE" \
    --seed "$SEED" --task_type "$TASK_TYPE" --decode_dtype "$DECODE_DTYPE" ${PROMPT_DIR:+--prompt_dir "$PROMPT_DIR"} "$@"
}
evaluate() {  # evaluate IN NAME [extra]
  local in=$1 name=$2; shift 2
  "$PY" evaluate.py --input "$in" --output "$RUN/${name}_graded.jsonl" --summary "$RUN/${name}_summary.json" \
    --task_type "$TASK_TYPE" --clip_model "$CLIP_MODEL" "$@"
}

log "tasks"
gen() { "$PY" generate_tasks.py --task_type "$TASK_TYPE" $([ "$HOUSE_STYLE" = 1 ] && echo --house_style) "$@"; }
if [ -n "$TEST_TASKS" ]; then exists "$RUN/test_tasks.jsonl" || gen --source file --input "$TEST_TASKS" --output "$RUN/test_tasks.jsonl"
else exists "$RUN/test_tasks.jsonl" || gen --num_tasks "$N_TEST" --seed $((SEED + 1)) --output "$RUN/test_tasks.jsonl"; fi
VAL=(); [ "$N_VAL" -gt 0 ] && VAL=("$RUN/val_tasks.jsonl")  # validation tasks: each policy update keeps its best snapshot on them
if [ -n "$TRAIN_TASKS" ]; then  # ColBench data: validation = the first N_VAL train-file tasks, held out of training
  [ "$N_VAL" -gt 0 ] && { exists "${VAL[0]}" || gen --source file --input "$TRAIN_TASKS" --num_tasks "$N_VAL" \
    --exclude "$RUN/test_tasks.jsonl" --output "${VAL[0]}"; }
  exists "$RUN/train_tasks.jsonl" || gen --source file --input "$TRAIN_TASKS" --exclude "$RUN/test_tasks.jsonl${VAL:+,${VAL[0]}}" \
    --output "$RUN/train_tasks.jsonl"
else
  exists "$RUN/train_tasks.jsonl" || gen --num_tasks "$N_TRAIN" --seed $((SEED + 2)) \
    --exclude "$RUN/test_tasks.jsonl" --output "$RUN/train_tasks.jsonl"
  [ "$N_VAL" -gt 0 ] && { exists "${VAL[0]}" || gen --num_tasks "$N_VAL" --seed $((SEED + 4)) \
    --exclude "$RUN/test_tasks.jsonl,$RUN/train_tasks.jsonl" --output "${VAL[0]}"; }
fi

field() { "$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$1" "$2"; }  # field FILE KEY: a JSON value
val_of() {  # val_of POLICY TAG: POLICY on the validation tasks -> $RUN/val_TAG_graded.jsonl; VAL_SUCCESS = its success
  rollout "$1" "${VAL[0]}" "$RUN/val_$2.jsonl" --samples "$VAL_SAMPLES"
  evaluate "$RUN/val_$2.jsonl" "val_$2"
  VAL_SUCCESS=$(field "$RUN/val_$2_summary.json" success_rate)
}
POLICY=$MODEL VAL_START=start
if [ "$WARMUP" = 1 ]; then
  log "protocol warm-up: SFT on oracle dialogues (the starting policy of every method below)"
  fam=(); [ "$TASK_TYPE" = code ] && [ -n "$WARMUP_FAMILIES" ] && fam=(--families "$WARMUP_FAMILIES")
  exists "$RUN/warmup_tasks.jsonl" || gen --num_tasks "$N_WARMUP" --seed $((SEED + 3)) "${fam[@]}" \
    --exclude "$RUN/test_tasks.jsonl${VAL:+,${VAL[0]}}" --output "$RUN/warmup_tasks.jsonl"
  hasty=$ORACLE_HASTY
  for try in $(seq 0 "$WARMUP_TRIES"); do  # calibration: redo the warm-up with another hasty share until the
    sfx=$([ "$try" = 0 ] || echo "_hasty$hasty")  # starting policy's validation success lies in WARM_BAND (docs/curriculum.md)
    rollout "$MODEL" "$RUN/warmup_tasks.jsonl" "$RUN/warmup_oracle$sfx.jsonl" --agent_backend oracle \
      --oracle_hasty "$hasty" --oracle_detour "$ORACLE_DETOUR"
    evaluate "$RUN/warmup_oracle$sfx.jsonl" "warmup_oracle$sfx"
    have "$RUN/policy_warm$sfx" || STAGE_DTYPE=$WARMUP_DTYPE train train_dpo.py --mode sft --sft_on all --trajectories "$RUN/warmup_oracle${sfx}_graded.jsonl" \
      --model "$MODEL" --output_dir "$RUN/policy_warm$sfx" --lr "$LR_WARMUP" --batch_size 8 --task_type "$TASK_TYPE"
    POLICY=$RUN/policy_warm$sfx
    [ "$N_VAL" -gt 0 ] && [ -n "$WARM_BAND" ] || break
    VAL_START=start$sfx; val_of "$POLICY" "$VAL_START"
    next=$("$PY" -c 'import sys; s, h, step = map(float, sys.argv[1:4]); lo, hi = map(float, sys.argv[4].split(","))
print("" if lo <= s <= hi else round(min(1.0, max(0.0, h - step if s < lo else h + step)), 2))' \
      "$VAL_SUCCESS" "$hasty" "$HASTY_STEP" "$WARM_BAND")
    echo "starting policy (oracle_hasty $hasty): validation success $VAL_SUCCESS, band [$WARM_BAND]${next:+: outside, next oracle_hasty $next}"
    [ -n "$next" ] || break
    [ "$try" -lt "$WARMUP_TRIES" ] && hasty=$next || echo "run.sh: warning: the starting policy is outside WARM_BAND after $WARMUP_TRIES retries; it is used as it is" >&2
  done
fi

best_of() {  # best_of NAME DIR: the starting policy, DIR's snapshots and DIR itself on the validation tasks;
             # BEST = the one with the highest success (the earliest wins a tie, so an update that helps nothing keeps the start)
  local name=$1 dir=$2 runs=("start=$RUN/val_${VAL_START}_graded.jsonl") pols=("start=$POLICY") d tag
  BEST=$dir
  [ "$N_VAL" -gt 0 ] || return 0
  for d in $(ls "$dir" | sed -n 's/^step-\([0-9]*\)$/\1/p' | sort -n | sed "s|^|$dir/step-|") "$dir"; do
    tag=${name}_$(basename "$d"); [ "$d" = "$dir" ] && tag=${name}_end
    rollout "$d" "${VAL[0]}" "$RUN/val_$tag.jsonl" --samples "$VAL_SAMPLES"
    evaluate "$RUN/val_$tag.jsonl" "val_$tag"
    runs+=("$tag=$RUN/val_${tag}_graded.jsonl") pols+=("$tag=$d")
  done
  "$PY" evaluate.py --compare "$(IFS=,; echo "${runs[*]}")" --policies "$(IFS=,; echo "${pols[*]}")" --select \
    $([ "$SELECT_SIGNIFICANT" = 1 ] && echo --select_significant) --summary "$RUN/select_$name.json" | tee "$RUN/select_$name.txt"
  BEST=$(field "$RUN/select_$name.json" selected_policy)
}
snap=(); [ "$N_VAL" -gt 0 ] && snap=(--snapshots "$SNAPSHOTS")
if [ "$N_VAL" -gt 0 ] && [ ! -f "$RUN/val_${VAL_START}_graded.jsonl" ]; then
  log "starting policy on $N_VAL validation tasks ($VAL_SAMPLES per task): the point every update is selected against"
  val_of "$POLICY" "$VAL_START"
fi

log "rollouts on train tasks ($SAMPLES per task) with $POLICY"
rollout "$POLICY" "$RUN/train_tasks.jsonl" "$RUN/train_rollouts.jsonl" --samples "$SAMPLES" --temperature "$TRAIN_TEMPERATURE"
if [ "$ORACLE_SAMPLES" -gt 0 ]; then
  rollout "$POLICY" "$RUN/train_tasks.jsonl" "$RUN/train_rollouts.jsonl" --agent_backend oracle --samples "$ORACLE_SAMPLES" \
    --first_sample "$SAMPLES"
fi
evaluate "$RUN/train_rollouts.jsonl" train --k "$SAMPLES"
contrast=()
if [ "$CRITIC_CONTRAST" = 1 ]; then  # scripted contrasts for the critics only (labelling and DPO never see them)
  first=$((SAMPLES + ORACLE_SAMPLES))
  for mode in hasty stall; do  # one dialogue of each per train task, numbered after the train rollouts' samples
    rollout "$POLICY" "$RUN/train_tasks.jsonl" "$RUN/critic_contrast.jsonl" --agent_backend oracle --samples 1 \
      --first_sample "$first" "--oracle_$mode" 1
    first=$((first + 1))
  done
  evaluate "$RUN/critic_contrast.jsonl" critic_contrast
  contrast=(--extra_trajectories "$RUN/critic_contrast_graded.jsonl")
fi

log "SWEET-RL: critic -> turn labels -> turn-level DPO"
critic() {  # critic DIR [variant flags]: CRITICS critics, DIR then DIR_2, DIR_3, ...; ENSEMBLE = their directories joined by +
  local dir=$1 k d; shift; ENSEMBLE=
  for k in $(seq 1 "$CRITICS"); do
    d=$dir; [ "$k" = 1 ] || d=${dir}_$k
    have "$d" || train train_critic.py --trajectories "$RUN/train_graded.jsonl" --model "$POLICY" --output_dir "$d" \
      --lr "$LR_CRITIC" --epochs "$CRITIC_EPOCHS" --task_type "$TASK_TYPE" --seed $((SEED + 1000 * (k - 1))) --train_layers "$TRAIN_LAYERS" \
      $([ "$GROUP_BY_TASK" = 1 ] && echo --group_by_task) $([ "$FEWER_TURNS" = 1 ] && echo --fewer_turns) --shortcuts "$SHORTCUTS" \
      $([ "$PAIR_FACTS" = 1 ] && echo --pair_facts) $([ "$DECISION_TERMS" = 1 ] && echo --decision_terms) "${contrast[@]}" "$@"
    ENSEMBLE=${ENSEMBLE:+$ENSEMBLE+}$d
  done
}
critic "$RUN/critic"  # the SWEET critic: sees c, sum of per-turn mean log-ratios (paper)
SWEET_CRITIC=$ENSEMBLE
variants=()
if [ "$CREDIT_VARIANTS" -ge 1 ]; then  # ablations, trained on the same pairs, scored on the same candidates (docs/curriculum.md)
  critic "$RUN/critic_no_training_info" --no_training_info
  variants=("no_training_info=$ENSEMBLE")
fi
if [ "$CREDIT_VARIANTS" -ge 2 ]; then
  DECISION_TERMS=0 critic "$RUN/critic_trajectory_mean" --normalization trajectory  # one mean: no terms to split
  variants=("trajectory_mean=$ENSEMBLE" "${variants[@]}")
fi
[ ${#variants[@]} -gt 0 ] && variants=(--credit_critics "$(IFS=,; echo "${variants[*]}")")
sample "$RUN/pairs.jsonl" label_turns.py --trajectories "$RUN/train_graded.jsonl" --critic "$SWEET_CRITIC" --output "$RUN/pairs.jsonl" \
  --agent_backend "$AGENT_BACKEND" --decode_dtype "$DECODE_DTYPE" --score_dtype "$SCORE_DTYPE" \
  --num_candidates "$CANDIDATES" --pairs_per_state "$PAIRS_PER_STATE" --data_fraction "$DATA_FRACTION" \
  --temperature 1.0 --max_new_tokens "$MAX_NEW_TOKENS" --max_turns "$MAX_TURNS" --seed "$SEED" --cross_kind "$LABEL_CROSS_KIND" \
  "${variants[@]}"
if [ "$NPROC" -gt 1 ] && [ -z "$TRAIN_TASKS" ]; then "$PY" credit.py --pairs "$RUN/pairs.jsonl"; fi  # over all shards
have "$RUN/policy_sweet" || train train_dpo.py --mode turn --pairs "$RUN/pairs.jsonl" --model "$POLICY" \
  --output_dir "$RUN/policy_sweet" --lr "$LR_DPO" --epochs "$DPO_EPOCHS" --seed "$SEED" --train_layers "$TRAIN_LAYERS" \
  --cross_kind "$DPO_CROSS_KIND" "${snap[@]}"
best_of sweet "$RUN/policy_sweet"

METHODS="zero_shot:$POLICY sweet_rl:$BEST"
if [ "$BASELINES" = 1 ]; then
  log "baselines: multi-turn DPO and rejection fine-tuning"
  have "$RUN/policy_mtdpo" || train train_dpo.py --mode trajectory --trajectories "$RUN/train_graded.jsonl" --model "$POLICY" \
    --output_dir "$RUN/policy_mtdpo" --lr "$LR_DPO" --epochs "$DPO_EPOCHS" --task_type "$TASK_TYPE" --seed "$SEED" --train_layers "$TRAIN_LAYERS" "${snap[@]}" \
    $([ "$PAIR_FACTS" = 1 ] && echo --pair_facts)
  best_of mtdpo "$RUN/policy_mtdpo"; METHODS="$METHODS multi_turn_dpo:$BEST"
  have "$RUN/policy_rft" || train train_dpo.py --mode sft --trajectories "$RUN/train_graded.jsonl" --model "$POLICY" \
    --output_dir "$RUN/policy_rft" --lr "$LR_DPO" --epochs "$DPO_EPOCHS" --seed "$SEED" --task_type "$TASK_TYPE" --train_layers "$TRAIN_LAYERS" "${snap[@]}"
  best_of rft "$RUN/policy_rft"; METHODS="$METHODS rejection_ft:$BEST"
fi

log "test rollouts (same tasks and seeds for every method)"
for m in $METHODS; do
  name=${m%%:*} policy=${m#*:}
  if [ "$name" != zero_shot ] && [ "$policy" = "$POLICY" ]; then
    # validation kept the start: the same policy on the same tasks and seeds would write zero_shot's dialogues again,
    # and their grades (evaluate.py reuses a graded file that grades exactly these dialogues)
    echo "$name is the starting policy: its test dialogues are zero_shot's"
    for f in .jsonl _graded.jsonl _graded.jsonl.run_settings.json; do cp "$RUN/test_zero_shot$f" "$RUN/test_$name$f"; done
  else
    rollout "$policy" "$RUN/test_tasks.jsonl" "$RUN/test_${name}.jsonl"
  fi
  ref=(); [ "$TASK_TYPE" = html ] && [ "$name" != zero_shot ] && ref=(--reference "$RUN/test_zero_shot_graded.jsonl")
  evaluate "$RUN/test_${name}.jsonl" "test_${name}" "${ref[@]}"
done

log "results ($RUN)"
runs=() pols=()  # NAME=GRADED and NAME=POLICY of every method
for m in $METHODS; do runs+=("${m%%:*}=$RUN/test_${m%%:*}_graded.jsonl"); pols+=("${m%%:*}=${m#*:}"); done
credit=(); [ -f "$RUN/pairs.jsonl.credit.json" ] && credit=(--credit "$RUN/pairs.jsonl.credit.json")
"$PY" evaluate.py --compare "$(IFS=,; echo "${runs[*]}")" --policies "$(IFS=,; echo "${pols[*]}")" "${credit[@]}" \
  --summary "$RUN/results.json" | tee "$RUN/results.txt"
# the teaching views: plots of results and training, and the trajectory viewer
"$PY" view.py --plots "$RUN"
states=(); [ -f "$RUN/pairs.jsonl.states.jsonl" ] && states=(--states "$RUN/pairs.jsonl.states.jsonl")
all=("${runs[@]}"); [ -f "$RUN/train_graded.jsonl" ] && all+=("train=$RUN/train_graded.jsonl")  # the labelled states
# (the turns' colours are the first SWEET critic's; with CRITICS > 1 the pairs are ranked by the ensemble)
"$PY" view.py --trajectories "$(IFS=,; echo "${all[*]}")" "${states[@]}" --critic "$RUN/critic" \
  --task_type "$TASK_TYPE" --max_dialogues "${REPORT_DIALOGUES:-40}" --output "$RUN/report.html"
echo "open $RUN/report.html in a browser; plots: $RUN/results.png, $RUN/training.png"
