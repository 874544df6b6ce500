"""Frontend design: offline rendering with Tailwind, similarity (fallback and a tiny CLIP), the design
critic, HTML extraction, and an html rollout + evaluation end to end."""
import json
import random

import pytest

import colbench
import colbench.human
import common
import credit
from colbench import grade, render
import evaluate
import colbench.tasks
from conftest import read_jsonl, run_script

PAGE = """<html><link href="https://cdn.jsdelivr.net/npm/tailwindcss@2.2.19/dist/tailwind.min.css" rel="stylesheet">
<body class="bg-gray-100"><header class="bg-{header}-500 text-white p-6 text-center"><h1 class="text-3xl">Shop</h1></header>
<section class="p-10"><p>Hello there</p><img src="https://picsum.photos/id/48/300/200?junk"></section>{footer}</body></html>"""
FOOTER = '<footer class="bg-gray-800 text-white p-4"><p>Bye</p></footer>'


@pytest.fixture(scope="module")
def renderer():
    with render.Renderer() as r:
        yield r


def page(header="blue", footer=True):
    return PAGE.format(header=header, footer=FOOTER if footer else "")


def test_tailwind_applies_offline(renderer):
    img, ok = renderer.render(page("blue"))
    assert ok and img.size[0] == 1280 and img.size[1] >= 800
    assert img.getpixel((5, 5)) == (59, 130, 246)  # bg-blue-500: Tailwind's own colour, so the local CSS applied
    assert img.getpixel((640, 780 if img.height == 800 else 700)) == (243, 244, 246)  # body bg-gray-100
    # the picsum image became a same-size grey placeholder (offline, layout kept)
    assert (190, 190, 190) in [img.getpixel((x, y)) for x in range(40, 400, 20) for y in range(100, 400, 20)]


def test_broken_page_becomes_blank_and_is_counted(renderer):
    with render.Renderer(timeout=0.001) as r:  # no page loads in a millisecond
        img, ok = r.render(page())
        assert not ok and r.failures == 1
        assert img.size == render.VIEWPORT and img.getpixel((0, 0)) == (255, 255, 255)


def test_target_renders_are_kept_on_disk(renderer, tmp_path, monkeypatch):
    """RenderPool.render_kept (target pages): a page rendered once comes back from disk with the same pixels and no
    browser; another page is rendered, and a page that failed to render is never kept."""
    monkeypatch.setattr(render, "kept_renders_dir", lambda: tmp_path)
    fresh = renderer.render(page("blue"))[0]
    with render.RenderPool(1) as pool:
        img, ok = pool.render_kept(page("blue"))
        assert ok and img.tobytes() == fresh.tobytes()
    assert len(list(tmp_path.rglob("*.png"))) == 1
    with render.RenderPool(1) as pool:
        pool.renderers[0].driver_path = "/nonexistent"  # no browser can start: only a kept image can answer
        img, ok = pool.render_kept(page("blue"))
        assert ok and img.tobytes() == fresh.tobytes() and pool.failures == 0
        img, ok = pool.render_kept(page("red"))  # never kept: it needs the browser, which fails
        assert not ok and pool.failures == 1
        (next(tmp_path.rglob("*.png"))).write_bytes(b"torn")  # a damaged file is rendered again, not trusted
        assert pool.render_kept(page("blue"))[1] is False and pool.failures == 2
    assert len(list(tmp_path.rglob("*.png"))) == 1 and not list(tmp_path.rglob("*.tmp"))


def test_similarity_self_is_one_and_other_pages_lower(renderer):
    a, b, c = (renderer.render(page(h, f))[0] for h, f in (("blue", True), ("blue", True), ("red", False)))
    sim = render.ImageSimilarity()
    assert sim.metric == "pixel_hist_v1"
    same, diff = sim([a], [b])[0], sim([a], [c])[0]
    assert same == pytest.approx(1.0) and diff < 0.99


def test_tiny_clip_model_scores_through_the_same_path(renderer, tmp_path):
    import torch
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel
    torch.manual_seed(0)
    cfg = CLIPConfig(text_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2},
                     vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                                    "num_attention_heads": 2, "image_size": 32, "patch_size": 8}, projection_dim=8)
    CLIPModel(cfg).save_pretrained(tmp_path / "clip")
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(tmp_path / "clip")
    sim = render.ImageSimilarity(str(tmp_path / "clip"))
    a, c = renderer.render(page("blue"))[0], renderer.render(page("red", False))[0]
    s = sim([a, a], [a, c])
    assert sim.metric.startswith("clip:") and s[0] == pytest.approx(1.0, abs=1e-5) and s[1] < s[0]


