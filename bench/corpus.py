"""Token data with learnable structure and a known loss floor: a fixed random Markov chain.

Each token has ``successors`` possible next tokens, drawn once from a seeded
generator, taken with fixed probabilities. A model that learns the chain reaches
the chain's entropy (:func:`entropy`) and no lower, so losses stay well above
zero and a relative comparison between two training runs means something
(uniform random tokens teach nothing; a deterministic rule drives the loss to 0).
"""

from __future__ import annotations

import math

import torch

# The probabilities of each token's successors: entropy 1.21 nats.
PROBABILITIES = (0.5, 0.25, 0.15, 0.1)


class MarkovChain:
    def __init__(self, vocab: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.successors = torch.stack([torch.randperm(vocab, generator=g)[: len(PROBABILITIES)] for _ in range(vocab)])
        self.probabilities = torch.tensor(PROBABILITIES, dtype=torch.float64)

    @property
    def entropy(self) -> float:
        """The loss floor (nats per token) of a model that knows the chain."""
        return -sum(p * math.log(p) for p in PROBABILITIES)

    def sample(self, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
        """``batch`` sequences of ``length`` tokens (int64, on the CPU)."""
        out = torch.empty(batch, length, dtype=torch.int64)
        out[:, 0] = torch.randint(0, self.vocab, (batch,), generator=generator)
        for t in range(1, length):
            pick = torch.multinomial(self.probabilities.expand(batch, -1), 1, generator=generator).squeeze(1)
            out[:, t] = self.successors[out[:, t - 1], pick]
        return out
