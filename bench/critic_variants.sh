#!/usr/bin/env bash
# Critic variants trained on a finished run's rollouts and scored on its labelled candidates beside its own critic,
# by kind of class pair, under both rankings (bench/rescore_credit.py): a variant costs its training and one forward
# over the candidates, not a run.
#   bash bench/critic_variants.sh runs/default paper="--ridge 0" ridge10="--ridge 10"
# Each variant trains as the run's critic did (its run_settings.json: pi_ref, rate, epochs, seed, layers, schedule,
# normalization) plus its own flags, into RUN/critic_NAME (a finished one is reused), reading pi_ref's log-probs the
# run's critic kept. Needs RUN/critic and the labelled states with their true classes (run.sh up to credit.py).
set -euo pipefail
cd "$(dirname "$0")/.."
run=${1:?usage: bash bench/critic_variants.sh RUN_DIR NAME="FLAGS" [NAME="FLAGS" ...]}; shift
PY=${PY:-.venv/bin/python}
[ -f "$run/critic/config.json" ] && [ -f "$run/pairs.jsonl.classes.jsonl" ] || { echo "critic_variants.sh: $run has" \
  "no finished critic or no true classes (pairs.jsonl.classes.jsonl): run run.sh up to credit.py first" >&2; exit 1; }
same=$("$PY" -c 'import json, os, sys; s = json.load(open(sys.argv[1]))
path = lambda v: os.path.join(s["cwd"], v) if os.path.exists(os.path.join(s["cwd"], str(v))) else v  # as it was given
print(" ".join(f"--{k} {path(s[k])}" for k in ("trajectories", "model", "lr", "epochs", "seed", "train_layers", "schedule",
      "task_type", "normalization", "beta", "batch_size", "max_len", "heldout_fraction")))' "$run/critic/run_settings.json")
critics=sweet=$run/critic
for variant in "$@"; do
  name=${variant%%=*} flags=${variant#*=} out=$run/critic_${variant%%=*}
  if [ ! -f "$out/config.json" ]; then
    mkdir -p "$out"; [ -d "$out/ref_logprobs" ] || cp -a "$run/critic/ref_logprobs" "$out/"  # kept by content
    echo "== critic $name: $flags"
    # shellcheck disable=SC2086  # the settings and flags are words
    "$PY" train_critic.py $same $flags --output_dir "$out" $([ -d "$out/resume" ] && echo --resume || true)
  fi
  critics=$critics,$name=$out
done
"$PY" bench/rescore_credit.py --run "$run" --critics "$critics"
