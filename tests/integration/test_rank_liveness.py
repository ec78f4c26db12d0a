"""Issue 34: the sharded trainer's start-up has its own bound (train.rank_startup_timeout_s), not
the first call's (train.call_timeout_s), and a rank that stops answering (SIGSTOP) is detected by
its missing heartbeat (train.rank_heartbeat_timeout_s) and fails the run naming it, instead of
stalling it for the whole call bound."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import torch

from relayrl.algorithms.losses import LossConfig
from relayrl.backends.local.trainer import TrainerSettings
from relayrl.models.loading import load_model_and_tokenizer, shipped_model_dir
from relayrl.orchestrator.deadlines import BoundedTrainer

pytestmark = pytest.mark.torch


def _settings() -> TrainerSettings:
    return TrainerSettings(learning_rate=1e-3, total_steps=10, loss=LossConfig(), torch_threads=1)


def _resume(pids: list[int]) -> None:
    for pid in pids:  # (a stopped rank the trainer did not end: let it see its pipe close)
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def test_a_short_call_bound_does_not_fail_a_healthy_start_and_a_stopped_rank_is_named_within_the_heartbeat_bound() -> None:
    from relayrl.backends.local.sharded import RankFailed, ShardedTrainer

    torch.set_num_threads(1)
    model, _ = load_model_and_tokenizer(shipped_model_dir())
    sharded = ShardedTrainer(model, _settings(), world_size=2, startup_timeout_s=300.0, heartbeat_timeout_s=2.0)
    # rank start-up takes seconds (spawn, import torch, rendezvous, shard): far past this bound,
    # which the old code counted it against (the first call failed "did not return within 0.5s")
    trainer = BoundedTrainer(sharded, 0.5)

    async def go() -> float:
        try:
            weights = await trainer.export_weights()
            assert weights.version == 0
            await asyncio.sleep(3.0)  # healthy ranks stay alive past the heartbeat bound (they beat)
            assert (await sharded.memory())[1]["param_bytes"] > 0
            os.kill(sharded.pids[1], signal.SIGSTOP)
            stopped = time.monotonic()
            stalled = r"^sharded trainer rank 1 \(pid \d+\) stopped answering: no heartbeat for 2s \(train.rank_heartbeat_timeout_s\)$"
            with pytest.raises(RankFailed, match=stalled):
                await sharded.memory()
            return time.monotonic() - stopped
        finally:
            _resume(sharded.pids)
            await trainer.close()

    took = asyncio.run(go())
    assert took < 2.0 + 8.0  # the heartbeat bound and some slack, not train.call_timeout_s (30 min by default)
    assert all(not r.process.is_alive() for r in sharded._ranks)


def test_a_rank_that_never_starts_fails_within_the_startup_bound_naming_it() -> None:
    from relayrl.backends.local.sharded import RankFailed, ShardedTrainer

    torch.set_num_threads(1)
    model, _ = load_model_and_tokenizer(shipped_model_dir())
    sharded = ShardedTrainer(model, _settings(), world_size=2, startup_timeout_s=15.0, heartbeat_timeout_s=2.0)
    os.kill(sharded.pids[1], signal.SIGSTOP)  # stopped before it could start (rank 0 starts, beats and waits for it)
    trainer = BoundedTrainer(sharded, 0.0)

    async def go() -> float:
        began = time.monotonic()
        try:
            with pytest.raises(RankFailed, match=r"rank 1 \(pid \d+\) did not start within 15s \(train.rank_startup_timeout_s\)"):
                await trainer.export_weights()
            return time.monotonic() - began
        finally:
            _resume(sharded.pids)
            await trainer.close()

    assert asyncio.run(go()) < 15.0 + 8.0
