"""Per-turn log-probs, the critic objective, turn labelling and DPO, checked against naive computations."""
import json
import math
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

import colbench
import common
import models
import label_turns
import train_critic
import train_dpo
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
        total, count = common.turn_logprobs(model, seqs, len(turns))
    assert total.tolist() == pytest.approx(naive_turn_logprobs(model, tok, turns, prefix), abs=1e-5)
    # a template that rewrites history falls back to one sequence per turn, same numbers
    broken = [(inp.replace("What factor?", "What factor??"), out) for inp, out in turns]
    seqs2 = common.tokenize_turns(tok, broken, prefix)
    assert len(seqs2) == 2
    with torch.no_grad():
        total2, _ = common.turn_logprobs(model, seqs2, len(turns))
    assert total2.tolist() == pytest.approx(naive_turn_logprobs(model, tok, broken, prefix), abs=1e-5)


def test_critic_score_and_loss_by_hand(tok_model):
    tok, model = tok_model
    chosen = make_traj(tok, TASK, ["Which factor?", "I WANT TO ANSWER: def f(x): return x*2"], ["Double it."], 1.0)
    rejected = make_traj(tok, TASK, ["I WANT TO ANSWER: def f(x): return x"], [], 0.0, sample=1)
    scores = {}
    for name, traj in (("c", chosen), ("r", rejected)):
        turns = colbench.agent_turns(traj)
        seqs = common.tokenize_turns(tok, turns, train_critic.training_info(TASK))
        with torch.no_grad():
            s, n = common.turn_logprobs(model, seqs, len(turns))
        ref = s - torch.tensor([0.3, 0.7][:len(turns)])  # a made-up pi_ref, 0.3 / 0.7 nats lower per turn
        for norm in ("turn", "trajectory"):
            scores[name, norm] = train_critic.trajectory_score(s, ref, n, 0.1, norm).item()
        # documented values: turn = beta * sum_t (delta_t / n_t); trajectory = beta * sum_t delta_t / sum_t n_t
        deltas = [0.3, 0.7][:len(turns)]
        assert scores[name, "turn"] == pytest.approx(0.1 * sum(d / k for d, k in zip(deltas, n.tolist())), abs=1e-6)
        assert scores[name, "trajectory"] == pytest.approx(0.1 * sum(deltas) / n.sum().item(), abs=1e-6)
    loss = train_critic.critic_loss(torch.tensor(scores["c", "turn"]), torch.tensor(scores["r", "turn"])).item()
    assert loss == pytest.approx(-math.log(1 / (1 + math.exp(-(scores["c", "turn"] - scores["r", "turn"])))), rel=1e-6)


def test_decision_terms_by_hand(tok_model, tiny_model):
    """--decision_terms: a trajectory scores beta * sum_t [mean log-ratio of turn t's first line + mean of its rest]
    (per-token log-probs of one naive forward each), and the first-line term of a one-turn trajectory is what
    labelling ranks a candidate by (label_turns --cross_kind decision: shared_prompt_logprobs' heads)."""
    tok, ref = tok_model
    critic = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation="eager").eval()
    with torch.no_grad():
        for p in critic.parameters():
            p.add_(0.02 * torch.randn_like(p))
    answer = "I WANT TO ANSWER:\ndef f(x):\n    return x * 2"
    traj = make_traj(tok, TASK, ["Which factor?", answer], ["Double it."], 1.0)
    turns, prefix = colbench.agent_turns(traj), train_critic.training_info(TASK)
    seqs, terms = train_critic.decision_terms(tok, turns, common.tokenize_turns(tok, turns, prefix))
    assert terms == 4 and len(seqs) == 1
    ids, turn_of = seqs[0]
    text = lambda k: tok.decode([i for i, b in zip(ids, turn_of) if b == k])
    assert text(0) == "" and text(2) == "Which factor?" + tok.eos_token  # a one-line turn is all decision
    assert text(3) == "I WANT TO ANSWER:" and text(1) == answer[len("I WANT TO ANSWER:"):] + tok.eos_token
    plain = common.tokenize_turns(tok, turns, prefix)[0]
    assert [k % 2 if k >= 0 else k for k in turn_of] == plain[1] and ids == plain[0]  # nothing else moved: c stays -1
    assert set(turn_of) == {-1, 1, 2, 3}  # turn 0's rest is empty; the other three terms hold tokens

    def per_token(model):  # one forward, full log-softmax: log p of each token given all before it
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)
        return [None] + [logp[i - 1, ids[i]].item() for i in range(1, len(ids))]
    lc, lr = per_token(critic), per_token(ref)
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0
    by_hand = 0.3 * sum(mean([lc[i] - lr[i] for i, b in enumerate(turn_of) if b == k]) for k in range(4))
    with torch.no_grad():
        (s, n), (r, _) = (common.turn_logprobs(m, seqs, terms) for m in (critic, ref))
    assert train_critic.trajectory_score(s, r, n, 0.3).item() == pytest.approx(by_hand, abs=1e-5)
    count = lambda x: len(tok(x, add_special_tokens=False)["input_ids"])
    assert n.tolist() == [0, count(answer) + 1 - count("I WANT TO ANSWER:"), count("Which factor?") + 1,
                          count("I WANT TO ANSWER:")]
    assert abs(by_hand) > 1e-4  # a real difference, not zeros

    prompt = models.render_prompt(tok, colbench.agent_messages(TASK, [{"role": "user", "content": TASK["problem_description"]}]))
    p_ids, c_ids = common.encode_shared(tok, prefix, prompt, [answer], 4096)
    heads = [common.first_line_tokens(tok, answer, len(c_ids[0]))]
    one, m = train_critic.decision_terms(tok, [(prompt, answer)], common.tokenize_turns(tok, [(prompt, answer)], prefix))
    with torch.no_grad():
        (_, _, ch), (_, _, rh) = (common.shared_prompt_logprobs(x, p_ids, c_ids, heads=heads) for x in (critic, ref))
        (ts, tn), (tr, _) = (common.turn_logprobs(x, one, m) for x in (critic, ref))
    labelled = train_critic.turn_advantage(ch, rh, torch.tensor(heads, dtype=ch.dtype), 0.3)
    assert labelled.item() == pytest.approx(train_critic.turn_advantage(ts, tr, tn, 0.3)[1].item(), abs=1e-5)
    # a turn whose start max_len cut off stays one term (its first line is not there to split)
    cut = common.tokenize_turns(tok, turns, prefix, max_len=len(tok(prefix, add_special_tokens=False)["input_ids"]) + 5)
    assert train_critic.decision_terms(tok, turns, cut)[0][0][1] == cut[0][1]


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
            s, n = common.turn_logprobs(critic, seqs, 1)
            r, _ = common.turn_logprobs(ref, seqs, 1)
            for norm in ("turn", "trajectory"):
                assert adv == pytest.approx(train_critic.trajectory_score(s, r, n, 0.3, norm).item(), abs=1e-5)
    assert max(map(abs, labelled.tolist())) > 1e-3  # a real difference, not two zeros


