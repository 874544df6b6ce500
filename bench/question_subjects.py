"""Do the critics read c to tell which questions reveal? On procedural pages, every two candidate questions
of a labelled state whose true classes differ (the good one reveals a hidden fact), split by what the bad one
asks about: a hidden fact the human has already said ("heard"), a fact the request states ("stated"), a fact
a house style keeps unstated ("kept", pages of generate_tasks.py --house_style: only c tells it from a hidden
one), or no design fact ("other"). A question's subject is the one design fact it names (background, header,
box, footer or title); a question naming none or several is "other". Each critic's share of such pairs
ranked good above bad, as credit.py counts turn credit (ties half).

    python bench/question_subjects.py --pairs runs/default/pairs.jsonl --trajectories runs/default/train_graded.jsonl
    python bench/question_subjects.py ... --states runs/default/pairs.jsonl.states_rescored.jsonl   # credit.py --critics'

Reads only stored files (no model): seconds.
"""
import argparse
import collections
import json
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
import colbench  # noqa: E402
import credit  # noqa: E402

NAMES = {"background": "background", "header": "header", "boxes": "box", "footer": "footer", "title": "title"}


def subject(task, before, question):
    """heard | stated | kept | hidden | other: what a candidate question asks about, in the state after `before`."""
    named = [k for k, w in NAMES.items() if w in question.lower()]
    if len(named) != 1:
        return "other"
    k = named[0]
    if k in colbench.design_in(task["hidden_information"]):
        return "heard" if k in colbench.design_in("\n".join(colbench.revealed_facts(task, before))) else "hidden"
    return "kept" if k in colbench.kept_design(task) else "stated"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", required=True, help="label_turns.py's output (its .states.jsonl is read)")
    p.add_argument("--trajectories", required=True, help="the graded trajectories label_turns.py read")
    p.add_argument("--states", default="", help="another states file (default: PAIRS.states.jsonl)")
    a = p.parse_args()
    trajs = {(t["task_id"], t.get("sample", 0)): t for t in colbench.load_graded(a.trajectories)}
    states = [s for s in map(json.loads, open(a.states or f"{a.pairs}.states.jsonl")) if s.get("classes")]
    kinds = {}
    for s in states:
        traj = trajs[(s["task_id"], s["sample"])]
        if colbench.design_of(traj["task"]):
            before = credit.state_dialogue(traj, s["turn"])
            kinds[id(s)] = [subject(traj["task"], before, c) if colbench.turn_kind(c) == "question" else None
                            for c in s["candidates"]]
    hits = collections.defaultdict(lambda: collections.defaultdict(list))
    for name in sorted({n for s in states for n in s["advantages_by_critic"]} - {"untrained"}):
        for s, i, j, hit in credit.class_pairs(states, name):  # ranked as credit.py ranks them, ties half
            k = kinds.get(id(s))
            if k and k[i] and k[j]:
                hits[f"good question > bad question asking {k[j]}"][name].append(hit)
    out = {k: {name: [round(sum(v) / len(v), 3), len(v)] for name, v in by.items()} for k, by in sorted(hits.items())}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
