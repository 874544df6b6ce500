#!/usr/bin/env bash
# The fair protocol's one tuning procedure: every method gets the same learning-rate grid on the validation tasks
# of a tuning draw that is never reported (N_TEST=0: no test rollouts), at beta 0.1 and each NLL weight of the grid
# (NLL: the paper's 0.01, and 1; both DPO methods get the same). The draw is a finished `N_TEST=0 BASELINES=1
# bash run.sh` run directory (BASELINES=0: SWEET-RL's grid alone; the draw's seed and task type are read from its
# settings); for each other rate this copies its stages up to the turn labels and the reference log-probs (nothing
# is redone) and trains and selects every method again at that rate. Each method's score at a rate is its
# validation success at the snapshot its selection kept; pick per method the rate and weight with the highest (a
# tie: the lower rate, the paper's weight) and record it in docs/log.md.
#   N_TEST=0 BASELINES=1 SEED=10 LR_DPO=6e-6 LR_MTDPO=6e-6 LR_RFT=6e-6 NLL_DPO=0.01 NLL_MTDPO=0.01 \
#     RUN=runs/tune bash run.sh                                   # a rate, at the paper's NLL weight
#   bash bench/tune_lr.sh runs/tune 6e-7 2e-6 2e-5 6e-5          # the same draw at the grid's other rates
#   NLL=1 bash bench/tune_lr.sh runs/tune 6e-7 2e-6 6e-6 2e-5 6e-5   # and at the other NLL weight (RFT, which has
#                                          # no NLL term, is then the paper's weight's cell at that rate, linked)
set -euo pipefail
cd "$(dirname "$0")/.."
draw=${1:?usage: bash bench/tune_lr.sh RUN_DIR LR [LR ...]}; shift
[ -f "$draw/select_sweet.json" ] || { echo "tune_lr.sh: $draw has no select_sweet.json: finish its N_TEST=0 run.sh first" >&2
  exit 1; }
nll=${NLL:-0.01}  # the grid's NLL weight, both DPO methods
read -r seed task_type < <(python3 -c 'import json, sys; s = json.load(open(sys.argv[1]))
print(s["seed"], s["task_type"])' "$draw/critic/run_settings.json")  # the draw's own: code or html
for lr in "$@"; do
  out=${draw%/}_lr$lr$([ "$nll" = 0.01 ] || echo "_nll$nll")
  if [ ! -d "$out" ]; then mkdir -p "$out"
    for f in "$draw"/*; do case $(basename "$f") in  # the draw's own stages up to the labels; not its updates
      policy_*|val_*|select_*|results.*|report.html|test_sweet_rl*|test_multi_turn_dpo*|test_rejection_ft*) ;;
      *) cp -a "$f" "$out/" ;; esac; done
    for m in sweet mtdpo; do [ ! -d "$draw/policy_$m/ref_logprobs" ] || { mkdir -p "$out/policy_$m"
      cp -a "$draw/policy_$m/ref_logprobs" "$out/policy_$m/"; }; done
  fi  # (the reference log-probs are the start's, kept by content: the same at every rate)
  for c in "$draw" "${draw%/}_lr$lr"; do  # RFT has no NLL term: at the other weight its paper's-weight cell stands
    if [ "$nll" != 0.01 ] && [ ! -e "$out/policy_rft" ] && [ -f "$c/select_rft.json" ] && python3 -c 'import json, sys
sys.exit(json.load(open(sys.argv[1]))["lr"] != float(sys.argv[2]))' "$c/policy_rft/run_settings.json" "$lr"; then
      ln -s "$(cd "$c" && pwd)/policy_rft" "$out/policy_rft"; cp -a "$c"/val_rft_* "$out/"; fi; done
  RUN=$out SEED=$seed TASK_TYPE=$task_type LR_DPO=$lr LR_MTDPO=$lr LR_RFT=$lr NLL_DPO=$nll NLL_MTDPO=$nll \
    BASELINES=${BASELINES:-1} N_TEST=0 bash run.sh
done
python3 - "$draw" <<'EOF'
import glob, json, os, sys
draw, table, methods = sys.argv[1].rstrip("/"), {}, ("sweet", "mtdpo", "rft")
for d in [draw, *glob.glob(f"{draw}_lr*")]:  # each method at the rate and NLL weight its own run used
    for m in methods:
        if os.path.exists(f"{d}/select_{m}.json"):
            s, run = json.load(open(f"{d}/select_{m}.json")), json.load(open(f"{d}/policy_{m}/run_settings.json"))
            kept = s["methods"][s["selected"]]  # what its selection ranked: success, exact designs or similarity
            by = s.get("selected_by") or ("success" if "success" in kept else "similarity")
            table.setdefault((run["lr"], run["nll_coef"]), {})[m] = kept[by]
print(f"{'lr':>8}{'nll':>6}" + "".join(f"{m:>10}" for m in methods)
      + f"   (validation {by.replace('_', ' ')} of the kept policy)")
for (lr, nll), row in sorted(table.items()):  # (RFT has no NLL weight: it stands in the row of train_dpo's default)
    print(f"{lr:>8.0e}{nll:>6g}" + "".join(f"{100 * row[m]:>9.1f}%" if m in row else f"{'':>10}" for m in methods))
EOF
