"""A complete example of user reward functions for relayrl (docs/rewards.md).

Name them in a recipe, relative to the recipe's directory or the working directory:

    [task]
    kind = "jsonl"
    path = "prompts.jsonl"   # rows like {"prompt": "12+30=", "answer": "42", "tolerance": 1}
    reward_functions = [
        "examples/rewards/my_reward.py:numeric_with_tolerance",
        "examples/rewards/my_reward.py:brevity_judge",
    ]
    reward_weights = [1.0, 0.1]
    reward_timeout_s = 5

`numeric_with_tolerance` is a plain function: relayrl imports this file in its reward worker
processes (`task.reward_workers`) and calls it there once per trajectory, with a timeout; if it
raises, hangs or crashes, that trajectory gets reward 0 and is counted as failed, and the run goes
on. `brevity_judge` is an `async def` function: relayrl awaits it on its event loop (for I/O, such
as an HTTP call to a judge model), at most `task.reward_concurrency` calls at once.
"""

from __future__ import annotations

import asyncio
import re

from relayrl.types import Trajectory

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def numeric_with_tolerance(trajectory: Trajectory) -> float:
    """1.0 when the last number in the completion is within the row's `tolerance` (an extra JSONL
    field, so in `prompt.metadata`; default 0) of the answer, 0.1 for any other number (at least
    the format is right), 0.0 when there is no number."""
    numbers = NUMBER.findall(trajectory.completion_text)
    if not numbers:
        return 0.0
    tolerance = float(trajectory.prompt.metadata.get("tolerance", 0))  # type: ignore[arg-type]
    return 1.0 if abs(float(numbers[-1]) - float(trajectory.prompt.answer)) <= tolerance else 0.1


async def brevity_judge(trajectory: Trajectory) -> float:
    """An async reward, standing in for a call to a judge service: it must not block the event
    loop (await the I/O; do CPU work in a plain function instead). 1.0 for a completion of at most
    8 characters, less the longer it gets."""
    await asyncio.sleep(0)  # e.g. `response = await client.post(JUDGE_URL, json={...})`
    return min(1.0, 8 / max(1, len(trajectory.completion_text)))