def test_label_turns_reads_c_as_its_critic_was_trained(tok_model, tiny_model):
    """train_critic --training_info facts puts the human's hidden lines before the reference in c; label_turns
    scores a critic's candidates on the c its run_settings name, and the two c give other advantages."""
    tok, ref = tok_model
    critic = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation="eager").eval()
    with torch.no_grad():
        for p in critic.parameters():
            p.add_(0.02 * torch.randn_like(p))
    task = dict(TASK, hidden_information="Double it.\nNegative inputs stay negative.")
    facts = train_critic.training_info(task, kind="facts")
    assert facts.endswith(train_critic.training_info(task)) and facts.index("Negative inputs") < facts.index("Reference")
    assert train_critic.training_info(task, True, "facts") == "" and "Double" not in train_critic.training_info(task)
    prompt = models.render_prompt(tok, colbench.agent_messages(task, [{"role": "user", "content": task["problem_description"]}]))
    cands = ["What is the factor?", "I WANT TO ANSWER: def f(x): return x * 2"]
    got = {}
    for kind in ("reference", "facts"):
        scorer = label_turns.Scorer(tok, {"c": critic}, {"c": {"beta": 0.3, "training_info": kind}}, ref, 4096, 10)
        got[kind] = scorer.advantages(task, prompt, cands)["c"]
        p_ids, c_ids = common.encode_shared(tok, train_critic.training_info(task, kind=kind), prompt, cands, 4096)
        with torch.no_grad():
            crit_sum, count = common.shared_prompt_logprobs(critic, p_ids, c_ids)
            ref_sum, _ = common.shared_prompt_logprobs(ref, p_ids, c_ids)
        assert got[kind] == pytest.approx(train_critic.turn_advantage(crit_sum, ref_sum, count, 0.3).tolist(), abs=1e-5)
    assert max(abs(a - b) for a, b in zip(got["reference"], got["facts"])) > 1e-4


def test_prefix_reuse_scoring_equals_naive(tok_model):
    tok, model = tok_model
    prompt = models.render_prompt(tok, colbench.agent_messages(TASK, [{"role": "user", "content": TASK["problem_description"]}]))
    cands = ["What is the factor?", "I WANT TO ANSWER: def f(x): return x * 2", "?", "Tell me more about x please"]
    prefix = train_critic.training_info(TASK)
    p_ids, c_ids = common.encode_shared(tok, prefix, prompt, cands, 4096)
    with torch.no_grad():
        fast, counts = common.shared_prompt_logprobs(model, p_ids, c_ids)
        for c, f, k in zip(cands, fast, counts):
            s, n = common.turn_logprobs(model, common.tokenize_turns(tok, [(prompt, c)], prefix), 1)
            assert f.item() == pytest.approx(s.item(), abs=1e-4) and k.item() == n.item()
        # label_turns --max_batch_tokens: the same scores in batches of one or two rows
        for budget in (1, 2 * (len(p_ids) + max(map(len, c_ids)))):
            bounded, _ = common.shared_prompt_logprobs(model, p_ids, c_ids, max_tokens=budget)
            assert torch.allclose(bounded, fast, atol=1e-4)


