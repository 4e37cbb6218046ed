"""The collaborators of a recording Checkpointer, wired by :mod:`.setup` (docs/capture-runtime.md "Pipeline").

One object that the roles share instead of a reference to the Checkpointer: the step life
cycle (:mod:`.lifecycle`), the closing (:mod:`.closing`) and the front (:mod:`.runtime`) read
the same writer, pool, threads and settings. :mod:`.setup` assigns them in the order the
constructor makes them (the background writer last), so an attribute is read only once set.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..chain.writer import ChainWriter
from ..errors import LdformatError
from ..format.manifest import Kind
from ..format.topk import TopK
from .background import BackgroundWriter
from .cadence import Cadence
from .ddp import ExchangeThread, RankExtras
from .extra import Stateful
from .hooks import Hooks
from .mirror import Mirror
from .pieces import PieceReading
from .replica import Replica
from .settings import Mode
from .sharded import Committer
from .snapshot import LazySnapshots
from .staging import BufferPool, Stager
from .stats import CaptureStats
from .tuning import Tuning

if TYPE_CHECKING:
    import torch.distributed as dist

#: The extra state of a step as Python values (spec §19.1): (rng, data, ranks, scalars) -> extra.
RawExtra = Callable[[dict[str, Any] | None, dict[str, Any] | None, dict[str, dict[str, object]] | None,
                     dict[str, float] | None], dict[str, object]]


class Parts:
    """What records a chain on this rank: the settings in force, the live objects, the threads."""

    path: str
    mode: Mode
    kind: Kind
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Stateful | None
    scaler: torch.amp.GradScaler | None
    compressor: TopK | None
    compress: bool  # lowdiff: the runtime compresses the gradients (else a DDP comm hook did)
    max_batch_bytes: int
    world_size: int  # ranks whose residuals an anchor gathers (1 unless data-parallel 'lowdiff')
    process_group: dist.ProcessGroup | None
    sharded: bool
    copies: bool  # a sharded job with copy ranks (spec §20.2): rank 0 compares their digests
    commit_timeout: float
    mirror_timeout: float
    # Filled from the live objects and the chain's schema:
    cuda: bool
    device_type: str
    params: list[torch.Tensor]
    param_names: list[str]
    buffer_names: list[str]
    buffer_keys: set[str]  # forward may change them: never lazy
    in_pieces: bool  # xor: one staging set does not fit max_host_bytes, so each step is read in pieces
    # The pipeline (docs/capture-runtime.md "Pipeline"):
    stats: CaptureStats
    tuning: Tuning
    cadence: Cadence
    stager: Stager
    pool: BufferPool
    lazy: LazySnapshots
    pieces: PieceReading
    writer: ChainWriter
    replica: Replica | None
    background: BackgroundWriter
    hooks: Hooks
    # Data-parallel and sharded peers (docs/capture-runtime.md "Data parallel and sharded jobs"):
    rank_extras: RankExtras | None
    exchanges: ExchangeThread | None
    committer: Committer | None
    mirror: Mirror | None
    # From the front, which owns the user's extra and the data position:
    raw_extra: RawExtra
    data_state: Callable[[], dict[str, Any] | None]
    digest: Callable[[], str | None]

    def raise_if_failed(self) -> None:
        """Raise the background writer's failure, if it failed, on the training thread."""
        error = self.background.error
        if error is not None:
            raise LdformatError(f"{self.path}: the checkpoint writer failed: {error}") from error
