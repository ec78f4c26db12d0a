"""Metric reduction: one step's record → the flat per-step metrics written to metrics.jsonl.

Invariant: pure function of the record; staleness is measured against the version the step
trained (its commit version − 1); reward statistics leave out trajectories whose reward call
failed (their reward 0 is a placeholder).
"""

from __future__ import annotations

import math

from relayrl.types import StepRecord, TrajectoryStatus

Metrics = dict[str, float | int | None]


def _mean_std(values: list[float]) -> tuple[float, float]:
    if not values:
        return 0.0, 0.0
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / len(values)
    return mean, math.sqrt(var)


def reduce_step(record: StepRecord) -> Metrics:
    trajs = record.trajectories
    # a failed reward call's 0 is a placeholder, not a reward: the statistics are the scored ones'
    rewards = [t.reward for t in trajs if t.status is not TrajectoryStatus.FAILED]
    reward_mean, reward_std = _mean_std(rewards)
    trained_version = record.policy_version - 1
    staleness = [trained_version - t.policy_version for t in trajs]
    real = sum(p.real_tokens for p in record.padding)
    padded = sum(p.padded_tokens for p in record.padding)
    unshared = sum(p.sequence_tokens for p in record.padding)
    completion_lengths = [len(t.completion_tokens) for t in trajs]
    metrics: Metrics = {
        "step": record.step,
        "policy_version": record.policy_version,
        "step_time_sec": record.step_time_sec,
        "metrics_fetch_time": record.metrics_fetch_time,
        "boundary_gap_sec": record.boundary_gap_sec,
        "exposed_generation_time": record.exposed_generation_time,
        "weight_sync_time": record.weight_sync_time,
        "packing_time": record.packing_time,
        "train_time": record.train_time,
        "optim_time": record.optim_time,
        "reward_mean": reward_mean,
        "reward_std": reward_std,
        "num_trajectories": len(trajs),
        "num_groups": len(record.groups),
        "filtered_groups": len(record.filtered),
        "failed_trajectories": len(trajs) - len(rewards),  # those `rewards` leaves out
        "staleness_mean": sum(staleness) / len(staleness) if staleness else 0.0,
        "staleness_max": max(staleness, default=0),
        "completion_len_mean": sum(completion_lengths) / len(completion_lengths) if trajs else 0.0,
        "tokens": real,
        "microbatches": len(record.padding),
        "padding_efficiency": real / padded if padded else 1.0,
        # tokens the trainer did not compute because completions shared their prompt's copy
        "prompt_sharing_saving": 1.0 - real / unshared if unshared else 0.0,
        "loop_lag_max_ms": record.loop_lag_max_ms,
        **({} if record.sampler_gpu_mem_peak_gb is None else {"rollout/gpu_mem_peak_gb": record.sampler_gpu_mem_peak_gb}),
    }
    episodes = [t for t in trajs if t.turns]
    if episodes:  # multi-turn: per episode
        n = len(episodes)
        metrics["turns_mean"] = sum(len(t.turns) for t in episodes) / n
        metrics["tool_calls_mean"] = sum(sum(turn.tool_call for turn in t.turns) for t in episodes) / n
        metrics["solved_rate"] = sum(any(turn.solved for turn in t.turns) for t in episodes) / n
        metrics["first_turn_solved_rate"] = sum(t.turns[0].solved for t in episodes) / n
        metrics["env_time_sec"] = sum(t.env_time for t in episodes)  # summed over the step's episodes
        metrics["policy_tokens_mean"] = sum(t.policy_tokens for t in episodes) / n
    if record.truncated_masked is not None:  # algorithm.mask_truncated
        metrics["truncated_masked"] = record.truncated_masked
    penalties = [t.overlong_penalty for t in trajs if t.overlong_penalty]
    if penalties:  # algorithm.overlong_buffer: mean over the step's trajectories, and how many were penalised
        metrics["overlong_penalty_mean"] = sum(penalties) / len(trajs)
        metrics["overlong_penalised"] = len(penalties)
    for key, value in record.trainer_metrics.items():
        if key != "step":
            metrics[f"train/{key}"] = value
    return metrics
