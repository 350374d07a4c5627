"""Resumable prompt samplers: seeded epoch permutations (uniform), or a curriculum over
data sources by how much each still teaches (UCB); both save their position."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

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

    def observe(self, sources: Sequence[str], magnitudes: Sequence[float]) -> None:
        """Uniform draws do not depend on what the step learned."""

    def metrics(self) -> dict[str, float]:
        """Nothing to log: every row is as likely as every other."""
        return {}

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "size": self.size, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state.get("type", "uniform") != "uniform":
            raise ValueError(f"the checkpoint was written by the {state['type']} sampler, not the uniform one")
        if state["size"] != self.size or state["seed"] != self.seed:
            raise ValueError("the checkpoint was written for a different dataset or seed")
        self.epoch, self.position = state["epoch"], state["position"]


def ucb_probabilities(
    means: Sequence[float], counts: Sequence[int], total: int, c: float, temperature: float
) -> np.ndarray:
    """DUMP's sampling distribution over sources: score_j = mean_j + c * sqrt(2 ln(N + 1)
    / (n_j + 1)), with mean_j the source's recent mean absolute advantage, n_j its
    draws and N = ``total`` draws; probabilities softmax(score / temperature)."""
    scores = np.asarray(means, dtype=np.float64) + c * np.sqrt(
        2.0 * np.log(total + 1.0) / (np.asarray(counts, dtype=np.float64) + 1.0)
    )
    z = scores / temperature
    weights = np.exp(z - z.max())
    return weights / weights.sum()


class SourceUCBSampler:
    """A curriculum over ``data_source``: each prompt's source is drawn from
    :func:`ucb_probabilities` (computed once per ``next_batch`` call), then the source's
    next row in its own seeded epochs. ``observe`` feeds the step's absolute advantages
    into each source's window of the last ``window``. Every rank holds the same state
    (it observes every rank's completions), and ``state_dict`` saves all of it.

    ``n_j`` counts draws, not observations: a drawn row that brings nothing to the
    window (skipped as unusable, or its prompt too long) still lowers its source's
    exploration bonus. That is what keeps a source whose rows never train from being
    drawn for its bonus forever. (A group that dynamic sampling drops is observed, as
    |A| = 0 for each completion.)"""

    def __init__(self, sources: Sequence[str], seed: int, shuffle: bool, window: int, c: float, temperature: float):
        if not sources:
            raise ValueError("the dataset has no usable rows")
        self.names = sorted(set(sources))
        self.index = {name: j for j, name in enumerate(self.names)}
        self.rows = [[i for i, s in enumerate(sources) if s == name] for name in self.names]
        self.seed, self.shuffle = seed, shuffle
        self.window, self.c, self.temperature = window, c, temperature
        self.recent = [deque(maxlen=window) for _ in self.names]
        self.counts = [0] * len(self.names)
        self.epochs = [0] * len(self.names)
        self.positions = [0] * len(self.names)
        self._orders: dict[tuple[int, int], list[int]] = {}  # (source, epoch) -> its row order

    @property
    def drawn(self) -> int:
        """Draws so far over the whole run (restored with the state)."""
        return sum(self.counts)

    def probabilities(self) -> np.ndarray:
        """The sources' sampling probabilities now (in ``names`` order); an empty
        window's mean is 0."""
        means = [float(np.mean(r)) if r else 0.0 for r in self.recent]
        return ucb_probabilities(means, self.counts, self.drawn, self.c, self.temperature)

    def _order(self, j: int) -> list[int]:
        """Source ``j``'s rows in its current epoch's order (made once an epoch)."""
        key = (j, self.epochs[j])
        if key not in self._orders:
            rows = self.rows[j]
            if self.shuffle:
                rows = [rows[k] for k in np.random.default_rng([self.seed, *key]).permutation(len(rows))]
            self._orders = {k: v for k, v in self._orders.items() if k[0] != j} | {key: rows}
        return self._orders[key]

    def _next_row(self, j: int) -> int:
        rows = self.rows[j]
        row = self._order(j)[self.positions[j]]
        self.counts[j] += 1
        self.positions[j] += 1
        if self.positions[j] == len(rows):
            self.epochs[j], self.positions[j] = self.epochs[j] + 1, 0
        return row

    def next_batch(self, count: int) -> list[int]:
        """The next ``count`` row indices, each from a source drawn by the current
        probabilities (a stream seeded by the run's seed and the draw count)."""
        rng = np.random.default_rng([self.seed, self.drawn])
        picks = rng.choice(len(self.names), size=count, p=self.probabilities())
        return [self._next_row(int(j)) for j in picks]

    def observe(self, sources: Sequence[str], magnitudes: Sequence[float]) -> None:
        """Add a step's absolute advantages (one per completion, every rank's, in the
        same order on every rank) to their sources' windows."""
        for source, magnitude in zip(sources, magnitudes, strict=True):
            self.recent[self.index[source]].append(float(magnitude))

    def metrics(self) -> dict[str, float]:
        """``sampler/prob/<source>``: the probabilities the next draw uses."""
        return {f"sampler/prob/{name}": float(p) for name, p in zip(self.names, self.probabilities(), strict=True)}

    def state_dict(self) -> dict:
        return {
            "type": "ucb",
            "seed": self.seed,
            "sources": {name: len(rows) for name, rows in zip(self.names, self.rows, strict=True)},
            "counts": list(self.counts),
            "epochs": list(self.epochs),
            "positions": list(self.positions),
            "recent": [list(r) for r in self.recent],
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("type", "uniform") != "ucb":
            raise ValueError(f"the checkpoint was written by the {state.get('type', 'uniform')} sampler, not ucb")
        sizes = {name: len(rows) for name, rows in zip(self.names, self.rows, strict=True)}
        if state["sources"] != sizes or state["seed"] != self.seed:
            raise ValueError("the checkpoint was written for a different dataset (its sources' rows) or seed")
        self.counts, self.epochs = list(state["counts"]), list(state["epochs"])
        self.positions = list(state["positions"])
        self.recent = [deque(r, maxlen=self.window) for r in state["recent"]]
