"""The ceiling of the critic's labels: a finished run's turn pairs put right by the candidates' true classes.

    python bench/true_class_pairs.py runs/tune_html300b runs/tune_html300b_trueclass
    N_TEST=0 SEED=300 TASK_TYPE=html RUN=runs/tune_html300b_trueclass bash run.sh   # SWEET-RL on those pairs

Copies RUN's stages up to the turn labels (tasks, train dialogues, critic, labelled states; not its policies or
validation) into OUT and rewrites OUT/pairs.jsonl: each of the critic's pairs whose candidates' true classes
(credit.py) differ is kept with the good candidate chosen (a wrong pair is flipped); a pair of one class is dropped.
SWEET-RL then trains and is selected at the run's settings: if it fails on these labels too, the critic is not
what stops it. Procedural tasks only (they have true classes).
"""
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import common  # noqa: E402
import credit  # noqa: E402

run, out = map(Path, sys.argv[1:3])
if out.exists():
    sys.exit(f"true_class_pairs.py: {out} exists; remove it first")
out.mkdir(parents=True)
for f in run.iterdir():  # the run's own stages up to the labels; its updates, validation and test are not copied
    if not f.name.startswith(("policy_", "val_", "select_", "results.", "report.", "test_", "pairs.jsonl")):
        (shutil.copytree if f.is_dir() else shutil.copy2)(f, out / f.name)
shutil.copy2(run / "pairs.jsonl.states.jsonl", out / "pairs.jsonl.states.jsonl")
classes = credit.classes_by_state(credit.labelled_states(run / "pairs.jsonl"))
kept, flipped, dropped = [], 0, 0
for _, p in common.read_jsonl(run / "pairs.jsonl"):
    c = classes.get((p["task_id"], p["sample"], p["turn"]))
    if c is None or c[p["chosen"]] == c[p["rejected"]]:
        dropped += 1
        continue
    if c[p["chosen"]] == "bad":
        flipped += 1
        p = {**p, "chosen": p["rejected"], "rejected": p["chosen"],
             "chosen_advantage": p["rejected_advantage"], "rejected_advantage": p["chosen_advantage"]}
    kept.append(p)
common.write_jsonl(out / "pairs.jsonl", kept)
shutil.copy2(run / "pairs.jsonl.run_settings.json", out / "pairs.jsonl.run_settings.json")
print(json.dumps({"pairs": len(kept), "flipped": flipped, "dropped_same_class": dropped, "output": str(out)}))