def test_label_scoring_on_a_shared_frozen_bottom_equals_plain(tiny_model):
    """A critic trained with --train_layers 1 (its top layer moved) shares pi_ref's bottom layer:
    label_turns runs that once per state for both (FrozenBottom.common_to), and both scores equal the
    plain ones within 1e-4, in one batch and in batches of one row; a critic whose bottom moved too
    shares nothing."""
    tok = models.load_tokenizer(tiny_model)
    ref, critic, moved = (models.load_model(tiny_model, torch.device("cpu"), train_layers=1).eval() for _ in range(3))
    with torch.no_grad():
        for p in critic.model.layers[1].parameters():
            p.add_(0.05 * torch.randn_like(p))
        for p in moved.parameters():
            p.add_(0.05 * torch.randn_like(p))
    assert common.FrozenBottom.common_to([ref, moved], 1) is None and common.FrozenBottom.common_to([ref, critic], 0) is None
    bottom = common.FrozenBottom.common_to([ref, critic], 1)
    prompt = models.render_prompt(tok, colbench.agent_messages(TASK, [{"role": "user", "content": TASK["problem_description"]}]))
    cands = ["What is the factor?", "I WANT TO ANSWER: def f(x): return x * 2", "?", "Tell me more about x please"]
    p_ids, c_ids = common.encode_shared(tok, train_critic.training_info(TASK), prompt, cands, 4096)
    runs = []
    hook = ref.model.layers[0].register_forward_hook(lambda *a: runs.append(1))
    with torch.no_grad():
        for budget in (None, 1):
            for model in (critic, ref):
                plain, counts = common.shared_prompt_logprobs(model, p_ids, c_ids, max_tokens=budget)
                n_before = len(runs)
                kept, kept_counts = common.shared_prompt_logprobs(model, p_ids, c_ids, max_tokens=budget, bottom=bottom)
                assert torch.allclose(kept, plain, atol=1e-4) and torch.equal(kept_counts, counts)
                assert len(runs) == n_before  # the bottom layer's states were kept (the first call ran it on critic)
    hook.remove()
    assert len(bottom.kept) == 1 and len(critic.model.layers) == 2
    with torch.no_grad():
        diff = common.shared_prompt_logprobs(critic, p_ids, c_ids)[0] - common.shared_prompt_logprobs(ref, p_ids, c_ids)[0]
    assert diff.abs().max() > 1e-3  # the two models' scores differ: the top layers are each model's own


def test_dpo_reference_logprobs_of_a_state_equal_each_pair_alone(tok_model):
    """train_dpo groups the pairs of one state (same prompt) and scores each distinct turn once; every
    pair's (chosen, rejected) reference log-probs equal scoring that pair alone."""
    tok, model = tok_model
    prompts = [models.render_prompt(tok, colbench.agent_messages(TASK, [{"role": "user", "content": d}]))
               for d in (TASK["problem_description"], "Write g instead.")]
    turns = ["What is the factor?", "I WANT TO ANSWER: def f(x): return x * 2", "?", "Tell me more"]
    pairs = [(0, 0, 1), (1, 2, 3), (0, 0, 2), (0, 3, 1), (1, 0, 3), (0, 2, 1)]  # (prompt, chosen, rejected)
    examples = [{"shared": common.encode_shared(tok, "", prompts[p], [turns[c], turns[r]], 4096)} for p, c, r in pairs]
    groups = train_dpo.state_groups(examples)
    assert [len(g) for g in groups] == [4, 2] and groups[0][1] is examples[2]  # by prompt, in order
    with torch.no_grad():
        grouped = [x for g in groups for x in train_dpo.reference_logps_of_state(model, g)]
        for ex, got in zip(groups[0] + groups[1], grouped):
            alone, _ = common.shared_prompt_logprobs(model, *ex["shared"])
            assert got == pytest.approx(alone.tolist(), abs=1e-4)
    assert len({tuple(x) for x in grouped}) == 6  # six different pairs, six different answers


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
    (c, _), (r, _) = (common.turn_logprobs(model, common.tokenize_turns(tok, [(prompt, t)]), 1) for t in (chosen, rejected))
    twice = loss_and_grads(c.sum(), r.sum())
    assert shared[0] == pytest.approx(twice[0], abs=1e-4)
    assert max(g.abs().max().item() for g in twice[1].values()) > 1e-3  # real gradients, not all zero
    for name, g in twice[1].items():
        assert torch.allclose(shared[1][name], g, atol=1e-4, rtol=1e-4), name
    model.zero_grad()


