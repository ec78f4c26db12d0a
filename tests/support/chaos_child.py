"""One run of the chaos test (tests/integration/test_chaos.py), in its own process so that the test can
SIGKILL it: `python chaos_child.py SPEC_JSON`. The spec names the run directory, whether to
resume, and the faults to inject; the process exits 0 when the run completed, 1 when it failed
(its summary.json says why)."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/, for `support`

from relayrl.backends.sim.workers import SimSampler  # noqa: E402
from relayrl.orchestrator.build import build_program  # noqa: E402
from relayrl.types import GenerateResult, SampleRequest, Trajectory  # noqa: E402
from support.simutil import sim_config  # noqa: E402

STEPS = 8


async def hangs_sometimes(trajectory: Trajectory) -> float:
    """A reward that never returns for the first sample of every third group (bounded by
    task.reward_timeout_s: that trajectory fails with reason timeout)."""
    if trajectory.group_id % 3 == 0 and trajectory.sample_index == 0:
        await asyncio.Event().wait()
    return 1.0 if trajectory.completion_text.strip() == trajectory.prompt.answer.strip() else 0.0


class RaisesAfter(SimSampler):
    """A replica whose generate raises from its `after`-th call on (it is failed over)."""

    after = 3

    async def generate(self, requests: Sequence[SampleRequest]) -> list[GenerateResult]:
        if self.generate_calls >= self.after:
            raise ConnectionError("chaos: sampler replica lost")
        return await super().generate(requests)


def main(spec: dict[str, object]) -> int:
    faults = set(spec["faults"])  # type: ignore[call-overload]
    sets = [
        f"run.steps={STEPS}",
        "rollout.num_samplers=2",
        "orchestrator.checkpoint_every=1",
        "sim.train_step=0.01",
        "sim.generate_per_request=0.005",
        "task.reward_timeout_s=0.3",
        "train.call_timeout_s=1",
        "orchestrator.stall_timeout_s=20",
    ]
    if "slow_fetch" in faults:
        sets.append("sim.get_metrics=0.05")
    cfg = sim_config(*sets)
    rewards = [hangs_sometimes] if "hanging_reward" in faults else None
    run_dir = Path(str(spec["run_dir"]))
    program = build_program(cfg, run_dir=run_dir, resume=bool(spec["resume"]), reward_fns=rewards)
    if "sampler_raises" in faults:
        program.backend.samplers[1] = RaisesAfter(cfg.sim, cfg.rollout.max_new_tokens, cfg.run.seed, replica=1)
    if "stalled_trainer" in faults:  # get_metrics of one step never returns: train.call_timeout_s fails the run
        trainer = program.backend.trainer
        get_metrics, stall_at = trainer.get_metrics, int(spec.get("stall_at", 3))  # type: ignore[call-overload]

        async def stalls() -> dict[str, float]:
            metrics = await get_metrics()
            if metrics.get("step") == float(stall_at):
                await asyncio.Event().wait()
            return metrics

        trainer.get_metrics = stalls  # type: ignore[method-assign]
    try:
        asyncio.run(program.run())
    except Exception as exc:
        print(f"chaos child: run failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
