r"""Make ColBench task files (the public JSONL format, one task per line).

Reads: nothing (procedural), or a ColBench JSONL / `datasets` directory (file).
Writes: JSONL with problem_description, hidden_information, ground_truth, test_cases (+ task_id); html:
        problem_description and ground_truth (the target page), procedural pages hidden_information too.

    python generate_tasks.py --task_type code --source procedural --num_tasks 200 --seed 1 --output data/test.jsonl
    python generate_tasks.py --num_tasks 1000 --seed 0 --exclude data/test.jsonl --output data/train.jsonl
    python generate_tasks.py --source file --input colbench_backend.jsonl --num_tasks 0 --output data/tasks.jsonl
    python generate_tasks.py --task_type html --source procedural --num_tasks 50 --seed 1 --output data/html_test.jsonl

Procedural tasks are ours (colbench/tasks.py, docs/curriculum.md): small personalised functions with two hidden
facts, and pages with five design facts, two of them hidden; a code task whose ground truth fails is dropped.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import colbench
import common
from colbench import tasks as procedural_tasks


@dataclass
class Args:
    output: str
    """where to write the task JSONL"""
    task_type: str = "code"
    """code (backend programming) | html (frontend design)"""
    source: str = "procedural"
    """procedural | file"""
    num_tasks: int = 100
    """how many tasks to write (file: at most this many; 0 = all)"""
    seed: int = 0
    """random seed; use different seeds for train and test"""
    input: str = ""
    """file source: a ColBench JSONL or a `datasets` directory saved on disk"""
    exclude: str = ""
    """drop any task that also appears in these task files (comma-separated), e.g. the test split: the same
    description and hidden information is the same task (colbench.task_identity), whatever its tests"""
    split: str = "all"
    """procedural: test | train | all. The procedural tasks are split once by their identity (a fifth test): tasks
    of --split test are never tasks of --split train, whatever the seeds (run.sh: test tasks test, the rest train)"""
    workers: int = 8
    """parallel sandboxed checks of ground truths"""


def main(args):
    if args.task_type not in ("code", "html"):
        sys.exit(f"--task_type {args.task_type}: choose code or html")
    common.check_writable(args.output)
    common.refuse(args.split not in ("test", "train", "all") and f"--split {args.split}: choose test, train or all",
                  args.split != "all" and args.source != "procedural"
                  and "--split is for procedural tasks (a ColBench file is split already)")
    exclude = {colbench.task_identity(t) for f in filter(None, args.exclude.split(","))
               for t in colbench.load_tasks(f, args.task_type)}
    if args.source == "procedural":
        tasks = procedural_tasks.procedural(args.task_type, args.num_tasks, args.seed, args.split, exclude,
                                            args.workers)
    elif args.source == "file":
        if not args.input:
            sys.exit("--source file needs --input PATH")
        tasks = [t for t in colbench.load_tasks(args.input, args.task_type)
                 if colbench.task_identity(t) not in exclude]
        tasks = tasks[: args.num_tasks or None]
    else:
        sys.exit(f"--source {args.source}: choose procedural or file")
    common.write_jsonl(args.output, tasks)
    print(f"wrote {len(tasks)} tasks to {args.output}")


if __name__ == "__main__":
    common.run(main, Args, __doc__)
