"""Per-turn log-probs, the critic objective, turn labelling and DPO, checked against naive computations."""
import argparse
import json
import math
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

import colbench
import common
from machinery import models
import label_turns
import train_critic
import train_dpo
from machinery import training
from conftest import read_jsonl, run_script


def make_traj(tok, task, outputs, replies, reward, sample=0):
    """A trajectory in the released schema, with inputs rendered exactly as rollout.py renders them."""
    dialogue = [{"role": "user", "content": task["problem_description"]}]
    for out, reply in zip(outputs, replies + [None]):
        inp = models.render_prompt(tok, colbench.agent_messages(task, dialogue))
        dialogue.append({"role": "assistant", "content": out, "input": inp, "output": out})
        if reply is not None:
            dialogue.append({"role": "user", "content": reply})
    return {"task": task, "task_id": task["task_id"], "sample": sample, "dialogue_history": dialogue,
            "answer": outputs[-1], "reward": reward, "success": reward == 1.0}


TASK = {"task_id": "t0", "problem_description": "Write f. The signature of the function is: def f(x)",
        "hidden_information": "Double it.", "ground_truth": "def f(x):\n    return x * 2\n", "test_cases": {"a": "f(1)"}}


@pytest.fixture(scope="module")
def tok_model(tiny_model):
    tok = models.load_tokenizer(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation="eager").eval()
    return tok, model


