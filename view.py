r"""A trajectory viewer for teaching: one self-contained static HTML page (opens offline).

Each dialogue is a chat; with --critic every agent turn is coloured by its advantage A(o_t, a_t, c)
(train_critic.dialogue_advantages, the critic against its pi_ref on c + o_t: exactly what it
learnt), red (negative) through white to green. With --states (label_turns.py's PAIRS.states.jsonl)
each labelled state lists its candidate turns by advantage, chosen and rejected marked, with their
true class on procedural tasks. Html tasks show the target and answer renders.

    python view.py --trajectories runs/default/test_sweet_rl_graded.jsonl --output report.html
    python view.py --trajectories zero_shot=ZS_GRADED,sweet_rl=SWEET_GRADED --states RUN/pairs.jsonl.states.jsonl \
        --critic RUN/critic --output report.html
"""
from __future__ import annotations

import html
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import colbench
import common
from machinery import models


@dataclass
class Args:
    trajectories: str = ""
    """graded trajectories: FILE, or NAME=FILE,NAME=FILE (one per method)"""
    output: str = ""
    """the HTML page to write"""
    states: str = ""
    """label_turns.py's PAIRS.states.jsonl: candidate turns per labelled state"""
    critic: str = ""
    """train_critic.py output directory: colour every agent turn by its advantage"""
    max_dialogues: int = 120
    """dialogues shown per method (those with a labelled state first, then in file order)"""
    task_type: str = "code"
    """code | html (html: the target and the answer rendered side by side)"""


def turn_advantages(rows, critic_dir):
    """Per agent turn of every row: the critic's advantage (train_critic.dialogue_advantages), in its units."""
    import torch
    from train_critic import dialogue_advantages, load_critic
    settings, ref_name = load_critic(critic_dir)
    device = models.local_device()  # a GPU when there is one: bf16 there (an 8B critic and pi_ref fit), fp32 on the CPU
    tok = models.load_tokenizer(ref_name)
    critic, ref = (models.load_model(m, device).eval() for m in (critic_dir, ref_name))
    with torch.no_grad():
        return [dialogue_advantages(critic, ref, tok, settings, r, settings.get("max_len")).tolist()
                for r in common.tqdm_if(rows, True, "advantages")]


def colour(adv, scale):
    """Red (negative) through white to green (positive), saturating at |adv| = scale."""
    x = max(-1.0, min(1.0, adv / scale)) if scale else 0.0
    return f"hsl({120 if x >= 0 else 0}, 70%, {100 - 35 * abs(x):.0f}%)"


def renders(rows):
    """html tasks: {task_id: target data URL} and per row its answer's data URL."""
    from colbench import render
    with render.RenderPool(2) as pool:
        targets = {r["task_id"]: r["task"]["ground_truth"] for r in rows}
        pages = pool.render_many(list(targets.values()))
        target_imgs = dict(zip(targets, (render.image_to_data_url(i, 1200) for i, _ in pages)))
        pages = pool.render_many([r.get("answer") or "" for r in rows])
        answers = [render.image_to_data_url(i, 1200) for i, _ in pages]
    return target_imgs, answers


def dialogue_html(r, method, advantages, scale, states, images):
    e = html.escape
    ok = bool(r.get("success", r.get("reward", 0) >= 1.0))
    parts = [f'<div class="dlg" data-task="{e(r["task_id"])}" data-method="{e(method)}" data-success="{int(ok)}">',
             f'<h3>{e(method)} &middot; task {e(r["task_id"][:10])} &middot; sample {r.get("sample", 0)} &middot; '
             f'{"success" if ok else "failure"} &middot; reward {r.get("reward", 0):.2f}</h3>',
             f'<details><summary>hidden information</summary>'
             f'<pre>{e(r["task"].get("hidden_information", ""))}</pre></details>']
    turn = 0
    for m in r["dialogue_history"]:
        if m["role"] == "assistant" and "input" in m:
            adv = advantages[turn] if advantages else None
            style = f' style="background:{colour(adv, scale)}"' if adv is not None else ""
            label = f'<span class="adv">A = {adv:+.4f}</span>' if adv is not None else ""
            attr = f' data-adv="{adv:.6f}"' if adv is not None else ""
            parts.append(f'<div class="msg agent"{attr}{style}><b>agent, turn {turn + 1}</b> {label}'
                         f'<pre>{e(m["content"])}</pre></div>')
            st = states.get((r["task_id"], r.get("sample", 0), turn))
            if st:
                parts.append(state_html(st, scale))
            turn += 1
        else:
            parts.append(f'<div class="msg human"><b>human</b><pre>{e(m["content"])}</pre></div>')
    if images:
        target, answer = images
        parts.append(f'<div class="pages"><figure><img src="{target}"><figcaption>target</figcaption></figure>'
                     f'<figure><img src="{answer}"><figcaption>answer</figcaption></figure></div>')
    return "\n".join(parts) + "</div>"


