"""`gapless bench spec-tenants`: a copying tenant and a chatting one, equal weights, on sim.

C's requests carry a `prediction` (each decode step verifies up to k drafts, accepted at the
sim profile's `spec_acceptance`), H's chat (one token a step, nothing to copy). Both send their
requests at once, more than the seats hold. Tenants are charged for the tokens the device
verified (prompt tokens fed, each sampled token and every draft checked, accepted or not), so
while both have requests waiting the fair policy should give each half of them. The real
EngineCore drives the sim device in one process (as `bench core_overhead`); the tokens are
counted from the plans and the results, not from the policy's counters. Every figure is sim.

    python -m gapless.bench.cli spec-tenants --requests 200 --max-tokens 128
"""

from __future__ import annotations

import argparse
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from gapless.common.config import EngineConfig
from gapless.common.messages import AddRequest, SamplingParams
from gapless.core.engine import EngineCore

TENANTS = ("C", "H")  # copying, chatting


@dataclass
class Shares:
    """Tokens the device verified per tenant while both waited, and what each got out."""

    window_steps: int = 0
    output_weight: float = 2.0  # what the fair policy charges an output token, a prompt's 1
    # in the backlogged window: tokens sampled and drafts checked; prompt tokens fed
    verified: dict[str, int] = field(default_factory=dict)
    prompt: dict[str, int] = field(default_factory=dict)
    done: dict[str, int] = field(default_factory=dict)  # requests finished in the window
    output: dict[str, int] = field(default_factory=dict)  # output tokens received in it
    accepted: int = 0  # drafts accepted and verified over the whole run
    drafted: int = 0

    def service(self, tenant: str) -> float:
        """What the fair policy counts: prompt tokens, and output_weight per token verified."""
        return self.prompt.get(tenant, 0) + self.output_weight * self.verified.get(tenant, 0)

    def share(self, tenant: str) -> float:
        total = sum(self.service(t) for t in TENANTS)
        return self.service(tenant) / total if total else 0.0

    @property
    def ratio(self) -> float:
        """The smaller tenant's service over the larger's (1: equal)."""
        c, h = (self.service(t) for t in TENANTS)
        return min(c, h) / max(c, h) if max(c, h) else 0.0