def test_tailwind_play_cdn_script_applies_offline(renderer):
    cdn = page("blue").replace('<link href="https://cdn.jsdelivr.net/npm/tailwindcss@2.2.19/dist/tailwind.min.css" rel="stylesheet">',
                               '<head><script src="https://cdn.tailwindcss.com"></script></head>')
    assert "cdn.tailwindcss.com" in cdn and "tailwind.min.css" not in cdn
    img, ok = renderer.render(cdn)
    assert ok and img.getpixel((5, 5)) == (59, 130, 246)  # styled by the local copy, not the unreachable script


def test_final_answer_and_output_follow_released_rules():
    assert colbench.split_output("think... OUTPUT: ask this OUTPUT: junk") == (" ask this ", "think... OUTPUT: ask this ")
    assert colbench.split_output("plain") == ("plain", "plain")
    turns = ["<html>first</html>", "Is it blue?", "I WANT TO ANSWER: sorry, no page"]
    dialogue = [m for t in turns for m in ({"role": "assistant", "content": t}, {"role": "user", "content": "ok"})]
    assert colbench.final_answer(dialogue, "html") == "<html>first</html>"  # the last page shown, in any turn
    assert colbench.final_answer(dialogue[:2] + [{"role": "assistant", "content": "<body>b</body>"}], "html") == "<body>b</body>"
    assert colbench.final_answer([{"role": "assistant", "content": "Is it blue?"}], "html") == ""
    assert colbench.final_answer(dialogue, "code") == "sorry, no page"


def test_html_extraction_follows_released_rules():
    assert render.extract_html("text <html><body>a</body></html> more <html>b</html>") == "<html><body>a</body></html>"
    assert render.extract_html("x <BODY class='p'>b</BODY> y") == "<BODY class='p'>b</BODY>"
    assert render.extract_html("no page here") is None
    assert colbench.extract_answer("I WANT TO ANSWER: <html>z</html>", "html") == "<html>z</html>"


def test_procedural_pages_are_deterministic_and_import_websight(tmp_path):
    a = [colbench.tasks.procedural_page(random.Random(5)) for _ in range(2)]
    assert a[0] == a[1] and "tailwindcss@2.2.19" in a[0]["ground_truth"]
    for t in [colbench.tasks.procedural_page(random.Random(s)) for s in range(30)]:  # 2 of the 5 facts hidden
        hidden = t["hidden_information"].splitlines()
        assert len(hidden) == 2 and len(colbench.design_of(t)) == 5 and "background" not in colbench.design_in(hidden[0] + hidden[1])
        assert not any(f in t["problem_description"] for f in hidden)
    (tmp_path / "ws.jsonl").write_text(json.dumps({"text": a[0]["ground_truth"], "llm_generated_idea": "A page."}) + "\n")
    (t,) = colbench.load_tasks(tmp_path / "ws.jsonl", "html")
    assert t["problem_description"] == "A page." and t["ground_truth"] == a[0]["ground_truth"]
    (tmp_path / "bad.jsonl").write_text(json.dumps({"problem_description": "x"}) + "\n")
    with pytest.raises(common.DataError, match="bad.jsonl:1: missing field 'ground_truth'"):
        colbench.load_tasks(tmp_path / "bad.jsonl", "html")


