"""Every script's --help renders cleanly: no Python objects, no doubled defaults, no runs of spaces
inside the examples, one spelling per flag."""
import re
import subprocess
import sys

import pytest

from conftest import ROOT

SCRIPTS = ["generate_tasks.py", "simulator.py", "rollout.py", "evaluate.py", "train_critic.py", "label_turns.py",
           "train_dpo.py", "view.py", "credit.py"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_is_clean(script):
    p = subprocess.run([sys.executable, str(ROOT / script), "--help"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 0, p.stderr
    text = p.stdout
    doc = __import__("ast").get_docstring(__import__("ast").parse((ROOT / script).read_text()))
    assert "usage:" in text and doc.splitlines()[0] in text  # the script's docstring leads its help
    assert "{'" not in text and "'}" not in text, "a Python dict leaked into the help"
    assert text.count("(default:") == len(re.findall(r"\(default:", text))
    for block in re.split(r"\n  --", text.split("options:")[1]):
        assert block.count("(default") <= 1, f"doubled default: --{block[:200]}"
        assert "(default: )" not in block
    assert "--no-" not in text, "a boolean shows a --no-... spelling"
    for line in text.split("options:")[0].splitlines():  # the docstring's example command lines
        if line.lstrip().startswith(("python ", "torchrun ")):
            assert "   " not in line.split("#")[0].strip(), f"a run of spaces in: {line}"  # aligned comments are fine
