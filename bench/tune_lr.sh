#!/usr/bin/env bash
# The fair protocol's one tuning procedure: every method gets the same learning-rate grid on the validation tasks
# of a tuning draw that is never reported (N_TEST=0: no test rollouts). beta and the NLL weight stay at the
# paper's values (0.1, 0.01) for both DPO methods. The draw is a finished `N_TEST=0 BASELINES=1 bash run.sh` run
# directory; for each other rate this copies its stages up to the turn labels and the reference log-probs (nothing
# is redone) and trains and selects every method again at that rate. Each method's score at a rate is its
# validation success at the snapshot its selection kept; pick per method the rate with the highest (a tie: the
# lower rate) and record it in docs/log.md.
#   N_TEST=0 BASELINES=1 SEED=10 LR_DPO=6e-6 LR_MTDPO=6e-6 LR_RFT=6e-6 RUN=runs/tune bash run.sh  # a rate
#   bash bench/tune_lr.sh runs/tune 6e-7 2e-6 2e-5 6e-5          # the same draw at the grid's other rates
set -euo pipefail
cd "$(dirname "$0")/.."
draw=${1:?usage: bash bench/tune_lr.sh RUN_DIR LR [LR ...]}; shift
[ -f "$draw/select_rft.json" ] || { echo "tune_lr.sh: $draw has no select_rft.json: finish its BASELINES=1 run.sh first" >&2
  exit 1; }
seed=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["seed"])' "$draw/critic/run_settings.json")
for lr in "$@"; do
  out=${draw%/}_lr$lr
  if [ ! -d "$out" ]; then mkdir -p "$out"
    for f in "$draw"/*; do case $(basename "$f") in  # the draw's own stages up to the labels; not its updates
      policy_*|val_*|select_*|results.*|report.html|test_sweet_rl*|test_multi_turn_dpo*|test_rejection_ft*) ;;
      *) cp -a "$f" "$out/" ;; esac; done
    for m in sweet mtdpo; do mkdir -p "$out/policy_$m"; cp -a "$draw/policy_$m/ref_logprobs" "$out/policy_$m/"; done
  fi  # (the reference log-probs are the start's, kept by content: the same at every rate)
  RUN=$out SEED=$seed LR_DPO=$lr LR_MTDPO=$lr LR_RFT=$lr BASELINES=1 N_TEST=0 bash run.sh
done
python3 - "$draw" "$@" <<'EOF'
import json, sys
draw, lrs = sys.argv[1].rstrip("/"), sys.argv[2:]
table, methods = {}, ("sweet", "mtdpo", "rft")
for d in [draw, *(f"{draw}_lr{lr}" for lr in lrs)]:  # each method at the rate its own run used
    for m in methods:
        s = json.load(open(f"{d}/select_{m}.json"))
        table.setdefault(json.load(open(f"{d}/policy_{m}/run_settings.json"))["lr"], {})[m] = s["methods"][s["selected"]]
print(f"{'lr':>8}" + "".join(f"{m:>10}" for m in methods) + "   (validation success of the kept policy)")
for lr, row in sorted(table.items()):
    print(f"{lr:>8.0e}" + "".join(f"{100 * row[m]['success']:>9.1f}%" if m in row else f"{'':>10}" for m in methods))
EOF