def test_html_rollout_and_evaluation_end_to_end(tiny_model, simulator_url, tmp_path):
    run_script("generate_tasks.py", "--task_type", "html", "--num_tasks", "2", "--seed", "3", "--output", tmp_path / "t.jsonl")
    run_script("rollout.py", "--task_type", "html", "--tasks", tmp_path / "t.jsonl", "--output", tmp_path / "r.jsonl",
               "--agent_model", tiny_model, "--simulator_url", simulator_url, "--max_turns", "2", "--max_new_tokens", "8")
    rows = read_jsonl(tmp_path / "r.jsonl")
    assert len(rows) == 2
    asked = [r for r in rows if r["num_turns"] == 2]  # the random model shows no snippet and no marker
    assert asked
    for r in asked:  # a text message on a page with hidden facts: at most the hidden lines it matches
        reply = r["dialogue_history"][2]["content"]
        assert reply == "I don't know, sorry." or set(reply.split(". ")) <= set(r["task"]["hidden_information"].splitlines())
    # ColBench's frontend tasks hold no hidden facts: the scripted human refuses them, in words, and the
    # dialogues end with finish=error (a rerun against a vision-language model redoes them)
    (tmp_path / "cb.jsonl").write_text("".join(json.dumps({k: t[k] for k in ("problem_description", "ground_truth")}) + "\n"
                                               for t in read_jsonl(tmp_path / "t.jsonl")))
    run_script("rollout.py", "--task_type", "html", "--tasks", tmp_path / "cb.jsonl", "--output", tmp_path / "cb_r.jsonl",
               "--agent_model", tiny_model, "--simulator_url", simulator_url, "--max_turns", "2", "--max_new_tokens", "8")
    for r in read_jsonl(tmp_path / "cb_r.jsonl"):
        assert r["finish"] == "error" and "answers procedural pages (hidden design facts) only" in r["error"]
    run_script("rollout.py", "--task_type", "html", "--tasks", tmp_path / "t.jsonl", "--output", tmp_path / "o.jsonl",
               "--agent_backend", "oracle", "--agent_model", tiny_model, "--simulator_url", simulator_url)
    run_script("evaluate.py", "--task_type", "html", "--input", tmp_path / "o.jsonl", "--output", tmp_path / "og.jsonl",
               "--summary", tmp_path / "os.json")
    run_script("evaluate.py", "--task_type", "html", "--input", tmp_path / "r.jsonl", "--output", tmp_path / "rg.jsonl",
               "--summary", tmp_path / "rs.json", "--reference", tmp_path / "og.jsonl")
    oracle, tiny = (json.loads((tmp_path / f).read_text()) for f in ("os.json", "rs.json"))
    assert oracle["similarity"] == pytest.approx(1.0) and oracle["metric"] == "pixel_hist_v1"
    assert oracle["exact_design"] == 1.0 and oracle["mean_turns"] > 1  # it asked or showed drafts before answering
    assert tiny["similarity"] < 1.0 and tiny["win_rate"] == 0.0  # the random model never beats the target itself
    assert all(r["metric"] == "pixel_hist_v1" for r in read_jsonl(tmp_path / "rg.jsonl"))
    # the reward of a procedural page: the share of its five design facts right (no page: none), beside the similarity
    assert all(r["reward"] == 1.0 and r["similarity"] == pytest.approx(1.0) for r in read_jsonl(tmp_path / "og.jsonl"))
    assert all(r["reward"] == 0.0 < r["similarity"] for r in read_jsonl(tmp_path / "rg.jsonl") if not r["answer"])
    again = run_script("evaluate.py", "--task_type", "html", "--input", tmp_path / "r.jsonl", "--output", tmp_path / "rg.jsonl",
                       "--summary", tmp_path / "rs.json", "--reference", tmp_path / "og.jsonl")  # a resumed run: no rendering
    assert "reusing" in again.stdout and "answer pages" not in again.stderr
    assert json.loads((tmp_path / "rs.json").read_text()) == tiny
    assert grade.win_rate([{"task_id": "a", "reward": 0.5}], [{"task_id": "a", "reward": 0.5}]) == 0.5


def test_design_facts_are_read_from_pixels(renderer):
    """Every design fact of a procedural page comes back from its render; changing one fact changes
    exactly that feature, and the human names it (the most important wrong hidden fact, one at a time)."""
    rng = random.Random(11)
    for _ in range(8):
        design = {k: rng.choice(v) for k, (_, v) in colbench.DESIGN_FACTS.items()}
        assert render.design_features(renderer.render(colbench.design_page(design, "Bike Shop"))[0]) == design
        key = rng.choice(sorted(design))
        other = dict(design, **{key: next(v for v in colbench.DESIGN_FACTS[key][1] if v != design[key])})
        features = render.design_features(renderer.render(colbench.design_page(other, "Bike Shop"))[0])
        assert colbench.design_mismatches(design, features) == [key]
        hidden = "\n".join(colbench.design_fact(k, design[k]) for k in design)
        assert colbench.draft_reply(hidden, features) == f"Not quite. {colbench.design_fact(key, design[key])}"
    assert colbench.draft_reply(hidden, render.design_features(
        renderer.render(colbench.design_page(design, "Bike Shop"))[0])).startswith("Yes, that is")
    blank = render.design_features(renderer.render("<body></body>")[0])
    assert blank == {"background": "white", "header": None, "boxes": None, "footer": None, "title": None}