def naive_turn_logprobs(model, tok, turns, prefix=""):
    """One forward per turn on (prefix + input + output + eos), full log-softmax."""
    sums = []
    for inp, out in turns:
        p = tok(prefix, add_special_tokens=False)["input_ids"] + tok(inp, add_special_tokens=False)["input_ids"]
        o = tok(out, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids = torch.tensor([p + o])
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
        sums.append(sum(logp[len(p) - 1 + j, t].item() for j, t in enumerate(o)))
    return sums


def test_one_forward_equals_per_turn_forwards(tok_model):
    tok, model = tok_model
    traj = make_traj(tok, TASK, ["What factor?", "Is it 2?", "I WANT TO ANSWER: def f(x): return 2*x"],
                     ["Double it.", "I don't know."], 1.0)
    turns = colbench.agent_turns(traj)
    prefix = train_critic.training_info(TASK)
    seqs = common.tokenize_turns(tok, turns, prefix)
    assert len(seqs) == 1  # prefix-consistent chat: the whole trajectory is one sequence
    ids, turn_of = seqs[0]
    assert all(t == -1 for t in turn_of[:len(tok(prefix, add_special_tokens=False)["input_ids"])])  # c never counts
    for t, (_, out) in enumerate(turns):  # exactly the output tokens + end-of-turn belong to turn t
        assert [i for i, k in zip(ids, turn_of) if k == t] == tok(out, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    with torch.no_grad():
        total, count = common.turn_logprobs(model, [(seqs, len(turns))])[0]
    assert total.tolist() == pytest.approx(naive_turn_logprobs(model, tok, turns, prefix), abs=1e-5)
    # a template that rewrites history falls back to one sequence per turn, same numbers
    broken = [(inp.replace("What factor?", "What factor??"), out) for inp, out in turns]
    seqs2 = common.tokenize_turns(tok, broken, prefix)
    assert len(seqs2) == 2
    with torch.no_grad():
        total2, _ = common.turn_logprobs(model, [(seqs2, len(turns))])[0]
    assert total2.tolist() == pytest.approx(naive_turn_logprobs(model, tok, broken, prefix), abs=1e-5)
    # a trajectory costs one forward whatever its sequences, and so does a pair (rows of unequal length, padded and
    # masked), with the same numbers and gradients
    counted = training.count_forwards(model)
    grads = []
    for together in (False, True):
        model.zero_grad()
        counted.forwards = 0
        parts = (common.turn_logprobs(model, [(seqs, len(turns)), (seqs2, len(turns))]) if together else
                 [common.turn_logprobs(model, [(s, len(turns))])[0] for s in (seqs, seqs2)])
        assert counted.forwards == (1 if together else 2) == (training.seq_forwards(seqs, seqs2) if together else 2)
        assert [t.tolist() for t, _ in parts] == [pytest.approx(naive_turn_logprobs(model, tok, x, prefix), abs=1e-5)
                                                 for x in (turns, broken)]
        (parts[0][0].sum() - 2 * parts[1][0].sum()).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert grads[0].abs().max() > 0 and torch.allclose(grads[0], grads[1], atol=1e-5)


def test_critic_score_and_loss_by_hand(tok_model):
    tok, model = tok_model
    chosen = make_traj(tok, TASK, ["Which factor?", "I WANT TO ANSWER: def f(x): return x*2"], ["Double it."], 1.0)
    rejected = make_traj(tok, TASK, ["I WANT TO ANSWER: def f(x): return x"], [], 0.0, sample=1)
    scores = {}
    for name, traj in (("c", chosen), ("r", rejected)):
        turns = colbench.agent_turns(traj)
        seqs = common.tokenize_turns(tok, turns, train_critic.training_info(TASK))
        with torch.no_grad():
            s, n = common.turn_logprobs(model, [(seqs, len(turns))])[0]
        ref = s - torch.tensor([0.3, 0.7][:len(turns)])  # a made-up pi_ref, 0.3 / 0.7 nats lower per turn
        for norm in ("turn", "trajectory"):
            scores[name, norm] = train_critic.trajectory_score(train_critic.turn_advantage(s, ref, n, 0.1), n, norm).item()
        # documented values: turn = beta * sum_t (delta_t / n_t); trajectory = beta * sum_t delta_t / sum_t n_t
        deltas = [0.3, 0.7][:len(turns)]
        assert scores[name, "turn"] == pytest.approx(0.1 * sum(d / k for d, k in zip(deltas, n.tolist())), abs=1e-6)
        assert scores[name, "trajectory"] == pytest.approx(0.1 * sum(deltas) / n.sum().item(), abs=1e-6)


def test_critic_loss_by_hand_and_what_the_ridge_identifies():
    """critic_loss from the per-turn advantages of a pair: equation 2 (both normalisations) and the ridge by hand; a
    constant added to both dialogues' answer turn (the last) moves no equation-2 loss, the ridge's loss moves."""
    chosen = (torch.tensor([0.2, -0.1]), torch.tensor([3, 5]))  # (A [n_turns], token count [n_turns])
    rejected = (torch.tensor([-0.3]), torch.tensor([4]))
    args = lambda norm="turn", ridge=0.0: argparse.Namespace(normalization=norm, ridge=ridge)
    bt = lambda margin: -math.log(1 / (1 + math.exp(-margin)))
    loss, margin = train_critic.critic_loss(chosen, rejected, args())
    assert margin.item() == pytest.approx(0.1 + 0.3) and loss.item() == pytest.approx(bt(0.4), rel=1e-6)
    loss, margin = train_critic.critic_loss(chosen, rejected, args("trajectory"))
    assert margin.item() == pytest.approx((0.6 - 0.5) / 8 + 0.3, rel=1e-6) and loss.item() == pytest.approx(bt(margin.item()))
    loss, _ = train_critic.critic_loss(chosen, rejected, args(ridge=10.0))
    assert loss.item() == pytest.approx(bt(0.4) + 10.0 * (0.04 + 0.01 + 0.09) / 3, rel=1e-6)
    shifted = lambda a, k: (a[0] + torch.nn.functional.one_hot(torch.tensor(len(a[0]) - 1), len(a[0])) * k, a[1])
    for term in ({}, {"ridge": 10.0}):
        before = train_critic.critic_loss(chosen, rejected, args(**term))[0].item()
        after = train_critic.critic_loss(shifted(chosen, 1.0), shifted(rejected, 1.0), args(**term))[0].item()
        assert (after == pytest.approx(before, abs=1e-6)) == (not term)


def test_only_agent_tokens_count(tok_model):
    """Changing what the user says, or c, changes the context, not which tokens are scored."""
    tok, model = tok_model
    a = make_traj(tok, TASK, ["Q1?", "I WANT TO ANSWER: x"], ["short"], 1.0)
    b = make_traj(tok, TASK, ["Q1?", "I WANT TO ANSWER: x"], ["a much longer reply from the user here"], 1.0)
    sa, sb, sc = (common.tokenize_turns(tok, colbench.agent_turns(t), p) for t, p in ((a, "prefix"), (b, "prefix"),
                                                                                     (a, "other c " * 20)))
    agent = lambda s: [i for i, k in zip(*s[0]) if k >= 0]
    assert agent(sa) == agent(sb) == agent(sc) and len(agent(sa)) > 0
    assert len(sc[0][0]) > len(sa[0][0])  # the longer c is context only


def test_label_turns_advantage_equals_critic_score(tok_model, tiny_model, tmp_path):
    """label_turns ranks a candidate turn by exactly train_critic's score of that turn as a one-turn
    trajectory (same c, same beta), for both normalisations; the critic differs from pi_ref here."""
    tok, ref = tok_model
    critic = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation="eager").eval()
    with torch.no_grad():
        for p in critic.parameters():
            p.add_(0.02 * torch.randn_like(p))
    prompt = models.render_prompt(tok, colbench.agent_messages(TASK, [{"role": "user", "content": TASK["problem_description"]}]))
    cands = ["What is the factor?", "I WANT TO ANSWER: def f(x): return x * 2", "ok"]
    prefix = train_critic.training_info(TASK)
    p_ids, c_ids = common.encode_shared(tok, prefix, prompt, cands, 4096)
    with torch.no_grad():
        crit_sum, count = common.shared_prompt_logprobs(critic, p_ids, c_ids)
        ref_sum, _ = common.shared_prompt_logprobs(ref, p_ids, c_ids)
        labelled = train_critic.turn_advantage(crit_sum, ref_sum, count, beta=0.3)
        for c, adv in zip(cands, labelled.tolist()):
            seqs = common.tokenize_turns(tok, [(prompt, c)], prefix)
            s, n = common.turn_logprobs(critic, [(seqs, 1)])[0]
            r, _ = common.turn_logprobs(ref, [(seqs, 1)])[0]
            for norm in ("turn", "trajectory"):
                assert adv == pytest.approx(train_critic.trajectory_score(train_critic.turn_advantage(s, r, n, 0.3), n,
                                                                          norm).item(), abs=1e-5)
    assert max(map(abs, labelled.tolist())) > 1e-3  # a real difference, not two zeros


def test_labelling_and_the_viewer_score_through_the_critic_block(tok_model, tiny_model):
    """train_critic.candidate_advantages (label_turns) and dialogue_advantages (view.py) give, for a one-turn
    dialogue, the score train_critic trains, on the c its run_settings name (the no-information ablation: none)."""
    tok, ref = tok_model
    critic = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation="eager").eval()
    with torch.no_grad():
        for p in critic.parameters():
            p.add_(0.02 * torch.randn_like(p))
    assert train_critic.training_info(TASK, True) == "" and TASK["ground_truth"] in train_critic.training_info(TASK)
    prompt = models.render_prompt(tok, colbench.agent_messages(TASK, [{"role": "user", "content": TASK["problem_description"]}]))
    cands = ["What is the factor?", "I WANT TO ANSWER: def f(x): return x * 2"]
    got = {}
    with torch.no_grad():
        for blind in (False, True):
            settings = {"beta": 0.3, "no_training_info": blind}
            got[blind] = train_critic.candidate_advantages(critic, ref, tok, settings, TASK, prompt, cands, 4096).tolist()
            for c, adv in zip(cands, got[blind]):
                traj = {"task": TASK, "dialogue_history": [{"role": "assistant", "content": c, "input": prompt, "output": c}]}
                seqs = common.tokenize_turns(tok, [(prompt, c)], train_critic.training_info(TASK, blind))
                (s, n), (r, _) = common.turn_logprobs(critic, [(seqs, 1)])[0], common.turn_logprobs(ref, [(seqs, 1)])[0]
                assert adv == pytest.approx(train_critic.turn_advantage(s, r, n, 0.3).sum().item(), abs=1e-5)
                assert adv == pytest.approx(train_critic.dialogue_advantages(critic, ref, tok, settings, traj, 4096).item(),
                                            abs=1e-5)
    assert max(abs(a - b) for a, b in zip(got[False], got[True])) > 1e-4  # c changes the advantage
    # --ranking released: the critic given c minus pi_ref (the sampler) given o alone, per-token means
    settings = {"beta": 0.3, "no_training_info": False, "ranking": "released"}
    with torch.no_grad():
        released = train_critic.candidate_advantages(critic, ref, tok, settings, TASK, prompt, cands, 4096).tolist()
        for c, adv, paper in zip(cands, released, got[False]):
            traj = {"task": TASK, "dialogue_history": [{"role": "assistant", "content": c, "input": prompt, "output": c}]}
            s, n = common.turn_logprobs(critic, [(common.tokenize_turns(tok, [(prompt, c)], train_critic.training_info(TASK)), 1)])[0]
            r, _ = common.turn_logprobs(ref, [(common.tokenize_turns(tok, [(prompt, c)], ""), 1)])[0]
            assert adv == pytest.approx(0.3 * (s - r).item() / n.item(), abs=1e-5)
            assert adv == pytest.approx(train_critic.dialogue_advantages(critic, ref, tok, settings, traj, 4096).item(),
                                        abs=1e-5)
            rc, _ = common.turn_logprobs(ref, [(common.tokenize_turns(tok, [(prompt, c)], train_critic.training_info(TASK)), 1)])[0]
            pmi = 0.3 * (rc - r).item() / n.item()  # pi_ref's pointwise mutual information of c and the turn, per token
            assert adv - paper == pytest.approx(pmi, abs=1e-5) and abs(pmi) > 1e-5


