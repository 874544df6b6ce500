"""Peak memory of label_turns' scoring: N candidates of C tokens after a P-token prompt, one batch
(--max_batch_tokens 0) or sub-batches of at most max_batch_tokens rows x (prompt + candidate) tokens.
A config-built Llama (Llama-3's vocabulary, so the [rows, length, vocab] logits weigh what they do at
8B) on the CPU; each setting runs in a fresh process and reports the growth of its peak RSS while
scoring (the model's own weights excluded).

    python bench/bench_label_memory.py                           # 16 x 512 after 4096, three budgets
    python bench/bench_label_memory.py --budgets 0 --no_subprocess  # one setting in this process
"""
import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--num_candidates", type=int, default=16)
p.add_argument("--prompt_tokens", type=int, default=4096)
p.add_argument("--candidate_tokens", type=int, default=512)
p.add_argument("--budgets", default="0,65536,16384", help="max_batch_tokens values (0 = one batch, no bound)")
p.add_argument("--hidden", type=int, default=512)
p.add_argument("--layers", type=int, default=8)
p.add_argument("--vocab", type=int, default=128256)
p.add_argument("--no_subprocess", action="store_true", help="measure the first budget in this process")
a = p.parse_args()


def peak_rss_mib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def measure(budget):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    import common
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=4 * a.hidden, num_hidden_layers=a.layers,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=8192, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, a.vocab, (a.prompt_tokens,), generator=g).tolist()
    conts = [torch.randint(0, a.vocab, (a.candidate_tokens,), generator=g).tolist() for _ in range(a.num_candidates)]
    with open("/proc/self/clear_refs", "w") as f:  # reset the peak to the current RSS
        f.write("5")
    base = peak_rss_mib()
    t0 = time.time()
    with torch.no_grad():
        sums, _ = common.shared_prompt_logprobs(model, prompt, conts, **({"max_tokens": budget} if budget else {}))
    print(f"max_batch_tokens={budget or 'none':>6}: peak RSS +{peak_rss_mib() - base:,.0f} MiB while scoring, "
          f"{time.time() - t0:.1f} s, mean log-prob {sums.mean().item() / a.candidate_tokens:.4f}", flush=True)


budgets = [int(b) for b in a.budgets.split(",")]
if not a.no_subprocess:
    print(f"{a.num_candidates} candidates x {a.candidate_tokens} tokens after a {a.prompt_tokens}-token prompt; Llama "
          f"{a.layers} layers x {a.hidden}, vocabulary {a.vocab}, CPU fp32")
if a.no_subprocess:
    measure(budgets[0])
else:
    for b in budgets:
        args = [x for x in sys.argv[1:] if x != "--no_subprocess"]
        subprocess.run([sys.executable, __file__, *args, "--budgets", str(b), "--no_subprocess"], check=True)