def state_html(st, scale):
    """The candidate turns sampled at this state, best advantage first, chosen/rejected marked."""
    e = html.escape
    order = sorted(range(len(st["candidates"])), key=lambda i: -st["advantages"][i])
    rows = []
    for i in order:
        marks = " ".join(sorted(st.get("marks", {}).get(i, [])))
        cls = (st.get("classes") or [None] * len(order))[i]
        rows.append(f'<tr style="background:{colour(st["advantages"][i], scale)}"><td>{st["advantages"][i]:+.4f}</td>'
                    f'<td>{e(marks)}</td><td>{e(cls or "")}</td><td><pre>{e(st["candidates"][i])}</pre></td></tr>')
    return (f'<details class="state" open><summary>{len(order)} candidate turns at this state (label_turns)</summary>'
            f'<table><tr><th>advantage</th><th>pair</th><th>true class</th><th>candidate</th></tr>{"".join(rows)}'
            f'</table></details>')


PAGE = """<!DOCTYPE html><html><head><meta charset="utf-8"><title>SWEET-RL trajectories</title><style>
body{font-family:sans-serif;margin:20px;max-width:1100px}
.dlg{border:1px solid #bbb;border-radius:6px;margin:14px 0;padding:8px 12px}
.msg{margin:6px 0;padding:6px 10px;border-radius:6px;border:1px solid #ddd} .human{background:#eef3fb;margin-right:25%}
.agent{margin-left:25%;background:#fff} pre{white-space:pre-wrap;margin:4px 0;font-size:13px}
.adv{float:right;font-family:monospace}
table{border-collapse:collapse;width:100%;font-size:13px}
td,th{border:1px solid #ccc;padding:3px 6px;vertical-align:top}
.pages{display:flex;gap:10px} .pages img{max-width:520px;border:1px solid #999}
#bar{position:sticky;top:0;background:#fafafa;padding:8px;border-bottom:1px solid #ccc}
.legend span{padding:2px 8px;margin-right:4px}
</style></head><body>
<h1>SWEET-RL trajectories</h1><p>__SUMMARY__</p>
<div id="bar">task <input id="task" placeholder="task id"> outcome <select id="succ"><option value="">all</option>
<option value="1">success</option><option value="0">failure</option></select>
method <select id="method"><option value="">all</option>__METHODS__</select>
<span id="count"></span> <span class="legend">__LEGEND__</span></div>
__DIALOGUES__
<script>
function filt(){const t=document.getElementById('task').value.trim(),s=document.getElementById('succ').value,
m=document.getElementById('method').value;
let n=0;for(const d of document.querySelectorAll('.dlg')){
const show=(!t||d.dataset.task.startsWith(t))&&(!s||d.dataset.success===s)&&(!m||d.dataset.method===m);
d.style.display=show?'':'none';n+=show}document.getElementById('count').textContent=n+' dialogues shown'}
for(const id of ['task','succ','method'])for(const ev of ['input','change'])
document.getElementById(id).addEventListener(ev,filt);
filt();
</script></body></html>"""