def test_prefix_reuse_scoring_equals_naive(tok_model):
    tok, model = tok_model
    prompt = models.render_prompt(tok, colbench.agent_messages(TASK, [{"role": "user", "content": TASK["problem_description"]}]))
    cands = ["What is the factor?", "I WANT TO ANSWER: def f(x): return x * 2", "?", "Tell me more about x please"]
    prefix = train_critic.training_info(TASK)
    p_ids, c_ids = common.encode_shared(tok, prefix, prompt, cands, 4096)
    with torch.no_grad():
        fast, counts = common.shared_prompt_logprobs(model, p_ids, c_ids)
        for c, f, k in zip(cands, fast, counts):
            s, n = common.turn_logprobs(model, [(common.tokenize_turns(tok, [(prompt, c)], prefix), 1)])[0]
            assert f.item() == pytest.approx(s.item(), abs=1e-4) and k.item() == n.item()
        # label_turns --max_batch_tokens: the same scores in batches of one or two rows
        for budget in (1, 2 * (len(p_ids) + max(map(len, c_ids)))):
            bounded, _ = common.shared_prompt_logprobs(model, p_ids, c_ids, max_tokens=budget)
            assert torch.allclose(bounded, fast, atol=1e-4)


def test_shared_prompt_dpo_gradients_equal_two_passes(tok_model):
    """The DPO loss of a pair, with the prompt run once (KV cache, gradients through it) and with
    prompt + turn run twice: loss and every parameter's gradient agree within 1e-4."""
    tok, model = tok_model
    prompt = models.render_prompt(tok, colbench.agent_messages(TASK, [{"role": "user", "content": TASK["problem_description"]}]))
    chosen, rejected = "What is the factor?", "I WANT TO ANSWER: def f(x): return x * 2"
    ref = torch.tensor([-30.0, -45.0])

    def loss_and_grads(logp_c, logp_r):
        loss = -torch.nn.functional.logsigmoid(0.1 * ((logp_c - ref[0]) - (logp_r - ref[1]))) + 0.01 * -logp_c
        model.zero_grad()
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}

    p_ids, conts = common.encode_shared(tok, "", prompt, [chosen, rejected], 4096)
    sums, _ = common.shared_prompt_logprobs(model, p_ids, conts)
    shared = loss_and_grads(sums[0], sums[1])
    (c, _), (r, _) = (common.turn_logprobs(model, [(common.tokenize_turns(tok, [(prompt, t)]), 1)])[0] for t in (chosen, rejected))
    twice = loss_and_grads(c.sum(), r.sum())
    assert shared[0] == pytest.approx(twice[0], abs=1e-4)
    assert max(g.abs().max().item() for g in twice[1].values()) > 1e-3  # real gradients, not all zero
    for name, g in twice[1].items():
        assert torch.allclose(shared[1][name], g, atol=1e-4, rtol=1e-4), name
    model.zero_grad()