@pytest.mark.parametrize("first_turns", ["differ", "same"])
def test_critic_pair_shared_prefix_equals_two_passes(tok_model, first_turns):
    """A critic pair's Bradley-Terry loss with the common prefix (c + first prompt) run once and each
    rest on its KV cache, and with each trajectory run whole: per-turn log-probs, loss and every
    parameter's gradient agree within 1e-4."""
    tok, model = tok_model
    opening = "What factor?" if first_turns == "same" else "Is it 3?"
    good = make_traj(tok, TASK, ["What factor?", "I WANT TO ANSWER: def f(x): return 2*x"], ["Double it."], 1.0, 0)
    bad = make_traj(tok, TASK, [opening, "Anything else?", "I WANT TO ANSWER: def f(x): return x"],
                    ["Double it.", "I don't know."], 0.0, 1)
    prefix = train_critic.training_info(TASK)
    trajs = [(common.tokenize_turns(tok, colbench.agent_turns(t), prefix), len(colbench.agent_turns(t))) for t in (good, bad)]

    def loss_and_grads(results):
        scores = [train_critic.trajectory_score(s, torch.zeros_like(s), n, 0.1) for s, n in results]
        loss = train_critic.critic_loss(scores[0], scores[1])
        model.zero_grad()
        loss.backward()
        return loss.item(), [s.detach() for s, _ in results], {n: p.grad.clone() for n, p in model.named_parameters()}

    shapes = []
    hook = model.register_forward_pre_hook(lambda m, a, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    shared = loss_and_grads(common.shared_prefix_turn_logprobs(model, trajs))
    hook.remove()
    n_prefix = shapes[0][1]  # the prefix once, then each rest alone on it
    assert len(shapes) == 3 and [n_prefix + b for _, b in shapes[1:]] == [len(seqs[0][0]) for seqs, _ in trajs]
    whole = loss_and_grads([common.turn_logprobs(model, seqs, n) for seqs, n in trajs])
    assert shared[0] == pytest.approx(whole[0], abs=1e-4)
    for a, b in zip(shared[1], whole[1]):
        assert torch.allclose(a, b, atol=1e-4), (a, b)
    assert max(g.abs().max().item() for g in whole[2].values()) > 1e-3  # real gradients, not all zero
    for name, g in whole[2].items():
        assert torch.allclose(shared[2][name], g, atol=1e-4, rtol=1e-4), name
    model.zero_grad()


@pytest.mark.parametrize("shared_prefix", [True, False])
def test_frozen_bottom_gives_the_whole_models_scores_and_gradients(tiny_model, shared_prefix):
    """With the bottom layer frozen (train_layers 1 of 2), a critic pair scored on the kept output of
    the frozen layer (common.FrozenBottom) equals the whole model's pass: per-turn log-probs, loss and
    the trained parameters' gradients within 1e-4; and after the first pass the frozen layer never runs."""
    tok = models.load_tokenizer(tiny_model)
    model = models.load_model(tiny_model, torch.device("cpu"), train_layers=1)
    good = make_traj(tok, TASK, ["What factor?", "I WANT TO ANSWER: def f(x): return 2*x"], ["Double it."], 1.0, 0)
    bad = make_traj(tok, TASK, ["Is it 3?", "Anything else?", "I WANT TO ANSWER: def f(x): return x"],
                    ["Double it.", "I don't know."], 0.0, 1)
    prefix = train_critic.training_info(TASK)
    trajs = [(common.tokenize_turns(tok, colbench.agent_turns(t), prefix), len(colbench.agent_turns(t))) for t in (good, bad)]
    score = (lambda b: common.shared_prefix_turn_logprobs(model, trajs, bottom=b)) if shared_prefix else \
        (lambda b: [common.turn_logprobs(model, seqs, n, b) for seqs, n in trajs])

    def loss_and_grads(results):
        scores = [train_critic.trajectory_score(s, torch.zeros_like(s), n, 0.1) for s, n in results]
        loss = train_critic.critic_loss(scores[0], scores[1])
        model.zero_grad()
        (loss + 10 * scores[0]).backward()  # a loss whose gradient is not ~0 at the start
        return loss.item(), [s.detach() for s, _ in results], {n: p.grad.clone() for n, p in model.named_parameters()
                                                               if p.requires_grad}

    whole = loss_and_grads(score(None))
    bottom = common.FrozenBottom(model, 1)
    with torch.no_grad():  # the first pass keeps the frozen layer's output (pi_ref's pass in train_critic)
        first = score(bottom)
    assert len(bottom.kept) == 2  # one entry per trajectory
    for (a, _), b in zip(first, whole[1]):
        assert torch.allclose(a, b, atol=1e-4), (a, b)
    runs = []
    hook = model.model.layers[0].register_forward_hook(lambda *a: runs.append(1))
    kept = loss_and_grads(score(bottom))
    hook.remove()
    assert runs == [] and len(model.model.layers) == 2  # the frozen layer never ran; the model is whole again
    assert kept[0] == pytest.approx(whole[0], abs=1e-4)
    for a, b in zip(kept[1], whole[1]):
        assert torch.allclose(a, b, atol=1e-4), (a, b)
    assert set(kept[2]) == set(whole[2]) and max(g.abs().max().item() for g in whole[2].values()) > 1e-3
    for name, g in whole[2].items():
        assert torch.allclose(kept[2][name], g, atol=1e-4, rtol=1e-4), name
    with pytest.raises(SystemExit, match="must be frozen"):
        common.FrozenBottom(models.load_model(tiny_model, torch.device("cpu")), 1)


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


def test_pairs_by_decision_rank_first_lines_before_whole_turns():
    """--cross_kind decision: the first line's advantage ranks first, the whole turn's orders one first line; the gap
    that sorts the pairs is the first that differs. Without decisions, the whole turn's order as before."""
    cands = ["Q: colour?", "I WANT TO ANSWER:\n<p>a</p>", "I WANT TO ANSWER:\n<p>b</p>", "Q: boxes?"]
    whole = [0.1, 0.9, 0.5, -0.2]      # the pages' ~150 tokens: answers look best
    decision = [0.3, -0.4, -0.4, 0.2]  # the decision: asking looks best here
    rng = random.Random(0)
    assert label_turns.make_pairs(cands, whole, 4, rng) == [(1, 3), (1, 0), (2, 3), (2, 0)]
    pairs = label_turns.make_pairs(cands, whole, 4, rng, decision)
    assert set(pairs[:2]) == {(0, 1), (0, 2)} and set(pairs[2:]) == {(3, 1), (3, 2)}  # questions over answers, surest first
    assert label_turns.make_pairs(cands[1:3], whole[1:3], 1, rng, decision[1:3]) == [(0, 1)]  # one first line: whole turn


def test_first_line_tokens_and_head_logprobs(tok_model):
    """A turn's decision is its first line's tokens (a one-line turn's: all of them, end of turn included), and
    shared_prompt_logprobs' head sums equal scoring those tokens alone, from the same pass."""
    tok, model = tok_model
    prompt = models.render_prompt(tok, colbench.agent_messages(TASK, [{"role": "user", "content": TASK["problem_description"]}]))
    cands = ["What is the factor?", "I WANT TO ANSWER:\ndef f(x):\n    return x * 2", "Here is a draft.\n<p>x</p>"]
    p_ids, c_ids = common.encode_shared(tok, "", prompt, cands, 4096)
    heads = [common.first_line_tokens(tok, c, len(ids)) for c, ids in zip(cands, c_ids)]
    assert heads[0] == len(c_ids[0])  # a question decides by all it says
    for c, ids, h in zip(cands[1:], c_ids[1:], heads[1:]):
        assert tok.decode(ids[:h]) == c.split("\n")[0] and 1 <= h < len(ids)  # not its newline
    assert common.first_line_tokens(tok, "\nHere is a draft.\n<p>x</p>", 9) == 9  # an empty first line: all of it
    assert common.first_line_tokens(tok, cands[1], 3) == 3  # a turn max_len cut short: no more than it has
    with torch.no_grad():
        sums, counts, head_sums = common.shared_prompt_logprobs(model, p_ids, c_ids, heads=heads)
        alone, _ = common.shared_prompt_logprobs(model, p_ids, [ids[:h] for ids, h in zip(c_ids, heads)])
        assert torch.allclose(head_sums, alone, atol=1e-4) and torch.allclose(head_sums[0], sums[0])
        assert torch.equal(sums, common.shared_prompt_logprobs(model, p_ids, c_ids)[0])  # the whole turns as without heads


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


def test_critic_learns_shortcut_pairs(tiny_model, tmp_path):
    """--shortcuts 1: each success (a question, then the answer) is also paired against its answer given at the
    first turn, the copy chosen; the critic trains on both kinds of pair and learns them."""
    tok = models.load_tokenizer(tiny_model)
    write_graded(tok, tmp_path / "g.jsonl", n_tasks=4)
    p = run_script("train_critic.py", "--trajectories", tmp_path / "g.jsonl", "--model", tiny_model, "--output_dir",
                   tmp_path / "critic", "--lr", "3e-3", "--epochs", "6", "--batch_size", "4", "--heldout_fraction", "0",
                   "--group_by_task", "--train_metrics", "--shortcuts", "1")
    assert "8 pairs from 4 tasks: 8 train, 0 held out; 4 of them a success against its answer given sooner" in p.stdout
    log = read_jsonl(tmp_path / "critic" / "log.jsonl")
    assert len(log) == 12 and log[0]["loss"] == pytest.approx(math.log(2), abs=1e-4)  # 8 pairs / 4 a step x 6 epochs
    assert json.loads((tmp_path / "critic" / "final_metrics.json").read_text())["train_acc"] == 1.0
    assert json.loads((tmp_path / "critic" / "run_settings.json").read_text())["shortcuts"] == 1


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
    # each turn's first line a term of its own (answers of two lines): every score 0 at step 1, another gradient
    # than one term per turn, and it learns the toy set
    write_graded(tok, tmp_path / "g2.jsonl", sep="\n")
    terms_log = {}
    for name, flags in (("turns", []), ("terms", ["--decision_terms"])):
        run_script("train_critic.py", "--trajectories", tmp_path / "g2.jsonl", "--model", tiny_model, "--output_dir",
                   tmp_path / f"critic_{name}", "--lr", "3e-3", "--epochs", "6", "--batch_size", "4",
                   "--heldout_fraction", "0.2", "--train_metrics", *flags)
        terms_log[name] = read_jsonl(tmp_path / f"critic_{name}" / "log.jsonl")
    terms_final = json.loads((tmp_path / "critic_terms" / "final_metrics.json").read_text())
    assert terms_log["terms"][0]["loss"] == pytest.approx(math.log(2), abs=1e-4) and terms_final["train_acc"] == 1.0
    assert terms_log["terms"][0]["grad_norm"] != pytest.approx(terms_log["turns"][0]["grad_norm"], rel=1e-3)
    assert json.loads((tmp_path / "critic_terms" / "run_settings.json").read_text())["decision_terms"] is True
    with pytest.raises(SystemExit, match="decision_terms"):
        train_critic.main(train_critic.Args(str(tmp_path / "g.jsonl"), str(tmp_path / "x"), model=tiny_model,
                                            decision_terms=True, normalization="trajectory"))
    # activation checkpointing gives the same first step
    run_script("train_critic.py", "--trajectories", tmp_path / "g.jsonl", "--model", tiny_model, "--output_dir",
               tmp_path / "critic_ckpt", "--lr", "3e-3", "--epochs", "1", "--batch_size", "4", "--heldout_fraction", "0.2",
               "--grad_ckpt")
    ckpt_log = read_jsonl(tmp_path / "critic_ckpt" / "log.jsonl")
    assert ckpt_log[0]["loss"] == pytest.approx(log[0]["loss"], abs=1e-6)
    assert ckpt_log[0]["grad_norm"] == pytest.approx(log[0]["grad_norm"], rel=1e-4)
    # each trajectory run whole instead of the pair's prefix once: the same run
    run_script("train_critic.py", "--trajectories", tmp_path / "g.jsonl", "--model", tiny_model, "--output_dir",
               tmp_path / "critic_whole", "--lr", "3e-3", "--epochs", "6", "--batch_size", "4", "--heldout_fraction", "0.2",
               "--no_shared_prefix")
    whole = read_jsonl(tmp_path / "critic_whole" / "log.jsonl")
    assert len(whole) == len(log)
    for a, b in zip(log, whole):
        for k in ("loss", "grad_norm", "margin", "heldout_loss"):
            if k in a:
                assert a[k] == pytest.approx(b[k], abs=1e-4), (k, a[k], b[k])
    # the top layer alone trains: on the frozen layer's kept output (the default) or with the whole model
    # at every step, the same run
    top = {}
    for name, flags in (("kept", []), ("whole", ["--no_keep_frozen"])):
        run_script("train_critic.py", "--trajectories", tmp_path / "g.jsonl", "--model", tiny_model, "--output_dir",
                   tmp_path / f"top_{name}", "--lr", "3e-3", "--epochs", "3", "--batch_size", "4", "--heldout_fraction",
                   "0.2", "--train_layers", "1", *flags)
        top[name] = read_jsonl(tmp_path / f"top_{name}" / "log.jsonl")
    assert len(top["kept"]) == len(top["whole"]) and top["whole"][-1]["loss"] < top["whole"][0]["loss"]
    for a, b in zip(top["kept"], top["whole"]):
        for k in ("loss", "grad_norm", "margin", "heldout_loss"):
            if k in a:
                assert a[k] == pytest.approx(b[k], abs=1e-4), (k, a[k], b[k])


def test_critic_grouped_by_task_trains_as_its_pairs_one_by_one(tiny_model, tmp_path):
    """--group_by_task scores each trajectory once for all its pairs in a step: with every pair in one batch
    both modes take the same steps; and its batches lay a task's pairs side by side."""
    tok = models.load_tokenizer(tiny_model)
    rows = []
    for k in range(3):  # the best sample of each task is the chosen side of two pairs
        task = dict(TASK, task_id=f"t{k}")
        rows += [make_traj(tok, task, ["What is the factor?", "I WANT TO ANSWER: yes yes"], ["Double it."], 1.0, 0),
                 make_traj(tok, task, ["I WANT TO ANSWER: maybe"], [], 0.5, 1),
                 make_traj(tok, task, ["I WANT TO ANSWER: no no no"], [], 0.0, 2)]
    (tmp_path / "g.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    logs = {}
    for name, flags in (("pairs", []), ("grouped", ["--group_by_task"])):
        run_script("train_critic.py", "--trajectories", tmp_path / "g.jsonl", "--model", tiny_model, "--output_dir",
                   tmp_path / name, "--lr", "3e-3", "--epochs", "3", "--batch_size", "6", "--heldout_fraction", "0.34",
                   "--eval_every", "1", "--train_metrics", *flags)
        logs[name] = read_jsonl(tmp_path / name / "log.jsonl")
        logs[name].append(json.loads((tmp_path / name / "final_metrics.json").read_text()))
    assert len(logs["pairs"]) == len(logs["grouped"]) == 4 and logs["pairs"][2]["loss"] < logs["pairs"][0]["loss"]
    for a, b in zip(logs["pairs"], logs["grouped"]):
        for k in ("loss", "acc", "margin", "grad_norm", "heldout_loss", "heldout_margin", "train_loss", "train_margin"):
            if k in a or k in b:
                assert a[k] == pytest.approx(b[k], abs=1e-4), (k, a[k], b[k])
    # the batch order: every example once a pass, a group's examples together, reproducible, pass by pass reshuffled
    groups = [i % 5 for i in range(23)]
    order = common.batch_order(23, 4, 2, 1, groups)
    for epoch in (0, 1):
        flat = [i for e, b in order for i in b if e == epoch]
        assert sorted(flat) == list(range(23))
        runs = [groups[i] for i in flat]
        assert sum(a != b for a, b in zip(runs, runs[1:])) == 4  # five groups, four boundaries
    assert order == common.batch_order(23, 4, 2, 1, groups) and order != common.batch_order(23, 4, 2, 2, groups)
    assert [i for e, b in order if e == 0 for i in b] != [i for e, b in order if e == 1 for i in b]


def test_label_turns_then_dpo_modes(tiny_model, tmp_path):
    tok = models.load_tokenizer(tiny_model)
    write_graded(tok, tmp_path / "g.jsonl", n_tasks=3)
    run_script("train_critic.py", "--trajectories", tmp_path / "g.jsonl", "--model", tiny_model, "--output_dir",
               tmp_path / "critic", "--lr", "1e-3", "--epochs", "1", "--train_layers", "1")  # shares pi_ref's layer 0
    args = ["--trajectories", tmp_path / "g.jsonl", "--critic", tmp_path / "critic", "--output", tmp_path / "pairs.jsonl",
            "--num_candidates", "4", "--pairs_per_state", "2", "--max_new_tokens", "8", "--data_fraction", "0.5",
            "--state_batch", "2"]  # 3 trajectories: sampled in batches of 2 states, then 1
    run_script("label_turns.py", *args)
    pairs = read_jsonl(tmp_path / "pairs.jsonl")
    states = read_jsonl(f"{tmp_path / 'pairs.jsonl'}.states.jsonl")
    # the shared frozen layer run once for the critic and pi_ref, or by each: the same candidates and advantages
    run_script("label_turns.py", *args[:5], tmp_path / "plain.jsonl", *args[6:], "--no_keep_frozen")
    plain = read_jsonl(tmp_path / "plain.jsonl.states.jsonl")
    assert [s["candidates"] for s in plain] == [s["candidates"] for s in states]
    for a, b in zip(states, plain):
        assert a["advantages"] == pytest.approx(b["advantages"], abs=1e-5)
    assert max(abs(x) for s in states for x in s["advantages"]) > 1e-4  # advantages of a critic that moved
    # --score_dtype bfloat16: the critic and pi_ref score with bf16 matmuls (still sharing the frozen layer), the
    # sampler keeps fp32 pi_ref (the same candidates), and the advantages are fp32's up to bf16 rounding
    run_script("label_turns.py", *args[:5], tmp_path / "bf16.jsonl", *args[6:], "--score_dtype", "bfloat16")
    bf16 = read_jsonl(tmp_path / "bf16.jsonl.states.jsonl")
    assert [s["candidates"] for s in bf16] == [s["candidates"] for s in states]
    diffs = [abs(a - b) for s, t in zip(states, bf16) for a, b in zip(s["advantages"], t["advantages"])]
    assert 0 < max(diffs) < 0.02, max(diffs)
    critic_settings, ref_name = label_turns.load_critics({"sweet": tmp_path / "critic"})
    scorer = label_turns.Scorer.load({"sweet": tmp_path / "critic"}, critic_settings, ref_name, torch.device("cpu"),
                                     4096, 10, 65536, dtype="bfloat16")
    kinds = lambda m: {type(x).__name__ for x in m.modules()}
    assert "Bf16Linear" in kinds(scorer.ref) and "Bf16Linear" in kinds(scorer.critics["sweet"])
    assert "Linear" in kinds(scorer.plain_ref) and "Bf16Linear" not in kinds(scorer.plain_ref)
    assert scorer.bottom is not None  # the bf16 critic and pi_ref still share their frozen layer
    with pytest.raises(SystemExit, match="score_dtype"):
        label_turns.Scorer.load({"sweet": tmp_path / "critic"}, critic_settings, ref_name, torch.device("cpu"),
                                4096, 10, 65536, dtype="float16")
    assert len(states) >= 3 and all(len(s["candidates"]) == 4 for s in states)
    assert all(s["cut"] == [True] * 4 for s in states)  # the tiny model never ends a turn: 8 tokens cut every one
    # an ensemble (--critic DIR+DIR): each member scores as it does alone, and a candidate's advantage is their mean
    run_script("train_critic.py", "--trajectories", tmp_path / "g.jsonl", "--model", tiny_model, "--output_dir",
               tmp_path / "critic2", "--lr", "3e-3", "--epochs", "1", "--train_layers", "1", "--seed", "1")
    members, groups = label_turns.critic_members({"sweet": f"{tmp_path / 'critic'}+{tmp_path / 'critic2'}"})
    assert groups == {"sweet": ["sweet/1", "sweet/2"]} and members["sweet/2"] == str(tmp_path / "critic2")
    ensemble = label_turns.Scorer.load(members, label_turns.load_critics(members)[0], ref_name, torch.device("cpu"),
                                       4096, 10, 65536, groups=groups)
    trajs = {(t["task_id"], t.get("sample", 0)): t for t in colbench.load_graded(tmp_path / "g.jsonl")}
    for s in states:
        traj = trajs[(s["task_id"], s["sample"])]
        adv = ensemble.advantages(traj["task"], colbench.agent_turns(traj)[s["turn"]][0], s["candidates"])
        assert adv["sweet/1"] == pytest.approx(s["advantages"], abs=1e-5)  # as the critic alone labelled them
        assert adv["sweet"] == pytest.approx([(a + b) / 2 for a, b in zip(adv["sweet/1"], adv["sweet/2"])])
    assert adv["sweet/1"] != pytest.approx(adv["sweet/2"], abs=1e-4)  # a critic trained otherwise
    for p in pairs:
        assert set(p) >= {"prompt", "chosen", "rejected", "chosen_advantage", "rejected_advantage", "task_id", "turn"}
        assert p["chosen_advantage"] > p["rejected_advantage"]
        assert TASK["ground_truth"] not in p["prompt"]  # the policy's prompt never holds c
    run_script("label_turns.py", *args)  # resume: nothing redone
    assert read_jsonl(tmp_path / "pairs.jsonl") == pairs
    assert pairs  # random candidates of 8 tokens differ, and so do their advantages
    run_script("train_dpo.py", "--pairs", tmp_path / "pairs.jsonl", "--model", tiny_model, "--output_dir",
               tmp_path / "sweet", "--lr", "1e-3")
    log = read_jsonl(tmp_path / "sweet" / "log.jsonl")
    run_script("train_dpo.py", "--pairs", tmp_path / "pairs.jsonl", "--model", tiny_model, "--output_dir",
               tmp_path / "sweet_unshared", "--lr", "1e-3", "--no_shared_prompt")
    unshared = read_jsonl(tmp_path / "sweet_unshared" / "log.jsonl")  # prompt + turn twice: the same run
    assert len(unshared) == len(log) >= 1
    for a, b in zip(log, unshared):
        for k in ("loss", "grad_norm", "rewards/margins", "nll"):
            assert a[k] == pytest.approx(b[k], abs=1e-4), (k, a[k], b[k])
    assert {"rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "nll"} <= set(log[0])
    assert log[0]["rewards/margins"] == pytest.approx(0, abs=1e-5)  # policy == pi_ref before the first step
    for mode in ("trajectory", "sft"):
        run_script("train_dpo.py", "--mode", mode, "--trajectories", tmp_path / "g.jsonl", "--model", tiny_model,
                   "--output_dir", tmp_path / mode, "--lr", "1e-3", "--epochs", "2", "--batch_size", "2", "--snapshots", "1")
        log = read_jsonl(tmp_path / mode / "log.jsonl")
        assert len(log) == 4 and log[-1]["loss"] < log[0]["loss"]
        # --snapshots 1: the policy after step 2 of 4, a third point between pi_ref and the end
        weights = [dict(AutoModelForCausalLM.from_pretrained(d).named_parameters())
                   for d in (tiny_model, tmp_path / mode / "step-2", tmp_path / mode)]
        assert sorted(p.name for p in (tmp_path / mode).glob("step-*")) == ["step-2"]
        moved = lambda a, b: max((a[k] - b[k]).abs().max().item() for k in a)
        assert moved(weights[0], weights[1]) > 0 and moved(weights[1], weights[2]) > 0
    assert train_dpo.snapshot_schedule(53, 2) == [18, 35] and train_dpo.snapshot_schedule(1, 2) == []
    # --epochs 0.67 (run.sh html): the first 23 of a pass's 34 steps, in the whole pass's order
    whole, part = common.batch_order(270, 8, 1, 0), common.batch_order(270, 8, 0.67, 0)
    assert len(whole) == 34 and part == whole[:23] and train_dpo.snapshot_schedule(len(part), 1) == [12]
    assert len(common.batch_order(270, 8, 1.5, 0)) == 51 and len(common.batch_order(3, 8, 0.1, 0)) == 1


def test_dpo_pairs_of_different_kinds_decision_only(tok_model, tiny_model, tmp_path):
    """--cross_kind decision: a pair of a question and an answer (or a draft) is trained on each turn's first
    line only, so what follows it (the rejected page) changes nothing; the paper's loss (turn) trains it all.
    A pair of one kind keeps every token either way, and the one-pass and two-pass paths agree."""
    tok, _ = tok_model
    prompt = models.render_prompt(tok, colbench.agent_messages(TASK, [{"role": "user", "content": "A page, dark."}], "html"))
    page = lambda bg: f'I WANT TO ANSWER:\n<body class="bg-{bg}">\n<header class="p-6">Shop</header>\n</body>'
    pair = lambda c, r: {"prompt": prompt, "chosen": c, "rejected": r, "task_id": "t0", "turn": 0}
    for bg in ("white", "gray-900"):  # two files that differ only after the first line of a rejected answer
        rows = [pair("What colour is the header?", page(bg)), pair("What colour is the header?", "Which font?"),
                pair("Here is a draft. What should change?\n<body class=\"bg-white\"></body>", page(bg))]
        (tmp_path / f"{bg}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [colbench.turn_kind(t) for t in (rows[0]["chosen"], rows[0]["rejected"], rows[2]["chosen"])] == \
        ["question", "answer", "draft"]
    n = len(tok(page("white"), add_special_tokens=False)["input_ids"]) + 1  # + end-of-turn
    first = len(tok("I WANT TO ANSWER:", add_special_tokens=False)["input_ids"])  # not its newline
    assert common.first_line_tokens(tok, page("white"), n) == first < n
    assert common.first_line_tokens(tok, "Which font?", 4) == 4  # one line: all of it, its end-of-turn too

    def train(name, pairs, *extra):
        run_script("train_dpo.py", "--pairs", tmp_path / pairs, "--model", tiny_model, "--output_dir", tmp_path / name,
                   "--lr", "1e-3", "--batch_size", "3", "--epochs", "2", *extra)
        return dict(AutoModelForCausalLM.from_pretrained(tmp_path / name).named_parameters()), read_jsonl(tmp_path / name / "log.jsonl")
    moved = lambda a, b: max((a[k] - b[k]).abs().max().item() for k in a)
    (white, log_w), (dark, log_d) = (train(f"decision_{bg}", f"{bg}.jsonl", "--cross_kind", "decision") for bg in ("white", "gray-900"))
    assert moved(white, dark) == 0 and moved(white, dict(AutoModelForCausalLM.from_pretrained(tiny_model).named_parameters())) > 0
    assert [(x["loss"], x["grad_norm"]) for x in log_w] == [(x["loss"], x["grad_norm"]) for x in log_d]
    (white_t, _), (dark_t, _) = (train(f"turn_{bg}", f"{bg}.jsonl") for bg in ("white", "gray-900"))
    assert moved(white_t, dark_t) > 1e-4  # the paper's loss pushes the rejected page down, token by token
    _, log_two = train("decision_two_pass", "white.jsonl", "--cross_kind", "decision", "--no_shared_prompt")
    for a, b in zip(log_w, log_two):
        for k in ("loss", "grad_norm", "rewards/margins", "nll"):
            assert a[k] == pytest.approx(b[k], abs=1e-4), (k, a[k], b[k])
    with pytest.raises(AssertionError, match="--cross_kind is for --mode turn"):
        run_script("train_dpo.py", "--mode", "sft", "--trajectories", tmp_path / "white.jsonl", "--model", tiny_model,
                   "--output_dir", tmp_path / "x", "--cross_kind", "decision")


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
    common.save_training_state(model, opt, tmp_path / "resume", 1, order, 0)
    shutil.copytree(tmp_path / "resume", tmp_path / "resume.old")
    common.save_training_state(model, opt, tmp_path / "resume", 2, order, 0)
    assert not (tmp_path / "resume.old").exists()
    assert common.load_training_state(model, opt, tmp_path / "resume", order) == 2
