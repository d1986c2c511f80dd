"""Generate with the decode cache: prefill once, then one token per step, no re-run of the prompt.

    PYTHONPATH=. python examples/generate_with_cache.py
    PYTHONPATH=. python examples/generate_with_cache.py --prompt-len 512 --new-tokens 32

A randomly initialised TinyLM (two Gated DeltaNet blocks) greedily continues a batch of
left-padded prompts of different lengths. The script checks that every cached step's
logits equal those of re-running the whole sequence, then times a cached decode step
against re-running the full forward at ``--prompt-len`` tokens.
"""

from __future__ import annotations

import argparse
import time

import torch

from tiny_lm import TinyLM
from torch_gdr.nn import GatedDeltaNetCache


@torch.no_grad()
def generate(model: TinyLM, prompts: list[torch.Tensor], new_tokens: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Greedy decode of left-padded prompts; returns the new tokens ``[B, new_tokens]`` and each step's logits."""
    longest = max(len(p) for p in prompts)
    device = prompts[0].device
    ids = torch.zeros(len(prompts), longest, dtype=torch.long, device=device)
    mask = torch.zeros(len(prompts), longest, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p):] = p
        mask[i, longest - len(p):] = 1
    cache = GatedDeltaNetCache()
    logits = model(ids, attention_mask=mask, cache=cache)[:, -1]  # prefill: the chunked op
    steps, tokens = [logits], []
    for _ in range(new_tokens):
        token = logits.argmax(-1, keepdim=True)  # [B, 1]
        tokens.append(token)
        logits = model(token, cache=cache)[:, -1]  # one decode step per sequence
        steps.append(logits)
    return torch.cat(tokens, dim=1), steps[:-1]


@torch.no_grad()
def check_against_rerun(model: TinyLM, prompts: list[torch.Tensor], tokens: torch.Tensor,
                        steps: list[torch.Tensor]) -> float:
    """Max |cached logits - logits of re-running each sequence from scratch|."""
    worst = 0.0
    for i, prompt in enumerate(prompts):
        full = model(torch.cat([prompt, tokens[i]]).unsqueeze(0))[0]
        for s, logits in enumerate(steps):
            worst = max(worst, (logits[i] - full[len(prompt) - 1 + s]).abs().max().item())
    return worst


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeats: int) -> float:
    """Median seconds of ``repeats`` calls after a warm-up (robust to a busy machine)."""
    fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


@torch.no_grad()
def benchmark(model: TinyLM, vocab: int, prompt_len: int, steps: int, repeats: int,
              device: torch.device) -> tuple[float, float]:
    """Seconds per new token: a cached decode step, and re-running the forward of prompt_len tokens."""
    ids = torch.randint(vocab, (1, prompt_len), device=device)
    cache = GatedDeltaNetCache()
    model(ids, cache=cache)
    token = ids[:, -1:]

    def decode_steps() -> None:
        for _ in range(steps):
            model(token, cache=cache)

    per_step = timed(decode_steps, repeats) / steps
    rerun = timed(lambda: model(ids), repeats)
    return per_step, rerun


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=512, help="prompt length of the timing")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--v-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--backend", default=None, help="torch_gdr backend (default: the op's default)")
    parser.add_argument("--decode-backend", default=None,
                        help="backend of single-token steps (default: --backend); 'recurrent' pads no chunk")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    model = TinyLM(args.vocab, args.hidden, args.layers, args.heads, args.v_heads, args.head_dim,
                   backend=args.backend).to(args.device).eval()
    for block in model.blocks:
        block.mixer.decode_backend = args.decode_backend
    with torch.no_grad():  # milder decays than the default init, so the state matters
        for block in model.blocks:
            block.mixer.A_log.uniform_(-3.0, -1.0)
    prompts = [torch.randint(args.vocab, (n,)).to(args.device) for n in (23, 7, 16)]
    tokens, steps = generate(model, prompts, args.new_tokens)
    for prompt, new in zip(prompts, tokens):
        print(f"prompt of {len(prompt):2d} tokens -> {new.tolist()}")
    print(f"cached decode vs re-running each sequence: max |logits diff| = "
          f"{check_against_rerun(model, prompts, tokens, steps):.2e}")

    per_step, rerun = benchmark(model, args.vocab, args.prompt_len, steps=16, repeats=5,
                               device=torch.device(args.device))
    print(f"config: hidden {args.hidden}, {args.layers} layers, H {args.heads}, HV {args.v_heads}, "
          f"head dim {args.head_dim}, vocab {args.vocab}, batch 1, fp32, {args.device}, {torch.get_num_threads()} threads, "
          f"backend {args.backend}, decode backend {args.decode_backend or args.backend}")
    print(f"decode with the cache: {per_step * 1e3:.2f} ms/token;  re-running the forward at T = "
          f"{args.prompt_len}: {rerun * 1e3:.1f} ms/token  ({rerun / per_step:.0f}x)")


if __name__ == "__main__":
    main()