def main(args):
    common.refuse(not args.trajectories and "--trajectories is required",
                  not args.output and "--output is required")
    files = dict(kv.split("=", 1) if "=" in kv else (Path(kv).stem.replace("_graded", ""), kv)
                 for kv in args.trajectories.split(","))
    common.refuse(args.task_type not in ("code", "html") and f"--task_type {args.task_type}: choose code or html",
                  *[not Path(f).exists() and f"--trajectories: {f} not found" for f in files.values()],
                  args.states and not Path(args.states).exists() and f"--states {args.states}: not found",
                  args.critic and not (Path(args.critic) / "run_settings.json").exists()
                  and f"--critic {args.critic}: no run_settings.json (expected a train_critic.py output directory)")
    common.check_writable(args.output)
    states = {}
    if args.states:
        marks = {}
        pairs_path = Path(args.states[: -len(".states.jsonl")]) if args.states.endswith(".states.jsonl") else None
        for _, p in common.read_jsonl(pairs_path) if pairs_path and pairs_path.exists() else []:
            marks.setdefault((p["task_id"], p["sample"], p["turn"]), []).append((p["chosen"], p["rejected"]))
        classes = Path(f"{pairs_path}.classes.jsonl") if pairs_path else None  # credit.py's true classes
        classes = {(c["task_id"], c["sample"], c["turn"]): c["classes"]
                   for _, c in (common.read_jsonl(classes, True) if classes and classes.exists() else [])}
        for _, s in common.read_jsonl(args.states):
            key = (s["task_id"], s["sample"], s["turn"])
            s["classes"] = classes.get(key)
            s["marks"] = {}
            for k, (c, r) in enumerate(marks.get(key, []), 1):
                s["marks"].setdefault(s["candidates"].index(c), []).append(f"chosen #{k}")
                s["marks"].setdefault(s["candidates"].index(r), []).append(f"rejected #{k}")
            states[key] = s
    labelled = {(t, n) for t, n, _ in states}
    runs, totals = {}, {}
    for name, path in files.items():  # dialogues with a labelled state first, then file order
        rows = colbench.load_graded(path)
        totals[name] = (len(rows), sum(bool(r.get("success")) for r in rows))
        runs[name] = sorted(rows, key=lambda r: (r["task_id"], r.get("sample", 0)) not in labelled)
        runs[name] = runs[name][: args.max_dialogues]
    advantages = {name: turn_advantages(rows, args.critic) if args.critic else [None] * len(rows)
                  for name, rows in runs.items()}
    values = [abs(a) for v in advantages.values() for adv in v if adv for a in adv] + \
             [abs(a) for s in states.values() for a in s["advantages"]]
    scale = sorted(values)[int(0.95 * (len(values) - 1))] if values else 1.0  # colours saturate at the 95th percentile
    blocks = []
    for name, rows in runs.items():
        images = renders(rows) if args.task_type == "html" else None
        for i, r in enumerate(rows):
            pics = (images[0][r["task_id"]], images[1][i]) if images else None
            blocks.append(dialogue_html(r, name, advantages[name][i], scale, states, pics))
    summary = ", ".join(f"{name}: {100 * totals[name][1] / totals[name][0]:.1f}% success over {totals[name][0]} "
                        f"dialogues, {len(rows)} shown" for name, rows in runs.items())
    summary += f"; {len(states)} labelled states" if states else ""
    credit = Path(f"{args.states[: -len('.states.jsonl')]}.credit.json") if args.states else None
    if credit and credit.exists():  # credit.py's turn credit by kind of class pair, for the form that ranked
        report = json.loads(credit.read_text())
        for name, split in report.get("by_kind", {}).items():
            form = f" ({report['forms'][name]})" if name in report.get("forms", {}) else ""
            summary += html.escape(f"; turn credit of {name}{form}: "
                                   + ", ".join(f"{k} {a:.2f} ({n} pairs)" for k, (a, n) in split.items()))
        if report.get("kind_order"):
            order = report["kind_order"]
            summary += f"; state-blind best order {html.escape(order['order'])} {order['accuracy']:.2f}"
    summary += f"; turn colours: advantage from the critic {html.escape(args.critic)}" if args.critic else ""
    legend = "".join(f'<span style="background:{colour(x * scale, scale)}">{x * scale:+.3f}</span>'
                     for x in (-1, -0.5, 0, 0.5, 1))
    page = (PAGE.replace("__SUMMARY__", summary).replace("__LEGEND__", legend)
            .replace("__METHODS__", "".join(f'<option>{html.escape(n)}</option>' for n in runs))
            .replace("__DIALOGUES__", "\n".join(blocks)))
    common.write_text(args.output, page)
    print(f"wrote {args.output} ({len(blocks)} dialogues)", file=sys.stderr)


if __name__ == "__main__":
    common.run(main, Args, __doc__)