def test_pairs_come_from_opposite_halves_largest_gaps_first():
    rng = random.Random(0)
    cands = [f"c{i}" for i in range(16)]
    adv = [rng.random() for _ in cands]
    order = sorted(range(16), key=lambda i: -adv[i])
    pairs = label_turns.make_pairs(cands, adv, 50, rng)
    assert len(pairs) == 50 and len(set(pairs)) == 50  # distinct pairs
    every = label_turns.make_pairs(cands, adv, 100, rng)
    assert len(every) == 64  # at most every better x worse pair
    for a, b in pairs:
        assert a in order[:8] and b in order[8:] and adv[a] > adv[b]
    gaps = [adv[a] - adv[b] for a, b in every]
    assert gaps == sorted(gaps, reverse=True)  # the critic's surest preferences first
    assert label_turns.make_pairs(cands, adv, 1, rng) == [(order[0], order[-1])]
    left_out = min(adv[a] - adv[b] for a, b in pairs)
    assert all(adv[a] - adv[b] <= left_out for a, b in every if (a, b) not in pairs)
    assert label_turns.make_pairs(["same"] * 4, [1, 2, 3, 4], 4, rng) == []  # identical candidates never pair
    # a candidate the token cap cut off is never chosen over one that ended; over another cut one it may be
    cut = [i in order[:2] or i == order[-1] for i in range(16)]  # the two best and the worst were cut off
    kept = label_turns.make_pairs(cands, adv, 100, rng, cut=cut)
    assert kept and all(not cut[a] or cut[b] for a, b in kept)
    assert {a for a, _ in kept if cut[a]} == set(order[:2]) and all(b == order[-1] for a, b in kept if cut[a])
    assert len(kept) == 64 - 2 * 7  # the two best lose their pairs with the 7 worse that ended


def test_dpo_loss_and_metrics_match_reference():
    logp_c, logp_r = torch.tensor([-5.0, -3.0]), torch.tensor([-6.0, -2.0])
    ref_c, ref_r = torch.tensor([-5.5, -3.0]), torch.tensor([-5.0, -2.5])
    loss, r_c, r_r = train_dpo.dpo_loss(logp_c, logp_r, ref_c, ref_r, beta=0.1)
    expect = [-math.log(1 / (1 + math.exp(-0.1 * ((a - b) - (c - d))))) for a, b, c, d in zip(logp_c, logp_r, ref_c, ref_r)]
    assert loss.tolist() == pytest.approx(expect, rel=1e-6)
    assert r_c.tolist() == pytest.approx([0.05, 0.0]) and r_r.tolist() == pytest.approx([-0.1, 0.05])


def write_graded(tok, path, n_tasks=6, sep=" "):
    """Per task a question then an answer (reward 1) against another answer (reward 0); sep "\n": answers of two lines."""
    rows = []
    for k in range(n_tasks):
        task = dict(TASK, task_id=f"t{k}")
        rows.append(make_traj(tok, task, ["What is the factor?", f"I WANT TO ANSWER:{sep}yes yes"], ["Double it."], 1.0, 0))
        rows.append(make_traj(tok, task, [f"I WANT TO ANSWER:{sep}no no no"], [], 0.0, 1))
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def test_critic_learns_a_separable_toy_set(tiny_model, tmp_path):
    tok = models.load_tokenizer(tiny_model)
    write_graded(tok, tmp_path / "g.jsonl")
    run_script("train_critic.py", "--trajectories", tmp_path / "g.jsonl", "--model", tiny_model, "--output_dir",
               tmp_path / "critic", "--lr", "3e-3", "--epochs", "6", "--batch_size", "4", "--heldout_fraction", "0.2",
               "--train_metrics")
    log = read_jsonl(tmp_path / "critic" / "log.jsonl")
    final = json.loads((tmp_path / "critic" / "final_metrics.json").read_text())
    assert log[0]["loss"] == pytest.approx(math.log(2), abs=1e-4)  # critic == pi_ref at step 1: every score is 0
    assert final["train_acc"] == 1.0 and final["train_loss"] < log[0]["loss"]
    assert "heldout_acc" in final
    settings = json.loads((tmp_path / "critic" / "run_settings.json").read_text())
    assert settings["model"] == tiny_model and "git_commit" in settings
    AutoModelForCausalLM.from_pretrained(tmp_path / "critic")  # a plain HF checkpoint
    # activation checkpointing gives the same first step
    run_script("train_critic.py", "--trajectories", tmp_path / "g.jsonl", "--model", tiny_model, "--output_dir",
               tmp_path / "critic_ckpt", "--lr", "3e-3", "--epochs", "1", "--batch_size", "4", "--heldout_fraction", "0.2",
               "--grad_ckpt")
    ckpt_log = read_jsonl(tmp_path / "critic_ckpt" / "log.jsonl")
    assert ckpt_log[0]["loss"] == pytest.approx(log[0]["loss"], abs=1e-6)
    assert ckpt_log[0]["grad_norm"] == pytest.approx(log[0]["grad_norm"], rel=1e-4)
    # only the top layer trains, with the ridge: a run that still learns
    run_script("train_critic.py", "--trajectories", tmp_path / "g.jsonl", "--model", tiny_model, "--output_dir",
               tmp_path / "top", "--lr", "3e-3", "--epochs", "3", "--batch_size", "4", "--heldout_fraction", "0.2",
               "--train_layers", "1", "--ridge", "1")
    top = read_jsonl(tmp_path / "top" / "log.jsonl")
    assert top[-1]["loss"] < top[0]["loss"]


