"""A resumable prompt sampler: seeded epoch permutations and a position to save."""

from __future__ import annotations

import numpy as np


class PromptSampler:
    """Yields batches of row indices, epoch after epoch, each epoch a fresh seeded
    permutation (or the file order without shuffling). ``state_dict`` and
    ``load_state_dict`` make a resumed run draw exactly the batches it would have."""

    def __init__(self, size: int, seed: int, shuffle: bool = True):
        if size < 1:
            raise ValueError("the dataset has no usable rows")
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self.epoch, self.position = 0, 0

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.size)
        return np.random.default_rng([self.seed, epoch]).permutation(self.size)

    def next_batch(self, count: int) -> list[int]:
        """The next ``count`` indices, crossing into the next epoch when needed."""
        out: list[int] = []
        while len(out) < count:
            order = self._order(self.epoch)
            take = order[self.position : self.position + count - len(out)]
            out.extend(int(i) for i in take)
            self.position += len(take)
            if self.position >= self.size:
                self.epoch, self.position = self.epoch + 1, 0
        return out

    @property
    def drawn(self) -> int:
        """Indices drawn so far over the whole run (restored with the state): a counter
        that numbers every draw, for per-prompt sampling seeds."""
        return self.epoch * self.size + self.position

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "size": self.size, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["size"] != self.size or state["seed"] != self.seed:
            raise ValueError("the checkpoint was written for a different dataset or seed")
        self.epoch, self.position = state["epoch"], state["position"]
