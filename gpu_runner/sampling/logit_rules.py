"""Per-request changes to the logits before sampling: logit_bias, allowed_token_ids, bad_words
and min_tokens.

Only the rows that asked for one pay for it: the host knows which slots have rules, so a
batch without any costs one numpy lookup. Nothing here syncs with the device: conditions that
depend on a row's position (min_tokens, a bad word's prefix) are computed on the device.
"""

from __future__ import annotations

import numpy as np
import torch

from gapless.common.messages import SamplingParams

HISTORY = 32  # output ids kept per slot for bad-word prefixes; longer bad words are cut to fit


class LogitRules:
    def __init__(self, max_slots: int, vocab_size: int, device: torch.device, eos: tuple[int, ...]):
        self.vocab_size = vocab_size
        self.device = device
        self._eos = tuple(eos)
        # slot -> what is added to its logits: a [V] float32 row, or (ids, values) where few
        # ids change (a bias, one-id bad words)
        self._static: dict[int, torch.Tensor | tuple[torch.Tensor, torch.Tensor]] = {}
        self._min_ids: dict[int, torch.Tensor] = {}  # slot -> ids masked before min_tokens
        self._words: dict[int, list[tuple[torch.Tensor, int]]] = {}  # slot -> (prefix, last id)
        self.has_any = np.zeros(max_slots, bool)
        self.has_words = np.zeros(max_slots, bool)
        # a rule that depends on the step (min_tokens, a bad word of several ids); the others'
        # rows are constant and need nothing recorded
        self.has_dynamic = np.zeros(max_slots, bool)
        self._min_tokens = torch.zeros(max_slots, dtype=torch.int64, device=device)
        # [max_slots, HISTORY] int64: output id at position p is at column p % HISTORY
        self._history = torch.full((max_slots, HISTORY), -1, dtype=torch.int64, device=device)

    def add(self, slot: int, params: SamplingParams) -> None:
        self.remove(slot)
        static = self._static_row(params)
        if static is not None:
            self._static[slot] = static
        if params.min_tokens > 0:
            ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self._eos))
            if ids:
                self._min_ids[slot] = torch.tensor(sorted(ids), device=self.device)
                self._min_tokens[slot] = params.min_tokens
        words = [w[-HISTORY - 1 :] for w in params.bad_words_ids if len(w) > 1]
        if words:
            self._words[slot] = [(torch.tensor(w[:-1], device=self.device), w[-1]) for w in words]
            self._history[slot] = -1
            self.has_words[slot] = True
        self.has_dynamic[slot] = slot in self._min_ids or bool(words)
        self.has_any[slot] = slot in self._static or self.has_dynamic[slot]

    def remove(self, slot: int) -> None:
        self._static.pop(slot, None)
        self._min_ids.pop(slot, None)
        self._words.pop(slot, None)
        self.has_any[slot] = self.has_words[slot] = self.has_dynamic[slot] = False

    def _static_row(
        self, params: SamplingParams
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
        """What a row adds to its logits: a dense [V] float32 row (bias, -inf outside
        allowed_token_ids, -inf on one-token bad words), or, without allowed_token_ids, the ids
        and values it changes. why sparse: a client that ignores EOS bans it by a bias every
        request, and a dense row is two [V] passes a step."""
        singles = [w[0] for w in params.bad_words_ids if len(w) == 1]
        if not (params.logit_bias or params.allowed_token_ids is not None or singles):
            return None
        if params.allowed_token_ids is None:
            change: dict[int, float] = {}
            for token_id, bias in params.logit_bias:
                change[token_id] = change.get(token_id, 0.0) + bias
            for token_id in singles:
                change[token_id] = -torch.inf
            ids = torch.tensor(list(change), dtype=torch.int64, device=self.device)
            values = torch.tensor(list(change.values()), dtype=torch.float32, device=self.device)
            return ids, values
        row = torch.full((self.vocab_size,), -torch.inf, dtype=torch.float32)
        row[list(params.allowed_token_ids)] = 0.0
        for token_id, bias in params.logit_bias:
            row[token_id] += bias
        if singles:
            row[singles] = -torch.inf
        return row.to(self.device)

    @staticmethod
    def _add(row: torch.Tensor, static: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> None:
        """row [V] += a slot's constant rule, in place."""
        if isinstance(static, tuple):
            row.index_add_(0, *static)
        else:
            row += static

    def record(
        self,
        host_slots: np.ndarray,
        slots: torch.Tensor,
        positions: torch.Tensor,
        ids: torch.Tensor,
    ) -> None:
        """Remember output ids of slots with multi-token bad words: slots, positions, ids [N]."""
        if self.has_words[host_slots].any():
            self._history[slots, positions % HISTORY] = ids

    def apply(
        self,
        logits: torch.Tensor,
        host_slots: np.ndarray,
        positions: torch.Tensor,
        num_prompt: torch.Tensor,
        inplace: bool = False,
    ) -> torch.Tensor:
        """logits [B, V] float32 with every row's rules applied (in place when `inplace`, else
        a copy if any row has one).

        positions [B]: the position each row's new token takes; num_prompt [B] its prompt length.
        """
        if not self.has_any[host_slots].any():
            return logits
        x = logits if inplace else logits.clone()
        self.apply_static(x, host_slots)
        rows = np.flatnonzero(self.has_dynamic[host_slots])
        for j, slot in zip(rows.tolist(), host_slots[rows].tolist(), strict=True):
            ids = self._min_ids.get(slot)
            if ids is not None:
                early = positions[j] - num_prompt[j] < self._min_tokens[slot]  # device bool
                x[j, ids] = torch.where(early, -torch.inf, x[j, ids])
            for prefix, last in self._words.get(slot, ()):
                x[j, last] = torch.where(
                    self._ends_with(slot, prefix, positions[j], num_prompt[j]),
                    -torch.inf,
                    x[j, last],
                )
        return x

    def apply_static(self, logits: torch.Tensor, host_slots: np.ndarray) -> None:
        """Add each row's constant rule (bias, allowed ids, one-id bad words) to logits [B, V]
        float32, in place: all a batch without a step-dependent rule (has_dynamic) needs, and
        what apply() adds before those."""
        rows = np.flatnonzero(self.has_any[host_slots])
        for j, slot in zip(rows.tolist(), host_slots[rows].tolist(), strict=True):
            static = self._static.get(slot)
            if static is not None:
                self._add(logits[j], static)

    def _ends_with(
        self, slot: int, prefix: torch.Tensor, position: torch.Tensor, num_prompt: torch.Tensor
    ) -> torch.Tensor:
        """Device bool: the slot's last len(prefix) output ids are prefix."""
        m = prefix.numel()
        at = position - m + torch.arange(m, device=self.device)  # [m] positions of the prefix
        seen = self._history[slot, at % HISTORY]
        return (at >= num_prompt).all() & (seen == prefix).all()