def test_label_turns_then_dpo_modes(tiny_model, tmp_path):
    tok = models.load_tokenizer(tiny_model)
    write_graded(tok, tmp_path / "g.jsonl", n_tasks=3)
    run_script("train_critic.py", "--trajectories", tmp_path / "g.jsonl", "--model", tiny_model, "--output_dir",
               tmp_path / "critic", "--lr", "1e-3", "--epochs", "1", "--train_layers", "1")
    args = ["--trajectories", tmp_path / "g.jsonl", "--critic", tmp_path / "critic", "--output", tmp_path / "pairs.jsonl",
            "--num_candidates", "4", "--pairs_per_state", "2", "--max_new_tokens", "8", "--data_fraction", "0.5",
            "--state_batch", "2"]  # 3 trajectories: sampled in batches of 2 states, then 1
    run_script("label_turns.py", *args)
    pairs = read_jsonl(tmp_path / "pairs.jsonl")
    states = read_jsonl(f"{tmp_path / 'pairs.jsonl'}.states.jsonl")
    assert max(abs(x) for s in states for x in s["advantages"]) > 1e-4  # advantages of a critic that moved
    assert len(states) >= 3 and all(len(s["candidates"]) == 4 for s in states)
    assert all(s["cut"] == [True] * 4 for s in states)  # the tiny model never ends a turn: 8 tokens cut every one
    for p in pairs:
        assert set(p) >= {"prompt", "chosen", "rejected", "chosen_advantage", "rejected_advantage", "task_id", "turn"}
        assert p["chosen_advantage"] > p["rejected_advantage"]
        assert TASK["ground_truth"] not in p["prompt"]  # the policy's prompt never holds c
    assert pairs  # (a rerun after SIGKILL: test_faults.py)  # random candidates of 8 tokens differ, and so do their advantages
    run_script("train_dpo.py", "--pairs", tmp_path / "pairs.jsonl", "--model", tiny_model, "--output_dir",
               tmp_path / "sweet", "--lr", "1e-3")
    log = read_jsonl(tmp_path / "sweet" / "log.jsonl")
    run_script("train_dpo.py", "--pairs", tmp_path / "pairs.jsonl", "--model", tiny_model, "--output_dir",
               tmp_path / "sweet_unshared", "--lr", "1e-3", "--grad_ckpt")
    unshared = read_jsonl(tmp_path / "sweet_unshared" / "log.jsonl")  # the plain path, prompt + turn twice: the same run
    assert len(unshared) == len(log) >= 1
    for a, b in zip(log, unshared):
        for k in ("loss", "grad_norm", "rewards/margins", "nll"):
            assert a[k] == pytest.approx(b[k], abs=1e-4), (k, a[k], b[k])
    assert {"rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "nll"} <= set(log[0])
    assert log[0]["rewards/margins"] == pytest.approx(0, abs=1e-5)  # policy == pi_ref before the first step
    for mode in ("trajectory",):  # (sft with snapshots: run.sh's rejection fine-tuning, tests/test_run_sh.py)
        run_script("train_dpo.py", "--mode", mode, "--trajectories", tmp_path / "g.jsonl", "--model", tiny_model,
                   "--output_dir", tmp_path / mode, "--lr", "1e-3", "--epochs", "2", "--batch_size", "2", "--snapshots", "1")
        log = read_jsonl(tmp_path / mode / "log.jsonl")
        assert len(log) == 4 and log[-1]["loss"] < log[0]["loss"]
        assert [r["lr"] for r in log] == pytest.approx([1e-3 * training.lr_factor(k, 4, "released") for k in range(1, 5)])
        # --snapshots 1: the policy after step 2 of 4, a third point between pi_ref and the end
        weights = [dict(AutoModelForCausalLM.from_pretrained(d).named_parameters())
                   for d in (tiny_model, tmp_path / mode / "step-2", tmp_path / mode)]
        assert sorted(p.name for p in (tmp_path / mode).glob("step-*")) == ["step-2"]
        moved = lambda a, b: max((a[k] - b[k]).abs().max().item() for k in a)
        assert moved(weights[0], weights[1]) > 0 and moved(weights[1], weights[2]) > 0
    assert train_dpo.snapshot_schedule(53, 2) == [18, 35] and train_dpo.snapshot_schedule(1, 2) == []
    # --epochs 0.67 (run.sh html): the first 23 of a pass's 34 steps, in the whole pass's order
    whole, part = training.batch_order(270, 8, 1, 0), training.batch_order(270, 8, 0.67, 0)
    assert len(whole) == 34 and part == whole[:23] and train_dpo.snapshot_schedule(len(part), 1) == [12]
    assert len(training.batch_order(270, 8, 1.5, 0)) == 51 and len(training.batch_order(3, 8, 0.1, 0)) == 1
    # --steps (run.sh: every method SWEET-RL's steps): past a pass the data repeats, each pass a permutation
    more = training.batch_order(20, 8, 1, 0, steps=7)
    assert len(more) == 7 and more[:3] == training.batch_order(20, 8, 1, 0) and [e for e, _ in more] == [0] * 3 + [1] * 3 + [2]
    assert all(sorted(i for e, b in more if e == p for i in b) == list(range(20)) for p in (0, 1))


def test_nll_term_is_mean_chosen_nll(tok_model, tiny_model, tmp_path):
    """train_dpo's logged nll at step 1 (weights still pi_ref) is the mean per-token NLL of the chosen
    turns, computed here by hand with one forward per turn."""
    tok, model = tok_model
    traj = make_traj(tok, TASK, ["Which factor?", "I WANT TO ANSWER: def f(x): return x*2"], ["Double it."], 1.0)
    (tmp_path / "g.jsonl").write_text(json.dumps(traj) + "\n")
    run_script("train_dpo.py", "--mode", "sft", "--trajectories", tmp_path / "g.jsonl", "--model", tiny_model,
               "--output_dir", tmp_path / "sft", "--lr", "1e-3", "--batch_size", "1")
    turns = colbench.agent_turns(traj)
    n_tokens = sum(len(tok(out, add_special_tokens=False)["input_ids"]) + 1 for _, out in turns)  # + end-of-turn
    with torch.no_grad():
        manual = -sum(naive_turn_logprobs(model, tok, turns)) / n_tokens
    log = read_jsonl(tmp_path / "sft" / "log.jsonl")
    assert log[0]["nll"] == pytest.approx(manual, rel=1e-4) and log[0]["loss"] == pytest.approx(manual, rel=1e-4)


def test_truncation_keeps_training_information(tok_model):
    """A trajectory longer than max_len loses its earliest dialogue tokens, never c (the critic's view)."""
    tok, _ = tok_model
    long_traj = make_traj(tok, TASK, ["What factor? " * 30, "I WANT TO ANSWER: def f(x): return x * 2"], ["Double it. " * 30], 1.0)
    prefix = train_critic.training_info(TASK)
    n_pre = len(tok(prefix, add_special_tokens=False)["input_ids"])
    full = common.tokenize_turns(tok, colbench.agent_turns(long_traj), prefix)[0][0]
    ids, turn_of = common.tokenize_turns(tok, colbench.agent_turns(long_traj), prefix, max_len=n_pre + 40)[0]
    assert len(ids) == n_pre + 40 and ids[:n_pre] == full[:n_pre] and ids[n_pre:] == full[-40:]
    assert turn_of[:n_pre] == [-1] * n_pre and turn_of[-1] == 1  # c never counts; the last turn survives
    cands = ["I WANT TO ANSWER: x"]
    prompt = long_traj["dialogue_history"][-1]["input"]
    p_ids, c_ids = common.encode_shared(tok, prefix, prompt, cands, n_pre + 30)
    assert p_ids[:n_pre] == full[:n_pre] and len(p_ids) + len(c_ids[0]) <= n_pre + 30


def test_training_state_survives_a_kill_between_renames(tmp_path):
    """A kill after the new state was renamed in but before resume.old was removed leaves both; the
    next save must still succeed (this once crashed a resumed two-process run)."""
    import shutil
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    order = {"batch_size": 2, "seed": 0, "epochs": 1}
    training.save_training_state(model, opt, tmp_path / "resume", 1, order, 0)
    shutil.copytree(tmp_path / "resume", tmp_path / "resume.old")
    training.save_training_state(model, opt, tmp_path / "resume", 2, order, 0)
    assert not (tmp_path / "resume.old").exists()
    assert training.load_training_state(model, opt, tmp_path / "resume", order) == 2


def test_saves_come_by_elapsed_time_in_the_background(tmp_path):
    """--save_minutes: no save before the time is up, nor after the last step; a due save is written while the
    next step changes the weights, holds the weights of its own step, and is renamed in by the next save or the end."""
    model = torch.nn.Linear(200, 200)
    opt = torch.optim.AdamW(model.parameters())
    order = {"batch_size": 2, "seed": 0, "epochs": 1}
    never = training.Checkpointer(tmp_path / "never" / "resume", float("inf"), order, 0)
    (tmp_path / "never").mkdir()
    never.after_step(model, opt, 1, False)
    never.finish()
    saves = training.Checkpointer(tmp_path / "resume", 0.01, order, 0)  # due 0.6 s after the start
    saves.after_step(model, opt, 1, False)
    assert saves.pending is None and not (tmp_path / "never" / "resume").exists()
    saves.last -= 1.0  # the time is up
    saves.after_step(model, opt, 2, False)
    saved = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)  # step 3, while the state of step 2 is written
    assert saves.pending is not None and not (tmp_path / "resume").exists()  # renamed in once complete
    saves.last -= 1.0
    saves.after_step(model, opt, 3, True)  # the last step: the final checkpoint follows, no resume state
    saves.finish()
    loaded = torch.nn.Linear(200, 200)
    assert training.load_training_state(loaded, torch.optim.AdamW(loaded.parameters()), tmp_path / "resume", order) == 2
    assert torch.equal(loaded.weight, saved) and not torch.equal(saved, model.weight)


