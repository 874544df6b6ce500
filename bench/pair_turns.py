"""How much of a trajectory pair's difference is one turn, on procedural code tasks with the scripted human.

    python bench/pair_turns.py RUN/train_graded.jsonl

Per critic pair (colbench.trajectory_pairs: a success against a lower-reward sample of its task), the bad turns
of each side, read from the dialogue itself: a question whose reply revealed no new hidden fact, a failing
answer, a dialogue never answered. Where the rejected side's only bad turn is its last and the chosen side has
none, one turn decides the pair and trajectory-level credit already isolates it (docs/curriculum.md).
"""
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import colbench  # noqa: E402

rows = colbench.load_graded(sys.argv[1])
pairs = colbench.trajectory_pairs(rows, "code")

def bad_turns(r):
    d, task, bad, agent = r["dialogue_history"], r["task"], [], 0
    known = set()
    for j, m in enumerate(d):
        if m["role"] != "assistant":
            continue
        agent += 1
        is_answer = colbench.ANSWER_MARKER in m["content"]
        if is_answer:
            if not r.get("success"):
                bad.append(("answer", agent))
        else:
            reply = d[j + 1]["content"] if j + 1 < len(d) else ""
            new = {f for f in colbench.hidden_facts(task) if f in reply} - known
            known |= new
            if not new:
                bad.append(("question", agent))
    if r.get("finish") != "answered":
        bad.append(("no_answer", agent))
    return bad, agent

c = collections.Counter()
for ch, rj in pairs:
    (bc, nc), (br, nr) = bad_turns(ch), bad_turns(rj)
    c["pairs"] += 1
    c[f"rejected {colbench.dialogue_outcome(rj)}"] += 1
    c["chosen has a bad turn (a wasted question)"] += bool(bc)
    only_last = len(br) == 1 and br[0][1] == nr
    c["rejected's only bad turn is its last"] += only_last
    c["... and the chosen has none (one turn decides the pair)"] += only_last and not bc
    c["rejected has >1 bad turn"] += len(br) > 1
for k, v in c.items():
    print(f"{v:4d} {100 * v / c['pairs']:5.1f}%  {k}")
