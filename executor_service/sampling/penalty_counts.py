"""Token counts for penalties, kept across steps.

Repetition, presence and frequency penalties read which tokens a request has seen and how often
it produced each. Counting them from the token lists every step costs time in proportion to the
context; here a request's prompt is counted once when it arrives and each sampled token is added
after its step, so a step's penalty work is one gather of its penalised rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class PenaltyCounts:
    """One row per penalised request: its output token counts and which prompt tokens it has.
    Rows are reused after release; the tables grow by doubling.

    host_output: the output counts as numpy, on the CPU, where C may add to them (rows
    [*, vocab_size] float32, C-contiguous); None on other devices."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._output = torch.zeros(0, vocab_size, device=device)
        self._prompt_seen = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self._free: list[int] = []
        self._one = torch.ones((), device=device)
        self.host_output = self._host_view()

    def add(self, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]) -> int:
        """A row for a request with these tokens so far."""
        if not self._free:
            self._grow()
        row = self._free.pop()
        self._output[row] = self._count(output_token_ids)
        self._prompt_seen[row] = self._count(prompt_token_ids) > 0
        return row

    def release(self, row: int) -> None:
        self._free.append(row)

    def clear(self) -> None:
        self._output = self._output[:0]
        self._prompt_seen = self._prompt_seen[:0]
        self._free.clear()
        self.host_output = self._host_view()

    def record(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """One more output of token_ids[i] in rows[i] (int64 tensors on the counts' device); a
        row may repeat, each of its entries counting."""
        self._output.index_put_((rows, token_ids), self._one, accumulate=True)

    def gather(
        self, rows: torch.Tensor, ahead: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The output counts and prompt-seen marks of these rows, copied (a row may repeat).
        ahead: (places, token_ids), outputs not recorded yet: gathered row places[i] counts one
        more token_ids[i], in the copy only (a verify step's drafts, before they are accepted)."""
        output = self._output[rows]
        if ahead is not None:
            output.index_put_(ahead, self._one, accumulate=True)
        return output, self._prompt_seen[rows]

    def _count(self, token_ids: Sequence[int]) -> torch.Tensor:
        tokens = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        return torch.bincount(tokens, minlength=self.vocab_size).float()

    def _grow(self) -> None:
        old = self._output.shape[0]
        new = max(8, old * 2)
        self._output = torch.cat([self._output, torch.zeros(new - old, self.vocab_size, device=self.device)])
        self._prompt_seen = torch.cat(
            [self._prompt_seen, torch.zeros(new - old, self.vocab_size, dtype=torch.bool, device=self.device)]
        )
        self._free.extend(range(new - 1, old - 1, -1))
        self.host_output = self._host_view()

    def _host_view(self) -> np.ndarray | None:
        """The output counts as a numpy array sharing their memory where they are on the CPU,
        for RowKernels to count a steady step's tokens in place; None elsewhere."""
        return self._output.numpy() if self._output.device.type == "cpu" else None
