"""The gpu_runner process entry."""

from __future__ import annotations

import time
import traceback

import zmq

from core.channel import Receiver, Sender
from core.config import EngineConfig
from core.messages import RunnerInput, RunnerOutput, RunnerReady, Shutdown, StepPlan
from core.process import RUNNER_IN, RUNNER_OUT, ControlReporter, stop_requested


def run_gpu_runner(config: EngineConfig) -> None:
    """Loads the model, reports its KV capacity, then runs plans strictly in order."""
    ctx = zmq.Context()
    control = ControlReporter(ctx, config, "gpu_runner")
    plans: Receiver[RunnerInput] = Receiver(ctx, config.ipc(RUNNER_IN), RunnerInput)
    results: Sender[RunnerOutput] = Sender(ctx, config.ipc(RUNNER_OUT))
    try:
        from gpu_runner.runner import ModelRunner

        runner = ModelRunner(config)
        results.send(RunnerReady(num_kv_blocks=runner.num_blocks, max_num_seqs=config.max_num_seqs))
        control.ready(num_kv_blocks=runner.num_blocks)
        while not stop_requested():
            match plans.recv(timeout_ms=100):
                case StepPlan() as plan:
                    results.send(runner.execute(plan))
                case Shutdown():
                    break
    except Exception as e:
        control.fatal(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        time.sleep(0.2)
        raise
    finally:
        control.close()
        ctx.destroy(linger=0)
