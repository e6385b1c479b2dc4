"""Training text packed into fixed windows, and a seeded, resumable order over them.

The token stream (:func:`mha2gqa.core.text.token_stream`: documents joined, one BOS) is cut into
``[seq_len + 1]`` windows that overlap by one token, so that every token after the first is a
target exactly once per epoch: inputs ``w[:-1]``, targets ``w[1:]``. The order of windows is a
fresh permutation per epoch drawn from ``(seed, epoch)`` alone, so the batch of any step is known
without replaying the ones before it (what makes ``--resume`` exact).
"""

from __future__ import annotations

import torch

from mha2gqa.core.errors import Mha2GqaError


def pack_windows(ids: torch.Tensor, seq_len: int, source: str = "--data") -> torch.Tensor:
    """The 1-D ``ids`` ``[N]`` as ``[W, seq_len + 1]`` windows starting every ``seq_len`` tokens
    (a partial last window is dropped). Raises :class:`Mha2GqaError` when not even one fits."""
    if seq_len < 2:
        raise Mha2GqaError("--seq-len must be at least 2")
    count = (ids.numel() - 1) // seq_len
    if count < 1:
        raise Mha2GqaError(
            f"{source}: {ids.numel()} tokens, too little text for one training window of {seq_len} tokens; "
            "give more text or a smaller --seq-len"
        )
    starts = torch.arange(count) * seq_len
    return ids[starts[:, None] + torch.arange(seq_len + 1)]


class WindowOrder:
    """Which windows each optimizer step reads: step ``s`` takes global positions
    ``[s * batch, (s + 1) * batch)`` of the concatenated per-epoch permutations."""

    def __init__(self, num_windows: int, batch_size: int, seed: int):
        self.num_windows = num_windows
        self.batch_size = batch_size
        self.seed = seed
        self._cache: dict[int, torch.Tensor] = {}

    def permutation(self, epoch: int) -> torch.Tensor:
        """``[num_windows]`` window indices of one epoch."""
        if epoch not in self._cache:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._cache = {epoch: torch.randperm(self.num_windows, generator=g)}
        return self._cache[epoch]

    def batch(self, step: int) -> torch.Tensor:
        """``[batch_size]`` window indices of optimizer step ``step`` (0-based)."""
        out = []
        pos, need = step * self.batch_size, self.batch_size
        while need:
            epoch, offset = divmod(pos, self.num_windows)
            take = min(need, self.num_windows - offset)
            out.append(self.permutation(epoch)[offset : offset + take])
            pos, need = pos + take, need - take
        return torch.cat(out)

    def epoch(self, step: int) -> float:
        """Epochs completed after ``step`` steps (fractional)."""
        return step * self.batch_size / self.num_windows
