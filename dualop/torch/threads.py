"""torch's CPU thread count beside busy cores: the torch engine's steps run with it lowered to the
team the C++ CPU kernels would run on (``dualop.kernels.cpu.common.team_size``), so torch's own ops
(the GEMMs) give up the cores other processes keep busy as the kernels do."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from dualop.kernels.cpu import common

__all__ = ["threads_beside_busy_cores"]


@contextlib.contextmanager
def threads_beside_busy_cores() -> Iterator[int]:
    """torch's CPU thread count lowered, for the block, to ``team_size`` of it (restored after), so
    torch's own ops (the GEMMs) leave the cores other processes keep busy as dualop's kernels do.
    Yields the count the block runs with."""
    import torch

    configured = torch.get_num_threads()
    team = common.team_size(configured) if configured > 1 else configured
    if team == configured:
        yield configured
        return
    torch.set_num_threads(team)
    try:
        yield team
    finally:
        torch.set_num_threads(configured)