def test_released_schedule_and_betas(tiny_model):
    """--schedule released: a linear warm-up over 3% of the steps, then a cosine to 0.1x at the last step, with
    AdamW betas (0.9, 0.95); constant: --lr throughout with AdamW's default betas."""
    f = [training.lr_factor(k, 200, "released") for k in range(1, 201)]
    assert f[:6] == pytest.approx([1 / 6, 2 / 6, 3 / 6, 4 / 6, 5 / 6, 1.0]) and f[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(f[5:], f[6:])) and f[102] == pytest.approx(0.55, abs=0.01)
    assert {training.lr_factor(k, 200, "constant") for k in range(1, 201)} == {1.0}
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert training.make_optimizer(model, 1e-3, "released").param_groups[0]["betas"] == (0.9, 0.95)
    assert training.make_optimizer(model, 1e-3, "constant").param_groups[0]["betas"] == (0.9, 0.999)


def test_vllm_share_of_the_gpu_leaves_room_for_the_scoring_models():
    """label_turns with vLLM: the critics, pi_ref and their scoring batches are counted from the config, and vLLM
    gets the rest. Llama-3.1-8B's shape (built on the meta device, no weights): on an 80 GiB GPU the SWEET critic
    and pi_ref leave vLLM its weights and KV cache; a third model still fits at 16k tokens; a 24 GiB GPU is refused."""
    from transformers import LlamaConfig
    llama8b = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                          num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False)
    gib = 2**30
    two = label_turns.gpu_share(80 * gib, llama8b, 2, 65536, 16384)
    three = label_turns.gpu_share(80 * gib, llama8b, 3, 65536, 16384)
    weights = 8.03e9 * 2  # bf16
    assert 0.3 < two < 0.5 and 80 * gib * two > weights + 16 * gib  # the policy and 16 GiB of KV cache
    assert three < two and 80 * gib * three > weights + 16384 * 128 * 1024  # and one 16k-token sequence
    assert (1 - two) * 80 * gib > 2 * weights + 65536 * 128 * 1024  # what scoring holds: two models and their cache
    assert label_turns.gpu_share(80 * gib, llama8b, 2, 16384, 16384) > two  # a smaller scoring batch leaves more
    with pytest.raises(SystemExit, match="leaves vLLM .* lower --max_batch_tokens"):
        label_turns.gpu_share(24 * gib, llama8b, 2, 65536, 16384)
    tiny = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2)
    assert label_turns.gpu_share(80 * gib, tiny, 3, 65536, 16384) == 0.9  # a small model: vLLM's usual cap


