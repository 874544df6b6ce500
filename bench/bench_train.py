"""Training speed and memory on real rollouts: train_critic.py and train_dpo.py (trajectory mode) on the
first --num_tasks tasks of a graded file, one epoch each. Reports tokens/s (median over steps, from
each run's log.jsonl), each run's wall time (model load, pi_ref's pass and saving included) and its
peak resident memory.

    python bench/bench_train.py --trajectories runs/default/train_graded.jsonl --model runs/default/policy_warm
    python bench/bench_train.py ... --train_layers 10 --epochs 2    # run.sh's embedded critic
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
p = argparse.ArgumentParser(description=__doc__)
p.add_argument("--trajectories", required=True)
p.add_argument("--model", default="embedded")
p.add_argument("--num_tasks", type=int, default=8)
p.add_argument("--train_layers", type=int, default=0, help="train only the top N layers (run.sh's embedded default: 10)")
p.add_argument("--epochs", default="1", help="critic epochs (run.sh: 2)")
p.add_argument("--task_type", default="code")
p.add_argument("--critic_only", action="store_true", help="skip train_dpo.py")
a = p.parse_args()
rows = [json.loads(l) for l in open(a.trajectories)]
keep = list(dict.fromkeys(r["task_id"] for r in rows))[: a.num_tasks]
with tempfile.TemporaryDirectory() as d:
    sub = os.path.join(d, "g.jsonl")
    with open(sub, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows if r["task_id"] in keep)
    critic = ["--epochs", a.epochs, "--heldout_fraction", "0", "--task_type", a.task_type]
    runs = [("train_critic.py", critic)]
    runs += [] if a.critic_only else [("train_dpo.py", ["--mode", "trajectory", "--task_type", a.task_type])]
    for script, extra in runs:
        out = os.path.join(d, script + "".join(extra))
        start = time.time()
        proc = subprocess.Popen([sys.executable, script, "--trajectories", sub, "--model", a.model, "--output_dir", out,
                                 "--lr", "1e-6", "--batch_size", "4", "--train_layers", str(a.train_layers), *extra],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        err = proc.stderr.read()
        _, status, usage = os.wait4(proc.pid, 0)  # this run's own peak memory (getrusage would keep the largest so far)
        if status:
            sys.exit(f"{script} {' '.join(extra)} failed:\n{err.decode()[-3000:]}")
        peak = usage.ru_maxrss
        log = [json.loads(l) for l in open(os.path.join(out, "log.jsonl"))]
        tps = sorted(x["tokens_per_s"] for x in log)
        print(f"{script} {' '.join(extra)}: {len(log)} steps, median {tps[len(tps) // 2]:.0f} tokens/s (forward+backward+AdamW), "
              f"wall {time.time() - start:.0f} s, peak RSS {peak / 1024:.0f} MiB", flush=True)
