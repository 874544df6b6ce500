"""Turn-level DPO speed, side by side with TRL's DPOTrainer: the same model (fp32, CPU), the same
pairs, batch size, beta, learning rate, sigmoid loss and number of optimizer steps; reference
log-probs precomputed by both, one pair per forward in both. Timed: the optimizer steps only (not
loading, not the reference pass).

    pip install --no-deps -t /tmp/trl_site trl           # TRL for the bench only (not in requirements.txt)
    python bench/bench_dpo.py --trl_path /tmp/trl_site [--pairs runs/default/pairs.jsonl]

Without --pairs, 64 pairs are built with realistic lengths: a dialogue prompt of at least 600
tokens and turns of 30-80 tokens. Ours runs train_dpo.py --mode turn (shared prompt), and with
--two_pass also without it (--no_shared_prompt: prompt + turn twice, as TRL does). The reference
log-probs of both are compared pair by pair. The last line is one JSON object:
{"ours_pairs_per_s", "trl_pairs_per_s", "speedup", "first_loss_ours", "first_loss_trl", ...}.
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
import colbench  # noqa: E402
import common  # noqa: E402
from machinery import models  # noqa: E402
import colbench.tasks  # noqa: E402  (procedural tasks: realistic text for the synthetic pairs)

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--model", default="embedded")
p.add_argument("--pairs", default="", help="label_turns.py output of a real run (default: synthetic pairs)")
p.add_argument("--num_pairs", type=int, default=64)
p.add_argument("--batch_size", type=int, default=8)
p.add_argument("--lr", type=float, default=1e-6)
p.add_argument("--beta", type=float, default=0.1)
p.add_argument("--min_prompt_tokens", type=int, default=600)
p.add_argument("--trl_path", default="", help="a folder holding trl (pip install --no-deps -t DIR trl)")
p.add_argument("--two_pass", action="store_true", help="also time ours with --no_shared_prompt")
a = p.parse_args()
if a.trl_path:
    sys.path.insert(0, a.trl_path)
try:
    import trl
except ImportError:
    sys.exit("TRL not found: pip install --no-deps -t /tmp/trl_site trl, then pass --trl_path /tmp/trl_site")
tok = models.load_tokenizer(a.model)
ntok = lambda s: len(tok(s, add_special_tokens=False)["input_ids"])


def synthetic_pairs(n, rng):
    """Dialogues of procedural tasks (request, questions, the human's facts) grown to the prompt length;
    chosen and rejected turns of 30-80 tokens."""
    tasks = [colbench.tasks.procedural_task(rng) for _ in range(n)]
    pairs = []
    for t in tasks:
        facts = [l for l in t["hidden_information"].splitlines() if l.strip()] or ["I don't know."]
        dialogue = [{"role": "user", "content": t["problem_description"]}]
        while ntok(models.render_prompt(tok, colbench.agent_messages(t, dialogue))) < a.min_prompt_tokens:
            f = rng.choice(facts)
            dialogue += [{"role": "assistant", "content": f"Could you tell me more about this part: {f[:60]}?"},
                         {"role": "user", "content": " ".join(rng.sample(facts, len(facts)))}]
        def turn(text):  # 30-80 tokens with the end-of-turn token
            ids = tok(text, add_special_tokens=False)["input_ids"]
            return tok.decode(ids[: rng.randint(29, 79)])
        pairs.append({"prompt": models.render_prompt(tok, colbench.agent_messages(t, dialogue)),
                      "chosen": turn("What exactly should happen when " + " ".join(rng.choice(facts) for _ in range(20))),
                      "rejected": turn("I WANT TO ANSWER:\n" + t["ground_truth"] * 3)})
    return pairs


rng = random.Random(0)
pairs = [r for _, r in common.read_jsonl(a.pairs)][: a.num_pairs] if a.pairs else synthetic_pairs(a.num_pairs, rng)
pairs = [{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in pairs]
lens = [(ntok(r["prompt"]), ntok(r["chosen"]) + 1, ntok(r["rejected"]) + 1) for r in pairs]
print(f"{len(pairs)} pairs: prompt {min(x[0] for x in lens)}-{max(x[0] for x in lens)} tokens, turns "
      f"{min(min(x[1:]) for x in lens)}-{max(max(x[1:]) for x in lens)} tokens; batch {a.batch_size}, "
      f"{len(pairs) // a.batch_size} optimizer steps; {torch.get_num_threads()} threads", flush=True)
steps = len(pairs) // a.batch_size
pairs = pairs[: steps * a.batch_size]

with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "pairs.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in pairs)
    ours = {}
    for name, extra in (("shared", []), ("two_pass", ["--no_shared_prompt"]))[: 2 if a.two_pass else 1]:
        out = os.path.join(d, name)
        subprocess.run([sys.executable, "train_dpo.py", "--pairs", path, "--model", a.model, "--output_dir", out,
                        "--lr", str(a.lr), "--beta", str(a.beta), "--nll_coef", "0", "--batch_size", str(a.batch_size),
                        "--save_minutes", "inf", *extra], cwd=ROOT, check=True, capture_output=True)
        log = [json.loads(l) for l in open(os.path.join(out, "log.jsonl"))]
        ours[name] = (len(pairs) / sum(x["seconds"] for x in log), log[0]["loss"])
        print(f"train_dpo.py --mode turn ({name}): {ours[name][0]:.3f} pairs/s, first loss {ours[name][1]:.6f}", flush=True)

    # TRL, in this process, on the same pairs
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback

    class StepTimer(TrainerCallback):  # from the first step's start to the end of training
        t0, seconds = None, 0.0

        def on_step_begin(self, args, state, control, **kw):
            StepTimer.t0 = StepTimer.t0 or time.time()

        def on_train_end(self, args, state, control, **kw):
            StepTimer.seconds = time.time() - StepTimer.t0

    model = AutoModelForCausalLM.from_pretrained(models.resolve_model(a.model), dtype=torch.float32)
    config = trl.DPOConfig(output_dir=os.path.join(d, "trl"), beta=a.beta, loss_type=["sigmoid"], learning_rate=a.lr,
                           lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
                           # one pair per forward, as ours: 8 pairs in one padded batch of 16 sequences were
                           # killed for memory at 24 GiB (their logits alone are 16 x 700 x 49k floats)
                           per_device_train_batch_size=1, gradient_accumulation_steps=a.batch_size, num_train_epochs=1,
                           max_length=None, precompute_ref_log_probs=True, logging_steps=1, save_strategy="no",
                           bf16=False, gradient_checkpointing=False,  # TRL's defaults; ours: fp32, no checkpointing
                           report_to="none", use_cpu=True, seed=0, dataloader_num_workers=0)
    trainer = trl.DPOTrainer(model=model, args=config, train_dataset=Dataset.from_list(pairs), processing_class=tok,
                             callbacks=[StepTimer()])
    trainer.train()
    trl_rate = len(pairs) / StepTimer.seconds
    trl_first = next(x["loss"] for x in trainer.state.log_history if "loss" in x)
    print(f"TRL {trl.__version__} DPOTrainer: {trl_rate:.3f} pairs/s, first loss {trl_first:.6f}", flush=True)
    ref_trl = [(r["ref_chosen_logps"], r["ref_rejected_logps"]) for r in trainer.train_dataset]
    trl_prompts = [r["prompt"] for r in trainer.train_dataset]

# the reference log-probs: ours (common.shared_prompt_logprobs, the starting weights) vs TRL's, same pair
model = models.load_model(a.model, torch.device("cpu")).eval()
diff = 0.0
with torch.no_grad():
    for r, prompt, (c, rj) in zip(pairs, trl_prompts, ref_trl):
        assert prompt == r["prompt"]  # TRL kept the order of the pairs
        ids, conts = common.encode_shared(tok, "", prompt, [r["chosen"], r["rejected"]], 10 ** 9)
        sums, _ = common.shared_prompt_logprobs(model, ids, conts)
        diff = max(diff, abs(sums[0].item() - c), abs(sums[1].item() - rj))
print(f"reference log-probs, ours vs TRL: max |diff| {diff:.2e} (summed over a turn)")
print(json.dumps({"ours_pairs_per_s": round(ours["shared"][0], 4), "trl_pairs_per_s": round(trl_rate, 4),
                  "speedup": round(ours["shared"][0] / trl_rate, 3), "first_loss_ours": ours["shared"][1],
                  "first_loss_trl": trl_first, "ours_two_pass_pairs_per_s": round(ours["two_pass"][0], 4) if a.two_pass else None,
                  "ref_logp_max_abs_diff": diff, "num_pairs": len(pairs), "steps": steps}))