def add_requests(core: EngineCore, num_requests: int, prompt_len: int, max_tokens: int) -> None:
    """num_requests per tenant, alternating, distinct prompts (no cached block shared); C's
    with a prediction of 2 x max_tokens ids."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    prediction = list(range(500, 500 + 2 * max_tokens))
    for k in range(num_requests):
        for tenant in TENANTS:
            prompt = [3000 + (2 * k + (tenant == "H")) * prompt_len + i for i in range(prompt_len)]
            core.handle(
                AddRequest(
                    request_id=f"{tenant}-{k}",
                    frontend_id=0,
                    prompt_token_ids=prompt,
                    params=params,
                    arrival_time=time.time(),
                    tenant=tenant,
                    prediction=prediction if tenant == "C" else [],
                )
            )


def run(config: EngineConfig, num_requests: int, prompt_len: int, max_tokens: int) -> Shares:
    """Every request to its end; the shares over the steps at which both tenants waited."""
    from gapless.common.messages import TokenBatch
    from gapless.gpu_runner.backend import make_backend

    backend = make_backend(config)
    core = EngineCore(config, backend.num_blocks, step_costs=backend.step_costs)
    rb = core.scheduler.rb
    add_requests(core, num_requests, prompt_len, max_tokens)
    steps: list[tuple[bool, Counter[str], Counter[str], Counter[str], Counter[str]]] = []
    inflight: deque = deque()
    result, out = None, Shares(output_weight=config.fair_output_weight)
    while core.has_work or inflight or result is not None:
        verified: Counter[str] = Counter()  # tokens sampled and drafts checked, by tenant
        fed: Counter[str] = Counter()  # prompt tokens computed, by tenant
        if result is not None:  # it answers the oldest step in flight
            applied = core.inflight[0]
            drafted = result.num_drafted or [0] * len(applied.sampled)
            for req, d in zip(applied.sampled, drafted, strict=True):
                verified[req.tenant] += 1 + d
            out.drafted += sum(drafted)
            out.accepted += sum(result.counts) - len(result.counts) if result.counts else 0
        sent = core.step(result)
        for step in list(core.inflight)[len(core.inflight) - len(sent.plans) :]:
            p = step.plan
            for slot, n, has_tokens in zip(p.slots, p.num_tokens, p.has_tokens, strict=True):
                if has_tokens:  # prompt tokens (a recompute too: the device computes it again)
                    fed[rb.req[slot].tenant] += n  # type: ignore[union-attr]
        got: Counter[str] = Counter()  # output tokens sent on, by tenant
        done: Counter[str] = Counter()  # requests ended
        for msg in sent.detok:
            if isinstance(msg, TokenBatch):
                for rid, n, why in zip(msg.request_ids, msg.counts, msg.finish_reasons,
                                       strict=True):  # fmt: skip
                    got[rid[0]] += n
                    done[rid[0]] += bool(why)
        both = {r.tenant for r in core.scheduler.waiting_requests()} >= set(TENANTS)
        steps.append((both, verified, fed, got, done))
        inflight.extend(backend.launch(plan) for plan in sent.plans)
        result = backend.collect(inflight.popleft()) if inflight else None
    window = [k for k, (both, *_) in enumerate(steps) if both]
    if window:
        first, last = window[0], window[-1] + 1
        out.window_steps = last - first
        for _, verified, fed, got, done in steps[first:last]:
            for t in TENANTS:
                out.verified[t] = out.verified.get(t, 0) + verified[t]
                out.prompt[t] = out.prompt.get(t, 0) + fed[t]
                out.output[t] = out.output.get(t, 0) + got[t]
                out.done[t] = out.done.get(t, 0) + done[t]
    return out


def main(argv: list[str]) -> int:
    from gapless.common.model_files import resolve_model

    p = argparse.ArgumentParser(prog="gapless bench spec-tenants", description=__doc__)
    p.add_argument("--requests", type=int, default=200, help="per tenant (200)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=4, help="--num-speculative-tokens (4)")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--sim-profile", default="h100-llama3-8b")
    p.add_argument("--policy", default="fair", choices=("fair", "fcfs"))
    p.add_argument("--model", help="the tokenizer's model (default: SmolLM2-135M-Instruct)")
    args = p.parse_args(argv)
    if min(args.requests, args.prompt_len, args.max_tokens, args.max_num_seqs) < 1:
        p.error("--requests, --prompt-len, --max-tokens and --max-num-seqs must be at least 1")
    config = EngineConfig(
        model=resolve_model(args.model),
        served_model_name="sim",
        device="sim",
        sim_profile=args.sim_profile,
        sim_time_scale=0.01,  # the plans and counts do not depend on the step's length
        max_num_seqs=args.max_num_seqs,
        num_speculative_tokens=args.k,
        scheduling_policy=args.policy,
    )
    got = run(config, args.requests, args.prompt_len, args.max_tokens)
    print(f"spec-tenants (sim, {args.sim_profile}, {args.policy}): {args.requests} requests "
          f"per tenant of {args.prompt_len}:{args.max_tokens}, k={args.k}, "
          f"{args.max_num_seqs} seats; drafts accepted {got.accepted}/{got.drafted}")  # fmt: skip
    print(f"both waiting for {got.window_steps} steps; in them:")
    print(f"{'tenant':<11}{'prompt':>8}{'verified':>10}{'service':>10}{'share':>7}"
          f"{'output':>8}{'done':>6}")  # fmt: skip
    for t, name in zip(TENANTS, ("C (copies)", "H (chats)"), strict=True):
        print(f"{name:<11}{got.prompt.get(t, 0):>8}{got.verified.get(t, 0):>10}"
              f"{got.service(t):>10.0f}{got.share(t):>7.3f}{got.output.get(t, 0):>8}"
              f"{got.done.get(t, 0):>6}")  # fmt: skip
    print(f"service (prompt + {got.output_weight:g} x verified), smaller / larger: "
          f"{got.ratio:.3f} (sim)")  # fmt: skip
    return 0