def test_a_training_step_syncs_the_host_once(tiny_model, tmp_path, monkeypatch):
    """Metrics stay tensors on the device through a step and reach the host in one transfer (training.step_sums):
    the project's own reads of a tensor's value (.item, .tolist, float, int, bool) grow by one per extra step."""
    import inspect
    import pathlib
    tok = models.load_tokenizer(tiny_model)
    write_graded(tok, tmp_path / "g.jsonl", n_tasks=8)
    ours = {str(pathlib.Path(m.__file__).resolve()) for m in (common, models, train_critic, train_dpo, training)}
    reads = []
    for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
        real = getattr(torch.Tensor, name)

        def counted(t, *a, _real=real, _name=name, **k):
            caller = inspect.currentframe().f_back
            if caller.f_code.co_filename in ours:
                reads.append(f"{_name} {pathlib.Path(caller.f_code.co_filename).name}:{caller.f_lineno}")
            return _real(t, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, counted)

    def syncs(main, args, epochs):
        reads.clear()
        main(args(epochs))
        return len(reads)
    critic = lambda e: train_critic.Args(trajectories=str(tmp_path / "g.jsonl"), output_dir=str(tmp_path / f"c{e}"),
                                         model=tiny_model, lr=1e-3, epochs=e, batch_size=2, heldout_fraction=0.0)
    dpo = lambda e: train_dpo.Args(mode="trajectory", trajectories=str(tmp_path / "g.jsonl"),
                                   output_dir=str(tmp_path / f"d{e}"), model=tiny_model, lr=1e-3, epochs=e, batch_size=2)
    for main, args in ((train_critic.main, critic), (train_dpo.main, dpo)):
        one = syncs(main, args, 1)
        three = syncs(main, args, 3)
        steps = len(read_jsonl(tmp_path / args(3).output_dir / "log.jsonl")) - len(read_jsonl(tmp_path / args(1).output_dir / "log.jsonl"))
        assert steps == 8 and three - one == steps, reads  # 4 steps an epoch


def test_activations_are_recomputed_only_where_memory_needs_it(tiny_model):
    """Llama-3.1-8B's and Llama-3.2-1B's shapes (configs only): at 8B a whole model's fp32 weights and AdamW state
    (16 bytes a parameter, 128 GB) exceed one 80 GiB GPU, so checkpointing is on whatever the tokens; sharded over
    8 GPUs a 2k-token pair fits and a 16k-token one does not; a 1B model fits even at 16k tokens on one GPU. On the
    CPU the stage decides nothing: --grad_ckpt as given."""
    from transformers import LlamaConfig
    gib = 2 ** 30
    llama8b = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                          num_key_value_heads=8, vocab_size=128256)
    llama1b = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                          num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True)
    need = lambda config, tokens, world, layers=0: training.needs_recompute(config, tokens, world, 80 * gib, layers)[0]
    assert need(llama8b, 1, world=1)
    assert not need(llama8b, 2048, world=8) and need(llama8b, 16384, world=8)
    assert not need(llama1b, 16384, world=1)
    room = lambda layers: training.needs_recompute(llama8b, 1, 1, 80 * gib, layers)[1]
    assert room(4) > room(16) > room(0)  # frozen layers hold no gradients or moments
    for forced in (False, True):
        assert training.recompute(tiny_model, forced, 10 ** 9, 1, torch.device("cpu")) is forced


