"""Applying a step's sampled ids: append them, charge them, and check for the whole batch at
once which requests end (EOS, stop token ids, length).

The step's rows are read through one view (core/rows.py): the rows still in their slots are
applied with array operations; rows whose request left its slot since the step was planned
(preempted, or finished with this extra sample in flight) are handed to the scheduler one by
one and checked through the same view, read off their Requests.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from gapless.common.messages import StepResult
from gapless.core.policy import Policy
from gapless.core.request import Request
from gapless.core.rows import Rows
from gapless.core.running import RunningBatch
from gapless.core.step import ScheduledStep, StepOutput

log = logging.getLogger("gapless.core")


def check_stop(
    rows: Rows, tokens: np.ndarray, num_out: np.ndarray, eos: np.ndarray
) -> tuple[list[str], np.ndarray]:
    """Why each row's request ends with its new id tokens[j] ("" if it goes on), and [R] bool
    whether it ends. num_out: [R] its output count with that id.

    A stop token (EOS unless ignore_eos, or one of its stop_token_ids) at or below min_len
    ends nothing: the sampler masks them there, this guards the devices that do not sample.
    A stop token wins over length: it ends the request either way and its text is withheld.
    """
    # why the special case: one EOS id is the usual case, and a 2-D compare costs more
    stop = tokens == eos[0] if len(eos) == 1 else (tokens[:, None] == eos).any(1)
    if stop.any():
        stop &= ~rows.ignore_eos
    if rows.any_stop_ids:
        requests = rows.requests
        for j in np.flatnonzero(rows.has_stop_ids).tolist():  # rows that gave stop_token_ids
            stop[j] |= int(tokens[j]) in requests[j].params.stop_token_ids
    num_tokens = rows.prompt_len + num_out
    length = num_tokens >= rows.limit
    if stop.any():
        stop &= num_tokens > rows.min_len
    elif not length.any():  # why: most steps end nothing, and the reasons below cost more
        return [""] * len(tokens), stop
    reasons = np.where(stop, "stop_token", np.where(length, "length", "")).tolist()
    return reasons, stop | length


class Applier:
    """Applies results to the running batch; `off_slot(req, token)` takes a sample of a
    request that left its slot and says whether it counts (False: dropped)."""

    def __init__(
        self,
        rb: RunningBatch,
        policy: Policy,
        eos: np.ndarray,
        scoring: set[Request],
        off_slot: Callable[[Request, int], bool],
    ) -> None:
        self.rb = rb
        self.policy = policy
        self.eos = eos  # [E] EOS ids
        self.scoring = scoring  # requests holding prompt logprobs not yet sent
        self.off_slot = off_slot

    def apply(self, step: ScheduledStep, result: StepResult) -> tuple[StepOutput, np.ndarray]:
        """The step's output, and [R] bool which of its requests end."""
        assert result.seq == step.plan.seq, f"result {result.seq} for plan {step.plan.seq}"
        if result.prompt_logprobs:
            _add_prompt_logprobs(step, result)
        rb, rows, out = self.rb, step.rows, StepOutput()
        tokens = np.asarray(result.token_ids, np.int64)
        run = None  # [R] first token of each row's run, when a row verified drafts
        if step.drafts is not None:
            run = _Runs(result, len(rows))
            tokens = run.first(tokens)
        kept = None  # rows still in their slots, when not all are
        if rb.num_released != step.num_released:  # a slot changed hands: is each row live?
            live = rb.epoch[rows.slots] == rows.epochs  # still the same request in that slot
            if not live.all():
                kept = np.flatnonzero(live)
        live_rows, t = (rows, tokens) if kept is None else (rows.take(kept), tokens[kept])
        num_out = rb.append(live_rows.slots, t)
        self.policy.charge_output_counts(live_rows.tenant_counts(len(self.policy.output_tokens)))
        reasons, ended = check_stop(live_rows, t, num_out, self.eos)
        if run is not None:
            assert step.drafts is not None
            live_drafts = step.drafts if kept is None else step.drafts[kept]
            rb.spec_extra[live_rows.slots] -= live_drafts
            run.extend(self, live_rows, kept, reasons, ended)
        requests = live_rows.requests
        if kept is not None:
            moved = self._apply_moved(rows, np.flatnonzero(~live), tokens)
            moved_rows = Rows.off_slot([rows.requests[j] for j in moved.tolist()])
            num_moved_out = np.fromiter(
                (len(r.output_ids) for r in moved_rows.requests), np.int64, len(moved)
            )
            moved_reasons, moved_ended = check_stop(
                moved_rows, tokens[moved], num_moved_out, self.eos
            )
            reasons += moved_reasons
            ended = np.concatenate([ended, moved_ended])
            kept = np.concatenate([kept, moved])
            requests = requests + moved_rows.requests
            t = tokens[kept]
        else:
            out.request_ids, out.num_prompt_tokens = rows.request_ids, rows.num_prompt_tokens
        out.requests, out.token_ids, out.end_reasons = requests, t.tolist(), reasons
        if result.logprobs:
            logprobs = result.logprobs
            if run is not None:
                logprobs = [logprobs[i] for i in run.firsts.tolist()]
            out.logprobs = list(logprobs) if kept is None else [logprobs[j] for j in kept.tolist()]
        if result.embeddings:
            vecs = result.embeddings
            out.embeddings = list(vecs) if kept is None else [vecs[j] for j in kept.tolist()]
        if run is not None and run.kept is not None:
            run.output(out, result, kept)
        if self.scoring:
            out.prompt_logprobs = [r.take_prompt_logprobs() for r in requests]
            self.scoring.difference_update(requests)
        return out, ended

    def _apply_moved(self, rows: Rows, moved: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Rows whose request left its slot since planning: each sample goes to the
        scheduler. Returns the rows whose samples count."""
        return np.asarray(
            [j for j in moved.tolist() if self.off_slot(rows.requests[j], int(tokens[j]))],
            np.int64,
        )


class _Runs:
    """A result whose rows verified drafts: row j's tokens are the counts[j] ids from
    firsts[j], its accepted drafts and then the token sampled after them. The first goes the
    usual way; the rest are appended together, each checked for a stop, so a stop inside a
    run ends it there. A row that left its slot keeps its first token only (a preempted
    request recomputes the rest, drawing them again)."""

    def __init__(self, result: StepResult, num_rows: int) -> None:
        counts = result.counts or [1] * num_rows  # none: no row had a draft to verify
        assert len(counts) == num_rows, "a verify result names every sampled row's count"
        self.counts = np.asarray(counts, np.int64)  # [R]
        self.firsts = np.cumsum(self.counts) - self.counts  # [R] index of each run's first id
        self.tokens = np.asarray(result.token_ids, np.int64)
        self.kept: np.ndarray | None = None  # [R'] tokens kept per output row, if any extra
        drafted = result.num_drafted or [0] * num_rows
        self.drafted = np.asarray(drafted, np.int64)  # [R] drafts each row verified

    def first(self, tokens: np.ndarray) -> np.ndarray:
        return tokens[self.firsts]

    def extend(
        self,
        applier: Applier,
        rows: Rows,
        kept: np.ndarray | None,
        reasons: list[str],
        ended: np.ndarray,
    ) -> None:
        """Append the live rows' accepted ids after their first; reasons and ended [R'] are
        updated in place where one ends the run."""
        counts = self.counts if kept is None else self.counts[kept]
        firsts = self.firsts if kept is None else self.firsts[kept]
        # tenants pay for what the device verified: every draft, accepted (an output) or not
        drafted = self.drafted if kept is None else self.drafted[kept]
        if drafted.any():
            n, policy = len(applier.policy.output_tokens), applier.policy
            accepted = counts - 1
            policy.charge_output_counts(np.bincount(rows.tenant_id, accepted, n).astype(np.int64))
            rejected = np.bincount(rows.tenant_id, drafted - accepted, n).astype(np.int64)
            policy.charge_rejected(rejected)
        extra = np.where(ended, 0, counts - 1)  # [R'] accepted ids after the first
        if not extra.any():
            return
        # every accepted id at once, row-major: [P] its row and place in the run after the first
        row, pos = np.nonzero(np.arange(int(extra.max()))[None, :] < extra[:, None])
        t = self.tokens[firsts[row] + 1 + pos]
        base = applier.rb.out_len[rows.slots]  # [R'] outputs with the first id
        more_reasons, more_ended = check_stop(rows.take(row), t, base[row] + 1 + pos, applier.eos)
        if more_ended.any():  # the first stop in each row's run ends it there
            hit = np.flatnonzero(more_ended)
            stopped, first = np.unique(row[hit], return_index=True)
            at = hit[first]
            extra[stopped] = pos[at] + 1
            ended[stopped] = True
            for j, p in zip(stopped.tolist(), at.tolist(), strict=True):
                reasons[j] = more_reasons[p]
            keep = pos < extra[row]
            row, pos, t = row[keep], pos[keep], t[keep]
        applier.rb.append_runs(rows.slots, extra, row, base[row] + pos, t)
        self.kept = extra + 1

    def output(self, out: StepOutput, result: StepResult, kept: np.ndarray | None) -> None:
        """Each live row's whole run in out (rows that left their slots: the first id)."""
        assert self.kept is not None
        firsts = self.firsts if kept is None else self.firsts[kept]  # live rows, then moved
        counts = self.kept
        if len(counts) < len(firsts):
            counts = np.concatenate([counts, np.ones(len(firsts) - len(counts), np.int64)])
        ends = np.cumsum(counts)
        index = np.arange(int(ends[-1])) + np.repeat(firsts - (ends - counts), counts)
        out.token_ids = self.tokens[index].tolist()
        if out.logprobs:
            lps = result.logprobs
            out.logprobs = [lps[i] for i in index.tolist()]
        out.counts = counts.tolist()


def _add_prompt_logprobs(step: ScheduledStep, result: StepResult) -> None:
    """Each scored chunk goes to the request the plan scored it for."""
    for piece in result.prompt_logprobs:
        scorer = step.scorers.get(piece.slot)
        if scorer is None:  # never expected: the runner scores the slots the plan names
            log.warning("prompt logprobs for slot %d, which step %d did not score",
                        piece.slot, step.plan.seq)  # fmt: skip
        else:
            scorer.add_prompt_logprobs(piece)
