"""The gpu_runner process entry."""

from __future__ import annotations

import time
import traceback
from collections import deque
from typing import TYPE_CHECKING

import zmq

from gapless.common.channel import Receiver, Sender, Subscriber
from gapless.common.config import EngineConfig
from gapless.common.messages import (
    DropAdapter,
    ReadAdapter,
    RunnerInput,
    RunnerOutput,
    RunnerReady,
    Shutdown,
    StepRefused,
)
from gapless.common.metrics import rank_busy_counter
from gapless.common.process import (
    RUNNER_IN,
    RUNNER_OUT,
    ControlReporter,
    plan_endpoint,
    stop_requested,
)
from gapless.gpu_runner.cpu.threads import set_wait_policy
from gapless.gpu_runner.plan_check import PlanCheck

if TYPE_CHECKING:
    from gapless.gpu_runner.lora.reader import AdapterReader

IDLE_POLL_S = 0.1
READ_POLL_S = 0.005  # s: how often an idle loop looks whether an adapter's read has ended


def _until_ready(backend, step) -> float:
    return 0.0 if isinstance(step, StepRefused) else backend.seconds_until_ready(step)


class _NoResults:
    """Where a tensor-parallel rank other than 0 publishes: nowhere (rank 0 speaks for all)."""

    def send(self, msg: RunnerOutput) -> None:
        pass

    def close(self) -> None:
        pass


def _adapter_reader(config: EngineConfig, backend) -> AdapterReader | None:
    """What reads adapters at run time for this runner (--enable-lora), else None."""
    if not config.enable_lora:
        return None
    from gapless.common.model_files import load_arch
    from gapless.gpu_runner.lora.reader import AdapterReader

    executor = getattr(backend, "executor", None)
    stack = getattr(executor, "lora", None)
    arch = getattr(backend, "arch", None) or load_arch(config.model)
    return AdapterReader(arch, config.max_lora_rank, stack)


def run_gpu_runner(config: EngineConfig, rank: int = 0) -> None:
    """Loads the model, reports its KV capacity, then runs plans strictly in order.

    The loop launches every plan that has arrived before it publishes the oldest finished
    step, so a plan for step n+1 reaches the device while step n's ids are still being copied,
    and it waits for plans, never sleeps, while a step runs.

    With --tensor-parallel-size N, N of these run, rank 0..N-1: each reads every plan from the
    core's publisher and runs every step; only rank 0 reports READY and sends results.
    """
    ctx = zmq.Context()
    control = ControlReporter(ctx, config, "gpu_runner" if rank == 0 else f"gpu_runner{rank}")
    plans: Receiver[RunnerInput]
    if config.num_ranks > 1:
        plans = Subscriber(ctx, plan_endpoint(config), RunnerInput)
    else:
        plans = Receiver(ctx, config.engine_ipc(RUNNER_IN), RunnerInput)
    results: Sender[RunnerOutput] | _NoResults = _NoResults()
    if rank == 0:
        results = Sender(ctx, config.engine_ipc(RUNNER_OUT), shm=True)
    try:
        if config.device == "cpu":
            set_wait_policy(config.cpu_wait)  # why first: torch reads it when it loads
        from gapless.gpu_runner.backend import make_backend

        backend = make_backend(config, rank)
        check = PlanCheck(config, backend.batch, backend.num_blocks)
        tokens, seconds = getattr(backend, "step_costs", ([], []))
        results.send(RunnerReady(backend.num_blocks, tokens, seconds))
        if rank == 0:  # cuda: the KV cache's bytes, the memory budget, the stages' ms as well
            control.ready(num_kv_blocks=backend.num_blocks, **getattr(backend, "ready_info", {}))
        inflight: deque = deque()
        busy = rank_busy_counter(config.replica, rank)
        reader = _adapter_reader(config, backend)
        while not stop_requested():
            # 1. launch every plan that is waiting; wait for one no longer than the oldest
            #    step has left, so no plan waits while the device runs and nothing is late
            wait_s = _until_ready(backend, inflight[0]) if inflight else IDLE_POLL_S
            if reader is not None and reader.busy:
                wait_s = min(wait_s, READ_POLL_S)
            if plans.wait(wait_s):
                for msg in plans.drain():
                    if isinstance(msg, ReadAdapter | DropAdapter):
                        assert reader is not None, "an adapter without --enable-lora"
                        reader.handle(msg)
                        continue
                    if isinstance(msg, Shutdown):
                        if config.num_ranks > 1:
                            from gapless.gpu_runner.tensor_parallel import leave_group

                            leave_group()
                        return
                    # why first: a plan the batch cannot run changes nothing; its refusal
                    # takes the step's place in line, so the core learns of it in order. One
                    # out of sequence is only counted: no core awaits its result
                    in_line = msg.seq == check.last_seq + 1
                    why = check.refusal(msg)
                    if why is None:
                        inflight.append(backend.launch(msg))
                    elif in_line:
                        inflight.append(StepRefused(msg.seq, why))
            elif not inflight and isinstance(plans, Subscriber) and plans.lost():
                raise RuntimeError("the core's plans stopped: host 0's engine is gone")
            # 2. adapters read since: kept between steps, announced to the core
            for answer in reader.finished() if reader is not None else ():
                results.send(answer)
            # 3. publish the oldest step once its ids are on the host
            if inflight and _until_ready(backend, inflight[0]) <= 0:
                step = inflight.popleft()
                if isinstance(step, StepRefused):
                    results.send(step)
                    continue
                out = backend.collect(step)
                if out.timing is not None:
                    busy.inc(max(0.0, out.timing.device_end - out.timing.device_start))
                results.send(out)
    except Exception as e:
        control.fatal(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        time.sleep(0.2)
        raise
    finally:
        control.close()
        ctx.destroy(linger=0)