def test_lockstep_plan_pads_every_rank_to_the_most_forwards(tiny_model):
    """Each micro-batch runs, on every rank, the most forwards any rank's example needs (at least one; a rank
    with no example left runs one); a loss that runs more than its plan says is stopped with the reason."""
    shares, plan = training.lockstep_plan([0, 1, 2, 3, 4], 2, lambda i: [3, 1, 0, 2, 5][i])
    assert shares == [[0, 2, 4], [1, 3]] and plan == [3, 2, 5]
    model = training.count_forwards(AutoModelForCausalLM.from_pretrained(tiny_model))
    ids = torch.tensor([[1, 2, 3]])
    model(input_ids=ids)
    pad = training.pad_forwards(model, 3, world=2)  # two zero-weight forwards join the one run
    assert model.forwards == 3 and pad.requires_grad and pad.item() == 0.0
    assert training.pad_forwards(model, 3, world=1) is None  # one process: nothing to wait for
    model(input_ids=ids)
    with pytest.raises(RuntimeError, match="4 forwards where the lock-step plan had 3"):
        training.pad_forwards(model, 3, world=2)


def test_reference_logprobs_are_read_back_not_recomputed(tiny_model, tmp_path):
    """pi_ref's log-probs are kept in OUTPUT_DIR/ref_logprobs, keyed by content, as they are computed: a rerun or a
    resume reads them back instead of running pi_ref over every pair again. Shown by rewriting the kept values:
    the rerun's first step trains against the rewritten ones."""
    tok = models.load_tokenizer(tiny_model)
    rows = write_graded(tok, tmp_path / "g.jsonl", n_tasks=3)  # 3 pairs, 6 trajectories: 2 contents
    for r in rows[2:4]:  # task 1's pair: a content of its own
        r["dialogue_history"][-1]["output"] += " again"
    (tmp_path / "g.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    dpo = ["--mode", "trajectory", "--trajectories", tmp_path / "g.jsonl", "--model", tiny_model, "--output_dir",
           tmp_path / "dpo", "--lr", "1e-3", "--batch_size", "3", "--beta", "0.1"]
    run_script("train_dpo.py", *dpo)
    first = read_jsonl(tmp_path / "dpo" / "log.jsonl")
    kept = tmp_path / "dpo" / "ref_logprobs" / "rank0.jsonl"
    rows = read_jsonl(kept)
    assert len(rows) == 2 and len({r["key"] for r in rows}) == 2  # tasks 0 and 2 share one pair: scored once
    kept.write_text("".join(json.dumps({"key": r["key"], "value": [r["value"][0] - 10.0, r["value"][1]]}) + "\n"
                            for r in rows))  # pi_ref's chosen log-probs, 10 nats lower
    again = run_script("train_dpo.py", *dpo)
    assert "reference log-probs: 3 of 3 read from" in again.stdout and "0 to compute" in again.stdout
    second = read_jsonl(tmp_path / "dpo" / "log.jsonl")
    assert second[0]["rewards/chosen"] == pytest.approx(first[0]["rewards/chosen"] + 0.1 * 10.0, abs=1e-5)
    assert second[0]["rewards/rejected"] == pytest.approx(first[0]["rewards/rejected"], abs=1e-6)
    critic = ["--trajectories", tmp_path / "g.jsonl", "--model", tiny_model, "--output_dir", tmp_path / "critic",
              "--lr", "1e-3", "--epochs", "1", "--heldout_fraction", "0"]
    assert "0 of 6 read" in run_script("train_critic.py", *critic).stdout
    assert len(read_jsonl(tmp_path / "critic" / "ref_logprobs" / "rank0.jsonl")) == 4
    assert "6 of 6 read" in run_script("train_critic.py", *critic).stdout


def test_a_template_that_trims_content_keeps_one_row(tok_model):
    """Llama-3.1's chat template trims every message's content, so a stored output with white space at its ends
    appears trimmed in the next input. The trajectory is still one row (not one a turn, each padded to the
    longest): each turn is scored as the next input shows it, the last as stored, and the log-probs equal one
    forward per turn on those texts. A template that drops earlier turns falls back to a row a turn, counted."""
    import copy
    tok, model = tok_model
    trimming = copy.deepcopy(tok)
    trimming.chat_template = trimming.chat_template.replace("{{ m['content'] }}", "{{ m['content'] | trim }}")
    outputs = [" What factor?\n", "Is it 2? ", "  I WANT TO ANSWER: def f(x): return 2*x\n"]
    traj = make_traj(trimming, TASK, outputs, ["Double it.", "I don't know."], 1.0)
    turns = colbench.agent_turns(traj)
    assert "<|im_start|>assistant\nWhat factor?<|im_end|>" in turns[1][0]  # trimmed where it is shown again
    seqs = common.tokenize_turns(trimming, turns, "c: ")
    assert len(seqs) == 1 and common.extra_rows([seqs]) == (0, 0)
    shown = [(turns[0][0], outputs[0].strip()), (turns[1][0], outputs[1].strip()), turns[2]]
    got, _ = common.turn_logprobs(model, [(seqs, 3)])[0]
    assert got.tolist() == pytest.approx(naive_turn_logprobs(model, trimming, shown, "c: "), abs=1e-4)
    forgetful = copy.deepcopy(tok)  # shows only the last user message: history rewritten
    forgetful.chat_template = ("{% for m in messages[-1:] %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                               "{% endfor %}<|im_start|>assistant\n")
    turns = colbench.agent_turns(make_traj(forgetful, TASK, outputs, ["Double it.", "I don't know."], 1.0))
    seqs = common.tokenize_turns(forgetful, turns)
    assert len(seqs) == 3 and common.extra_rows([seqs, seqs]) == (2, 4)