def test_html_human_reveals_one_fact_at_a_time(renderer):
    """Through the simulator's chat path: a text question gets the hidden line it matches, a shown draft
    its most important wrong hidden fact, never the whole design."""
    task = {"problem_description": "A page for my gym: a header, boxes and a footer. The footer is gray. "
                                   "There are 3 boxes in a row.", "hidden_information": "The page background is dark.\n"
            "The header is green.\nThe title is aligned to the right.",
            "ground_truth": "<html>" + colbench.design_page(
                {"background": "dark", "header": "green", "boxes": "3", "footer": "gray", "title": "right"}, "Gym") + "</html>"}
    human = colbench.human.ScriptedHuman()
    target = renderer.render(task["ground_truth"])[0]
    ask = lambda text, img=None: human.chat(colbench.human_messages(task, [{"role": "user", "content": "x"},
                                                                           {"role": "assistant", "content": text}],
                                                                    "html", img, target))
    assert ask("What colour is the header?") == "The header is green."
    assert ask("How should the title be aligned?") == "The title is aligned to the right."
    assert ask("Do you want a contact form?") == "I don't know, sorry."
    draft = colbench.design_page({"background": "white", "header": "red", "boxes": "3", "footer": "gray",
                                        "title": "left"}, "Gym")
    assert ask(f"Here is a draft. {draft}", renderer.render(draft)[0]) == "Not quite. The page background is dark."
    # a draft right on every hidden fact but against the request (3 boxes) is not approved: the human names
    # the stated fact it breaks (nothing new), and approves the page once it matches
    draft = colbench.design_page({"background": "dark", "header": "green", "boxes": "2", "footer": "gray",
                                        "title": "right"}, "Gym")
    assert ask(f"Here is a draft. {draft}", renderer.render(draft)[0]) == "Not quite. There are 3 boxes in a row."
    draft = colbench.design_page({"background": "dark", "header": "green", "boxes": "3", "footer": "gray",
                                        "title": "right"}, "Gym")
    assert ask(f"Here is a draft. {draft}", renderer.render(draft)[0]) == "Yes, that is what I have in mind."


def test_html_turn_classes():
    """Questions and drafts are good when they reveal a hidden fact not yet revealed; an answer when its
    render matches every design fact (features given here; the browser path is tested above)."""
    design = {"background": "dark", "header": "green", "boxes": "3", "footer": "gray", "title": "right"}
    task = {"problem_description": "A page. The footer is gray. There are 3 boxes in a row.",
            "hidden_information": "The page background is dark.\nThe header is green.\nThe title is aligned to the right."}
    feats = {colbench.design_page(design, "Gym"): design,
             colbench.design_page(dict(design, header="red"), "Gym"): dict(design, header="red"),
             colbench.design_page(dict(design, title="left"), "Gym"): dict(design, title="left")}
    cls = lambda turn, dialogue=(): credit.design_turn_class(task, [{"role": "user", "content": "hi"}, *dialogue],
                                                               turn, False, feats.__getitem__)
    right, red, left = feats
    heard = [{"role": "assistant", "content": "?"}, {"role": "user", "content": "The header is green."}]
    assert cls("What colour is the header?") == "good" and cls("What colour is the header?", heard) == "bad"
    assert cls("Which font do you like?") == "bad"
    assert cls(f"Draft: {red}") == "good" and cls(f"Draft: {red}", heard) == "bad"  # names the header, known by then
    assert cls(f"Draft: {right}") == "bad"  # nothing left to reveal: the human approves it
    # a wrong hidden fact is named before a broken request (a red footer, the title wrong too): it reveals
    off = colbench.design_page(dict(design, footer="red", title="left"), "Gym")
    feats[off] = dict(design, footer="red", title="left")
    assert cls(f"Draft: {off}") == "good" and cls(f"I WANT TO ANSWER: {off}") == "bad"
    # a draft right on every hidden fact that breaks the request hears the stated fact: nothing new
    off = colbench.design_page(dict(design, footer="red"), "Gym")
    feats[off] = dict(design, footer="red")
    assert cls(f"Draft: {off}") == "bad" and cls(f"I WANT TO ANSWER: {off}") == "bad"
    assert cls(f"I WANT TO ANSWER: {right}") == "good" and cls(f"I WANT TO ANSWER: {left}") == "bad"
    assert cls("I WANT TO ANSWER: no page") == "bad"
    assert credit.design_turn_class(task, [], right, True, feats.__getitem__) == "good"  # the last turn is the answer


