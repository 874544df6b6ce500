"""view.py: the static trajectory report opened in real headless Chromium (dialogues and coloured
advantages present in the rendered page, a screenshot saved)."""
import json
import os

import torch
from PIL import Image
from transformers import AutoModelForCausalLM

import credit
from machinery import models
from colbench import render
from conftest import run_script
from test_training import TASK, make_traj

def test_report_in_a_real_browser(tiny_model, tmp_path):
    tok = models.load_tokenizer(tiny_model)
    rows = [make_traj(tok, TASK, ["What factor?", "I WANT TO ANSWER: def f(x): return x * 2"], ["Double it."], 1.0, 0),
            make_traj(tok, TASK, ["I WANT TO ANSWER: def f(x): return x"], [], 0.0, 1)]
    (tmp_path / "g.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    state = {"task_id": "t0", "sample": 1, "turn": 0, "candidates": ["What factor?", "I WANT TO ANSWER: x"],
             "advantages": [0.02, -0.03]}
    (tmp_path / "pairs.jsonl.states.jsonl").write_text(json.dumps(state) + "\n")
    (tmp_path / "pairs.jsonl.classes.jsonl").write_text(json.dumps({  # credit.py's true classes
        "task_id": "t0", "sample": 1, "turn": 0, "classes": ["good", "bad"]}) + "\n")
    (tmp_path / "pairs.jsonl").write_text(json.dumps({"prompt": "p", "chosen": "What factor?", "rejected": "I WANT TO ANSWER: x",
                                                      "task_id": "t0", "sample": 1, "turn": 0}) + "\n")
    critic = AutoModelForCausalLM.from_pretrained(tiny_model)  # a critic that differs from pi_ref
    torch.manual_seed(0)
    with torch.no_grad():
        for p in critic.parameters():
            p.add_(0.05 * torch.randn_like(p))
    critic.save_pretrained(tmp_path / "critic")
    tok.save_pretrained(tmp_path / "critic")
    (tmp_path / "critic" / "run_settings.json").write_text(json.dumps({"model": tiny_model, "beta": 0.1, "lr": 1e-4,
                                                                      "ranking": "released"}))
    (tmp_path / "pairs.jsonl.run_settings.json").write_text(json.dumps({"critic": str(tmp_path / "critic")}))
    credit.report(tmp_path / "pairs.jsonl")  # turn credit by kind, which the page shows for the form that ranked
    run_script("view.py", "--trajectories", f"sweet_rl={tmp_path / 'g.jsonl'}", "--states",
               tmp_path / "pairs.jsonl.states.jsonl", "--critic", tmp_path / "critic", "--output", tmp_path / "report.html")
    page = (tmp_path / "report.html").read_text()
    assert "http" not in page.replace("http-equiv", "")  # self-contained: nothing to fetch
    with render.Renderer() as r:
        img, ok = r.render(page)
        assert ok
        shot = os.environ.get("VIEW_SCREENSHOT", str(tmp_path / "report.png"))
        img.save(shot)
        d = r.driver
        dlgs = d.find_elements("css selector", ".dlg")
        assert len(dlgs) == 2 and "sample 1" in dlgs[0].text  # the dialogue with a labelled state comes first
        agents = d.find_elements("css selector", ".agent[data-adv]")
        assert len(agents) == 3  # every agent turn carries its advantage
        colours = {d.execute_script("return getComputedStyle(arguments[0]).backgroundColor", a) for a in agents}
        assert len(colours) >= 2 and "rgb(255, 255, 255)" not in colours  # coloured by advantage, not all alike
        text = d.find_element("css selector", "body").text
        assert "Double it." in text and "chosen #1" in text and "rejected #1" in text and "good" in text
        assert ("turn credit of sweet (ranking released, normalization turn, ridge 0, lr 0.0001): good question > bad answer "
                "1.00 (1 pairs)") in text and "state-blind best order question > answer 1.00" in text
        d.find_element("css selector", "#succ").send_keys("success")  # the outcome filter hides the failure
        assert d.execute_script("return [...document.querySelectorAll('.dlg')].filter(x => x.style.display != 'none').length") == 1
    assert Image.open(shot).size[0] == 1280
