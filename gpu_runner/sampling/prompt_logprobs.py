"""Prompt logprobs: which fed rows of a step are scored, and their logprobs from those rows'
logits (they follow the sampled rows' logits in the step's output)."""

from __future__ import annotations

import numpy as np
import torch

from gapless.common.messages import NewSlot, PromptLogprobs, SampleLogprobs
from gapless.gpu_runner.batch import StepInputs


class PromptScores:
    def __init__(self, max_slots: int, max_logprobs: int) -> None:
        self.max_logprobs = max_logprobs
        # per slot: positions below this are scored (0: not asked), top k, and the prompt ids
        # (the targets)
        self.scored_until = np.zeros(max_slots, dtype=np.int64)
        self.top = np.zeros(max_slots, dtype=np.int64)
        self.prompt_ids: dict[int, np.ndarray] = {}

    def add(self, new: NewSlot) -> None:
        if new.params.prompt_logprobs is not None and new.prompt_token_ids:
            self.prompt_ids[new.slot] = np.asarray(new.prompt_token_ids, np.int64)
            self.scored_until[new.slot] = len(new.prompt_token_ids)
            self.top[new.slot] = min(new.params.prompt_logprobs, self.max_logprobs)

    def remove(self, slot: int) -> None:
        self.scored_until[slot] = 0
        self.prompt_ids.pop(slot, None)

    def asked(self) -> np.ndarray | None:
        """scored_until, where some slot asks (what PersistentBatch.prepare takes)."""
        return self.scored_until if self.prompt_ids else None

    def score(self, inp: StepInputs, logits: torch.Tensor) -> list[PromptLogprobs]:
        """Prompt logprobs of the scored rows (logits [P, V]), one PromptLogprobs per run of
        consecutive rows of a slot. Host lists: this waits for the device."""
        if not inp.num_scored:
            return []
        assert inp.scored_slots_host is not None and inp.scored_positions_host is not None
        slots, positions = inp.scored_slots_host, inp.scored_positions_host
        targets = np.asarray(
            [self.prompt_ids[s][p] for s, p in zip(slots, positions, strict=True)], np.int64
        )
        k = int(self.top[slots].max())
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [P, 1]
        target = torch.from_numpy(targets).to(logits.device)[:, None]
        chosen = (logits.gather(1, target) - lse).squeeze(1).tolist()
        top_vals, top_ids = logits.topk(k, dim=-1) if k else (lse[:, :0], lse[:, :0].long())
        top_lp, top_id = (top_vals - lse).tolist(), top_ids.tolist()
        out: list[PromptLogprobs] = []
        for j in range(len(slots)):
            slot, kk = int(slots[j]), int(self.top[slots[j]])
            lp = SampleLogprobs(chosen[j], top_id[j][:kk], top_lp[j][:kk])
            last = out[-1] if out else None
            if (
                last is not None
                and last.slot == slot
                and last.start + len(last.token_ids) == positions[j]
            ):
                last.token_ids.append(int(targets[j]))
                last.logprobs.append(lp)
            else:
                out.append(PromptLogprobs(slot, int(positions[j]), [int(targets[j])], [lp]))
        return out