def test_compare_reports_html_similarity_win_rate_and_exact_design(tmp_path, capsys):
    # procedural pages: the reward is the share of design facts right, the similarity is reported beside it
    rows = lambda sims, exact: "".join(json.dumps({"task": {"problem_description": "p", "ground_truth": "g"}, "task_id": f"t{i}",
                                                     "sample": 0, "similarity": r, "reward": 1.0 if e else 0.6,
                                                     "metric": "pixel_hist_v1", "success": e,
                                                     "exact_design": e, "dialogue_history": [], "answer": "" if r < 0.25 else "<p>"}) + "\n"
                                          for i, (r, e) in enumerate(zip(sims, exact)))
    (tmp_path / "a.jsonl").write_text(rows([0.5, 0.8, 0.9, 0.3], [False, False, True, False]))
    (tmp_path / "b.jsonl").write_text(rows([0.9, 0.8, 1.0, 0.2], [True, False, True, False]))
    res = evaluate.main(common.parse_args(evaluate.Args, argv=["--compare", f"zero_shot={tmp_path / 'a.jsonl'},"
                                                                f"sweet_rl={tmp_path / 'b.jsonl'}", "--summary", str(tmp_path / "r.json")]))
    assert res == json.loads((tmp_path / "r.json").read_text()) and res["metric"] == "pixel_hist_v1"
    s, z = res["methods"]["sweet_rl"], res["methods"]["zero_shot"]
    assert s["similarity"] == pytest.approx(0.725) and z["exact_design"] == 0.25 and s["exact_design"] == 0.5
    p = res["paired_vs_zero_shot"]["sweet_rl"]
    assert p["diff"] == pytest.approx(0.1) and p["win_rate"] == pytest.approx((1 + 0.5 + 1 + 0) / 4)
    assert p["win_rate_ci95"][0] <= p["win_rate"] <= p["win_rate_ci95"][1] and p["ci95"][0] <= p["diff"] <= p["ci95"][1]
    assert p["exact_design_diff"] == pytest.approx(0.25) and p["exact_design_ci95"] == [0.0, 0.75]  # one task of 4 gained
    assert (p["won"], p["tied"], p["lost"]) == (2, 1, 1)
    out = capsys.readouterr().out
    # a dialogue with no page to grade (sweet_rl's 0.2: it never showed one) is counted
    assert (z["no_page"], s["no_page"]) == (0, 1) and "dialogues with no page to grade: zero_shot 0, sweet_rl 1" in out
    # validation selects a procedural page's snapshot by success (exact designs), not by similarity
    (tmp_path / "s.jsonl").write_text(rows([0.95, 0.95, 0.95, 0.9], [False, True, False, False]))
    sel = evaluate.main(common.parse_args(evaluate.Args, argv=["--select", "--compare", f"start={tmp_path / 'a.jsonl'},"
                                                                f"similar={tmp_path / 's.jsonl'},exact={tmp_path / 'b.jsonl'}"]))
    assert sel["methods"]["similar"]["similarity"] > sel["methods"]["exact"]["similarity"]
    assert (sel["selected"], sel["selected_by"]) == ("exact", "exact_design")
    (tmp_path / "c.jsonl").write_text(rows([0.5], [False]).replace("pixel_hist_v1", "clip:x"))
    with pytest.raises(common.DataError, match="not comparable"):
        evaluate.main(common.parse_args(evaluate.Args, argv=["--compare", f"a={tmp_path / 'a.jsonl'},c={tmp_path / 'c.jsonl'}"]))
