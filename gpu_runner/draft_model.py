"""The `draft` method: a smaller model beside the target proposes each drafting row's next tokens.

The draft model has its own KV cache of the target's blocks (the same block ids, the same
block tables), so a slot's draft KV lives where its target KV does and needs no allocation of
its own. `length[slot]` is how many of the slot's positions hold draft KV computed from its
true tokens. When a step that verifies drafts is prepared, the draft catches up each drafting
row from there to its last sampled token in one forward (the prompt, then the tokens accepted
since), and runs one forward per further draft, batched over the rows still drafting: k
forwards for k drafts. The draft KV of drafted positions is not counted in `length`, so a
rejected draft's KV is simply written again by the next catch-up: rolling back the draft's
cache is forgetting a count, as for the target.

Greedy rows draft the draft model's argmax, and are verified exactly (gpu_runner/verify.py).
Sampled rows draw each draft from q, the draft's distribution under the row's temperature,
top_k and top_p (gpu_runner/sampling/rejection.py's filtered_probs), and keep q for the
rejection sampling that verifies them. Draws use counter-based uniforms of (seed, position)
for seeded rows, so a seeded request drafts alike in any batch. The draft runs no adapter and
no grammar: a LoRA row drafts with the base draft model, and its verify uses the adapter.
"""

from __future__ import annotations

import numpy as np
import torch

from gapless.gpu_runner.attention import Attention, StepLayout
from gapless.gpu_runner.batch import PersistentBatch
from gapless.gpu_runner.kv_cache import KVCache
from gapless.gpu_runner.model import CausalLM
from gapless.gpu_runner.sampling.draws import mix64, signed
from gapless.gpu_runner.sampling.rejection import draw, filtered_probs

# salts of the uniforms a sampled row draws at one position: its draft, the acceptance test,
# the draw from the residual
DRAFT_SALT, ACCEPT_SALT, RESIDUAL_SALT = (signed(s, 64) for s in (0x5EED01, 0x5EED02, 0x5EED03))


def uniforms(seed_keys: torch.Tensor, positions: torch.Tensor, salt: int) -> torch.Tensor:
    """[B] float64 in [0, 1): a hash of each row's key [B] int64 and position [B] int64."""
    x = mix64(mix64(seed_keys ^ salt) ^ positions)
    return (x >> 11).bitwise_and_((1 << 53) - 1).to(torch.float64) * 2.0**-53


class DraftModel:
    def __init__(
        self, model: CausalLM, kv_cache: KVCache, attention: Attention, batch: PersistentBatch
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache  # per layer (K, V), the target's blocks, the draft's shape
        self.attn = attention
        self.batch = batch  # the target's: its block tables
        self.length = np.zeros(len(batch.active), dtype=np.int64)  # [slots] draft KV kept

    def reset(self, slot: int) -> None:
        """A new request in the slot: none of its draft KV is known."""
        self.length[slot] = 0

    def _forward(self, slots: np.ndarray, ids: list[list[int]], start: np.ndarray) -> torch.Tensor:
        """The draft over each entry's ids [n_j] from position start[j]; [E, vocab] float32
        logits of each entry's last token."""
        bs = self.batch.block_size
        n = np.fromiter(map(len, ids), np.int64, len(ids))  # [E]
        ends = np.cumsum(n)
        entry = np.repeat(np.arange(len(n)), n)  # [T]
        positions = start[entry] + np.arange(int(ends[-1])) - (ends - n)[entry]  # [T]
        tok_slot = slots[entry]
        rows = self.batch.block_table[tok_slot, positions // bs] * bs + positions % bs  # [T]
        ctx = start + n
        pages = -(-int(ctx.max()) // bs)
        layout = StepLayout(n, ctx, self.batch.block_table[slots, :pages].copy(), bs)
        meta = self.attn.build(layout, torch.from_numpy(rows))
        input_ids = torch.tensor([i for row in ids for i in row], dtype=torch.long)
        logit_rows = torch.from_numpy(ends - 1)
        return self.model(input_ids, torch.from_numpy(positions), self.kv_cache, meta, logit_rows)

    @torch.inference_mode()
    def propose(
        self,
        slots: np.ndarray,
        ks: np.ndarray,
        tokens: list[list[int]],
        params: tuple[torch.Tensor, ...],
    ) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Drafts for entries slots [E] (each ks[j] >= 1 of them) after tokens[j], the slot's
        tokens so far (its last one sampled, not yet in any KV). params: the rows' temperature,
        top_k, top_p, seed and has-seed [E] (SamplerState.draw_params). Returns each entry's
        drafts and, for a sampled row, q [ks[j], vocab] float32 of its drafts (None: greedy)."""
        temp, top_k, top_p, seed, has_seed = params
        last = np.fromiter(map(len, tokens), np.int64, len(tokens)) - 1  # [E] last token's position
        start = self.length[slots]
        assert (start <= last).all(), "draft KV ahead of the slot's tokens"
        logits = self._forward(
            slots, [t[s:] for t, s in zip(tokens, start.tolist(), strict=True)], start
        )
        self.length[slots] = last + 1
        # why fresh keys for unseeded rows: their draws need only be independent
        keys = torch.where(has_seed, seed, torch.randint(-(2**62), 2**62, seed.shape))
        greedy = temp <= 0
        drafts: list[list[int]] = [[] for _ in slots]
        probs: list[list[torch.Tensor]] = [[] for _ in slots]
        going = np.arange(len(slots))
        for i in range(int(ks.max())):
            g = torch.from_numpy(going)
            picked = logits.argmax(dim=-1)  # [G]
            sampled = torch.nonzero(~greedy[g]).squeeze(1)  # [S] rows of going
            if len(sampled):
                s = g[sampled]
                q = filtered_probs(logits[sampled], temp[s], top_k[s], top_p[s],
                                   bool((top_k[s] > 0).any()), bool((top_p[s] < 1).any()))  # fmt: skip
                pos = torch.from_numpy(last[s.numpy()] + 1 + i)
                picked[sampled] = draw(q, uniforms(keys[s], pos, DRAFT_SALT))
                for row, j in enumerate(s.tolist()):
                    probs[j].append(q[row])
            for j, token in zip(going.tolist(), picked.tolist(), strict=True):
                drafts[j].append(token)
            going = going[ks[going] > i + 1]
            if not len(going):
                break
            fed = [[drafts[j][-1]] for j in going.tolist()]
            logits = self._forward(slots[going], fed, last[going] + 1 + i)
        q_out = [None if bool(greedy[j]) else torch.stack(probs[j]) for j in range(len(slots))]
        return drafts, q_out
