"""The critic's three training paths on one toy set, on whatever device this machine has (run it on a GPU to
check the GPU path): one process (a pair's shared prefix once), --no_shared_prefix (each trajectory whole), and
torchrun FSDP2 with --grad_ckpt; in fp32 all three must take the same steps, in bf16 each must learn. FLAGS pass
to every run, e.g. a critic variant's (--decision_terms by default: answers of two lines, so its first-line terms
differ from the whole turn's).

    python bench/critic_paths.py --out runs/critic_paths                      # prints PASS / FAIL per check
    python bench/critic_paths.py --out runs/critic_paths --flags "--normalization trajectory"

The toy set: per task, a question then a two-line answer (reward 1) against a two-line wrong answer (reward 0);
the model: a tiny random Llama with a tokenizer trained here (tests/conftest.py). The exit status is 1 if a
check fails."""
import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from conftest import build_tiny_model  # noqa: E402
from test_training import write_graded  # noqa: E402
import models  # noqa: E402
import torch  # noqa: E402

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--out", required=True, help="folder for the model, the data and each run's output")
p.add_argument("--flags", default="--decision_terms", help="train_critic.py flags passed to every run")
p.add_argument("--tasks", type=int, default=8)
a = p.parse_args()
out = Path(a.out)
out.mkdir(parents=True, exist_ok=True)
model = build_tiny_model(out / "tiny")
tok = models.load_tokenizer(model)
write_graded(tok, out / "g.jsonl", n_tasks=a.tasks, sep="\n")  # the same toy set as tests/test_training.py's
torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
paths = {"one": ([sys.executable], []), "whole": ([sys.executable], ["--no_shared_prefix"]), "fsdp": (torchrun, ["--grad_ckpt"])}
logs, failed = {}, []


def check(name, ok, detail):
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        failed.append(name)


for dtype in ("float32", "bfloat16"):
    for name, (launcher, flags) in paths.items():
        d = out / f"{name}_{dtype}"
        r = subprocess.run(launcher + ["train_critic.py", "--trajectories", str(out / "g.jsonl"), "--model", model,
                                       "--output_dir", str(d), "--lr", "3e-3", "--epochs", "6", "--batch_size", "4",
                                       "--heldout_fraction", "0.25", "--dtype", dtype, *flags, *shlex.split(a.flags)],
                           cwd=ROOT, capture_output=True, text=True)
        (out / f"{name}_{dtype}.log").write_text(r.stdout + r.stderr)
        if r.returncode:
            check(f"{name} {dtype}", False, f"exit {r.returncode}, see {out / f'{name}_{dtype}.log'}")
            continue
        log = logs[name, dtype] = [json.loads(line) for line in (d / "log.jsonl").read_text().splitlines()]
        check(f"{name} {dtype} learns", abs(log[0]["loss"] - 0.6931) < 1e-3 and log[-1]["loss"] < log[0]["loss"],
              f"loss {log[0]['loss']:.4f} at step 1 (log 2: the critic is pi_ref), {log[-1]['loss']:.4f} at step {len(log)}")
for name in ("whole", "fsdp"):
    one, other = logs.get(("one", "float32")), logs.get((name, "float32"))
    if one and other:
        gap = max(abs(x[k] - y[k]) for x, y in zip(one, other) for k in ("loss", "grad_norm"))
        check(f"{name} float32 takes one's steps", len(one) == len(other) and gap < 1e-3,
              f"{len(other)} steps, largest loss / grad_norm gap {gap:.2e}")
print(f"device: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'}; flags: {a.flags}")
sys.exit(1 if failed else 0)
