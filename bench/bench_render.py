"""Frontend speed: pages rendered per second with 1 and 2 browser workers, and similarity scoring per second.

    python bench/bench_render.py                                   # 40 procedural pages
    python bench/bench_render.py --tasks FRONTEND.jsonl    # ColBench frontend tasks, e.g. from the public data
"""
import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from colbench import render  # noqa: E402
import colbench  # noqa: E402
import colbench.tasks  # noqa: E402

p = argparse.ArgumentParser(description=__doc__)
p.add_argument("--tasks", default="")
p.add_argument("--num_pages", type=int, default=40)
p.add_argument("--clip_model", default="")
a = p.parse_args()
pages = [t["ground_truth"] for t in colbench.load_tasks(a.tasks, "html")] if a.tasks else \
    [colbench.tasks.procedural_page(random.Random(i))["ground_truth"] for i in range(a.num_pages)]
for workers in (1, 2):
    with render.RenderPool(workers) as pool:
        pool.render_many(pages[:workers])  # start the browsers outside the timing
        t0 = time.time()
        images = pool.render_many(pages)
        dt = time.time() - t0
        print(f"{workers} worker(s): {len(pages)} pages in {dt:.1f} s -> {len(pages) / dt:.2f} pages/s, "
              f"{pool.failures} failed")
sim = render.ImageSimilarity(a.clip_model)
imgs = [img for img, _ in images]
t0 = time.time()
sim(imgs, imgs[1:] + imgs[:1])
dt = time.time() - t0
print(f"similarity ({sim.metric}): {len(imgs)} pairs in {dt:.2f} s -> {len(imgs) / dt:.1f} pairs/s")
