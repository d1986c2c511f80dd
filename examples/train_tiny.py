"""Train a two-layer Gated DeltaNet language model on synthetic data, on the CPU.

    PYTHONPATH=. python examples/train_tiny.py              # 250 steps, a progress bar
    PYTHONPATH=. python examples/train_tiny.py --steps 20   # a quick run

The data: variable-length sequences packed into one ``[1, T]`` row with ``cu_seqlens``
(the layer keeps them apart). Each sequence is a random walk of a sparse Markov chain
(every token has 3 likely successors, entropy 0.9 nats) followed by a verbatim copy of
itself. The loss starts near ln(64) = 4.2; the model learns the chain and the loss falls
to about 1.1 within 150 steps (the mean of the last 10 of the default 250: about 1.06).
The default run (one torch thread, ``--threads``) takes about 25 s of CPU time (about 0.08 s
a step of ~900 tokens, and a few seconds of start-up), so well under a minute on an idle
machine, and several times that on a busy one. Recalling the copy through the recurrent state (which would bring the loss lower,
towards half that) takes much longer training.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from tiny_lm import TinyLM


def make_chain(vocab: int, generator: torch.Generator) -> torch.Tensor:
    """Transition matrix ``[vocab, vocab]``: 3 successors per token, weights 0.6, 0.3, 0.1."""
    probs = torch.zeros(vocab, vocab)
    for token in range(vocab):
        successors = torch.randperm(vocab, generator=generator)[:3]
        probs[token, successors] = torch.tensor([0.6, 0.3, 0.1])
    return probs


def packed_batch(chain: torch.Tensor, num_seqs: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``num_seqs`` sequences (a walk of 8..48 tokens, then its copy), packed: ids ``[1, T]``, cu_seqlens."""
    vocab = chain.shape[0]
    seqs = []
    for _ in range(num_seqs):
        length = int(torch.randint(8, 49, (1,), generator=generator))
        walk = [int(torch.randint(vocab, (1,), generator=generator))]
        for _ in range(length - 1):
            walk.append(int(torch.multinomial(chain[walk[-1]], 1, generator=generator)))
        seqs.append(torch.tensor(walk + walk))
    lengths = torch.tensor([0] + [len(s) for s in seqs])
    return torch.cat(seqs).unsqueeze(0), lengths.cumsum(0)


def packed_loss(logits: torch.Tensor, ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy that never predicts across a sequence boundary."""
    targets = ids[0, 1:].clone()
    targets[cu_seqlens[1:-1] - 1] = -100  # the last token of a sequence does not predict the next one's first
    return F.cross_entropy(logits[0, :-1], targets, ignore_index=-100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=250, help="training steps (default: %(default)s)")
    parser.add_argument("--seqs-per-batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--backend", default=None, help="torch_gdr backend (default: the op's default)")
    parser.add_argument("--chunk-size", type=int, default=32, help="the op's chunk size (16, 32, 64, 128)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default: %(default)s; the model is so small that more threads spend "
                             "several times the CPU time waiting for each other, and on a busy machine run slower)")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    vocab = 64
    chain = make_chain(vocab, generator)
    model = TinyLM(vocab=vocab, hidden=64, num_layers=2, num_heads=2, num_v_heads=4, head_dim=16,
                   backend=args.backend, chunk_size=args.chunk_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / max(args.steps, 1))))
    print(f"TinyLM, {sum(p.numel() for p in model.parameters())} parameters; ln(vocab) = {math.log(vocab):.3f}")

    start, first, recent = time.time(), None, []
    bar = tqdm(range(1, args.steps + 1), desc="training", unit="step", dynamic_ncols=True)
    for step in bar:
        ids, cu_seqlens = packed_batch(chain, args.seqs_per_batch, generator)
        loss = packed_loss(model(ids, cu_seqlens=cu_seqlens), ids, cu_seqlens)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        first = loss.item() if first is None else first
        recent = (recent + [loss.item()])[-10:]
        bar.set_postfix(loss=f"{sum(recent) / len(recent):.3f}")
        if step == 1 or step % max(args.steps // 10, 1) == 0 or step == args.steps:
            bar.write(f"step {step:4d}  loss {loss.item():.3f}  ({time.time() - start:.1f}s, {ids.shape[1]} tokens)")
    bar.close()
    print(f"loss: first step {first:.3f}, mean of the last {len(recent)} steps {sum(recent) / len(recent):.3f}")


if __name__ == "__main__":
    main()
