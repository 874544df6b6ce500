"""Frontend design: offline rendering with Tailwind, similarity (fallback and a tiny CLIP), the design
critic, HTML extraction, and an html rollout + evaluation end to end."""
import json
import random

import pytest

import colbench
import common
import render
import evaluate
import generate_tasks
import simulator
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


def test_design_critic_names_planted_differences(renderer):
    target = renderer.render(page("blue"))[0]
    red = simulator.design_feedback(renderer.render(page("red"))[0], target)
    assert "top of the page should be blue" in red and "not red" in red
    no_footer = simulator.design_feedback(renderer.render(page("blue", footer=False))[0], target)
    assert "missing some sections" in no_footer or "bottom of the page should be dark gray" in no_footer
    assert simulator.design_feedback(renderer.render(page("blue"))[0], target) == "It looks very close to what I want."
    assert simulator.design_feedback(None, target).startswith("I have not seen a page from you yet")
    assert len([s for s in red.split(". ") if s]) <= 3


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
    a = [generate_tasks.procedural_page(random.Random(5)) for _ in range(2)]
    assert a[0] == a[1] and "tailwindcss@2.2.19" in a[0]["ground_truth"]
    (tmp_path / "ws.jsonl").write_text(json.dumps({"text": a[0]["ground_truth"], "llm_generated_idea": "A page."}) + "\n")
    (t,) = generate_tasks.load_html_tasks(tmp_path / "ws.jsonl")
    assert t["problem_description"] == "A page." and t["ground_truth"] == a[0]["ground_truth"]
    (tmp_path / "bad.jsonl").write_text(json.dumps({"problem_description": "x"}) + "\n")
    with pytest.raises(common.DataError, match="bad.jsonl:1: missing field 'ground_truth'"):
        generate_tasks.load_html_tasks(tmp_path / "bad.jsonl")


def test_html_rollout_and_evaluation_end_to_end(tiny_model, simulator_url, tmp_path):
    run_script("generate_tasks.py", "--task_type", "html", "--num_tasks", "2", "--seed", "3", "--output", tmp_path / "t.jsonl")
    run_script("rollout.py", "--task_type", "html", "--tasks", tmp_path / "t.jsonl", "--output", tmp_path / "r.jsonl",
               "--agent_model", tiny_model, "--simulator_url", simulator_url, "--max_turns", "2", "--max_new_tokens", "8")
    rows = read_jsonl(tmp_path / "r.jsonl")
    assert len(rows) == 2
    asked = [r for r in rows if r["num_turns"] == 2]  # the random model shows no snippet and no marker
    assert asked
    for r in asked:  # the human saw only the target page and described it
        assert r["dialogue_history"][2]["content"].startswith("I have not seen a page from you yet")
        assert len(r["dialogue_history"][2]["content"]) <= 1000
    run_script("rollout.py", "--task_type", "html", "--tasks", tmp_path / "t.jsonl", "--output", tmp_path / "o.jsonl",
               "--agent_backend", "oracle", "--agent_model", tiny_model, "--simulator_url", simulator_url)
    run_script("evaluate.py", "--task_type", "html", "--input", tmp_path / "o.jsonl", "--output", tmp_path / "og.jsonl",
               "--summary", tmp_path / "os.json")
    run_script("evaluate.py", "--task_type", "html", "--input", tmp_path / "r.jsonl", "--output", tmp_path / "rg.jsonl",
               "--summary", tmp_path / "rs.json", "--reference", tmp_path / "og.jsonl")
    oracle, tiny = (json.loads((tmp_path / f).read_text()) for f in ("os.json", "rs.json"))
    assert oracle["similarity"] == pytest.approx(1.0) and oracle["metric"] == "pixel_hist_v1"
    assert tiny["similarity"] < 1.0 and tiny["win_rate"] == 0.0  # the random model never beats the target itself
    assert all(r["metric"] == "pixel_hist_v1" for r in read_jsonl(tmp_path / "rg.jsonl"))
    assert evaluate.win_rate([{"task_id": "a", "reward": 0.5}], [{"task_id": "a", "reward": 0.5}]) == 0.5
