"""A resumable, seeded-per-epoch shuffling sampler (CheckFreq, section 4.2; spec §19.4).

The order of epoch ``e`` is ``torch.randperm(n)`` drawn from a generator seeded with
``seed + e``, so it does not depend on anything that happened before. The state is the
epoch and the number of indices already handed out in it; loading it continues the same
order exactly. With ``DataLoader(num_workers=0)`` the indices handed out equal the samples
consumed; worker processes prefetch, so record ``state_dict()`` yourself from the batches
your loop consumed if you use them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from torch.utils.data import Sampler


class ResumableSampler(Sampler[int]):
    """Shuffles ``range(n)`` per epoch with a fixed seed and resumes mid-epoch.

    Example:
        >>> sampler = ResumableSampler(len(dataset), seed=0)            # doctest: +SKIP
        >>> loader = DataLoader(dataset, batch_size=8, sampler=sampler)  # doctest: +SKIP
    """

    def __init__(self, n: int, *, seed: int = 0, shuffle: bool = True) -> None:
        if n < 0:
            raise ValueError("n must be >= 0")
        self.n = n
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0

    def _order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.n)
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.n, generator=g)

    def __iter__(self) -> Iterator[int]:
        order = self._order()
        while self.position < self.n:
            i = int(order[self.position])
            self.position += 1
            yield i
        self.epoch += 1
        self.position = 0

    def __len__(self) -> int:
        return self.n - self.position

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "n": self.n}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        if state.get("n", self.n) != self.n or state.get("seed", self.seed) != self.seed:
            raise ValueError(
                f"sampler state is for n={state.get('n')}, seed={state.get('seed')}; "
                f"this sampler has n={self.n}, seed={self.seed}"
            )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
