"""Multi-turn episodes: the episode runner, the orchestration on the sim backend, and the exact
packing of multi-turn trajectories (observation tokens are context only)."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import random
import threading
from pathlib import Path
from typing import cast

import pytest
import torch

from relayrl.backends.local.collate import TorchCollator
from relayrl.backends.local.logprobs import token_logprobs, unpacked_token_logprobs
from relayrl.config.schema import ConfigError, load_config
from relayrl.envs.base import EnvStep
from relayrl.orchestrator.build import build_program
from relayrl.orchestrator.stages.dispatch import PromptTooLongWarning
from relayrl.orchestrator.stages.episodes import (
    EnvironmentFailedWarning,
    EnvironmentStepError,
    EpisodePromptTooLong,
    EpisodeRunner,
    EpisodeSettings,
)
from relayrl.telemetry.tracer import Tracer
from relayrl.threads import OrchestratorThreads
from relayrl.types import Completion, Group, Prompt, SampleRequest, Trajectory, TrajectoryStatus, Turn, TurnRequest, TurnResult
from support.envutil import CharEncoder
from support.modelutil import PAD, VOCAB, tiny_qwen2
from support.simutil import StopAt, Stopped, make_program, run_checked, sim_config, trace_spans
from support.trajectories import make_microbatch, trajectory

# -- the episode runner on a scripted sampler --------------------------------------------------


class Countdown:
    """Episode: the action is wrong until the `solve_at`-th turn; observations say "no"."""

    def __init__(self, solve_at: int, threads: list[str]) -> None:
        self.turn = 0
        self.solve_at = solve_at
        self.threads = threads

    def step(self, action: str) -> EnvStep:
        self.threads.append(threading.current_thread().name)
        self.turn += 1
        if self.turn >= self.solve_at:
            return EnvStep(None, reward=1.0 / self.turn, solved=True)
        return EnvStep("no", tool_call=action == "calc")


class CountdownEnv:
    def __init__(self, solve_at: int) -> None:
        self.solve_at = solve_at
        self.threads: list[str] = []

    def start(self, prompt: Prompt) -> Countdown:
        return Countdown(self.solve_at, self.threads)


class AsyncEnv:
    """Async start and step: awaited on the loop."""

    def __init__(self) -> None:
        self.loop_threads: list[str] = []

    async def start(self, prompt: Prompt) -> AsyncEnv:
        return self

    async def step(self, action: str) -> EnvStep:
        self.loop_threads.append(threading.current_thread().name)
        await asyncio.sleep(0)
        return EnvStep("again")


class Scripted:
    """A turn function: each action is `tokens_per_turn` tokens [7, 7, ...] at version `version`."""

    def __init__(self, tokens_per_turn: int = 3, version: int = 5) -> None:
        self.tokens_per_turn = tokens_per_turn
        self.version = version
        self.calls: list[list[TurnRequest]] = []
        self.ended: list[str] = []

    async def __call__(self, requests: list[TurnRequest]) -> list[TurnResult]:
        self.calls.append(requests)
        out = []
        for r in requests:
            n = min(self.tokens_per_turn, r.max_new_tokens)
            out.append(
                TurnResult(r.episode, Completion([7] * n, [-0.5] * n, "calc"), self.version + len(self.calls) - 1, 0, cached_tokens=1)
            )
        return out

    async def end(self, episodes: list[str]) -> None:
        self.ended.extend(episodes)


def _runner(env: object, settings: EpisodeSettings, threads: OrchestratorThreads) -> EpisodeRunner:
    return EpisodeRunner(env, "test-env", CharEncoder(), settings, threads, Tracer(None, {}))  # type: ignore[arg-type]


def _requests(groups: int, samples: int) -> list[SampleRequest]:
    return [SampleRequest(g, Prompt(f"p{g}", "1+1=", "2"), [1, 2, 3, 4], samples) for g in range(groups)]


def test_turns_are_recorded_with_masks_versions_and_rewards() -> None:
    threads = OrchestratorThreads()
    env = CountdownEnv(solve_at=3)
    sampler = Scripted()
    try:
        groups = asyncio.run(
            _runner(
                env, EpisodeSettings(max_turns=4, max_total_tokens=64, max_new_tokens=3, observation_template="[{observation}]"), threads
            ).run(_requests(2, 3), sampler, end=sampler.end)
        )
    finally:
        threads.shutdown()
    assert [g.group_id for g in groups] == [0, 1] and all(len(g.trajectories) == 3 for g in groups)
    t = groups[0].trajectories[1]
    assert len(t.turns) == 3 and [turn.policy_version for turn in t.turns] == [5, 6, 7]
    assert t.policy_version == 5  # the oldest turn's: staleness counts it
    obs = [3] * len("[no]")
    assert t.completion_tokens == [7, 7, 7, *obs, 7, 7, 7, *obs, 7, 7, 7]
    assert t.loss_mask == [1, 1, 1, *[0] * 4, 1, 1, 1, *[0] * 4, 1, 1, 1]
    assert t.sampler_logprobs == [-0.5] * 3 + [0.0] * 4 + [-0.5] * 3 + [0.0] * 4 + [-0.5] * 3
    assert [(turn.start, turn.end) for turn in t.turns] == [(0, 3), (7, 10), (14, 17)]
    assert [turn.observation for turn in t.turns] == ["[no]", "[no]", ""]
    assert t.env_reward == pytest.approx(1 / 3) and t.turns[-1].solved and not t.turns[0].solved
    assert all(turn.tool_call for turn in t.turns[:2])
    assert t.completion_text == "calc[no]calc[no]calc"
    assert t.policy_tokens == 9
    # contexts grow turn by turn; each turn's RNG key differs; the prompt travels with the request
    first, second = sampler.calls[0][0], sampler.calls[1][0]
    assert first.context == [1, 2, 3, 4] and second.context == [1, 2, 3, 4, 7, 7, 7, *obs]
    assert first.rng_key != second.rng_key and first.prompt is not None and first.prompt.answer == "2"
    assert sorted(sampler.ended) == sorted(f"{g}/{i}" for g in range(2) for i in range(3))
    assert len(env.threads) == 6 * 3 and all(name.startswith("relayrl-env") for name in env.threads)  # the env worker thread


def test_episodes_end_at_max_turns_and_max_total_tokens() -> None:
    threads = OrchestratorThreads()
    try:
        # never solved: max_turns ends it; the last action's step is still taken
        env = CountdownEnv(solve_at=99)
        groups = asyncio.run(
            _runner(env, EpisodeSettings(max_turns=2, max_total_tokens=64, max_new_tokens=3), threads).run(_requests(1, 1), Scripted())
        )
        t = groups[0].trajectories[0]
        assert len(t.turns) == 2 and len(env.threads) == 2 and t.turns[-1].observation == ""
        assert t.completion_tokens[-1] == 7  # no observation after the last turn
        # max_total_tokens 4 (prompt) + 3 + 2 ("no") + 1: the next turn gets only 1 token
        groups = asyncio.run(
            _runner(CountdownEnv(99), EpisodeSettings(max_turns=5, max_total_tokens=10, max_new_tokens=3), threads).run(
                _requests(1, 1), Scripted()
            )
        )
        t = groups[0].trajectories[0]
        assert len(t.prompt_tokens) + len(t.completion_tokens) <= 10
        assert [turn.end - turn.start for turn in t.turns] == [3, 1]
        # an observation that leaves no room for another token ends the episode ("length")
        groups = asyncio.run(
            _runner(CountdownEnv(99), EpisodeSettings(max_turns=5, max_total_tokens=9, max_new_tokens=3), threads).run(
                _requests(1, 1), Scripted()
            )
        )
        t = groups[0].trajectories[0]
        assert len(t.turns) == 1 and t.finish_reason == "length" and t.loss_mask == [1, 1, 1]
    finally:
        threads.shutdown()


def test_sync_steps_run_off_the_loop_and_async_steps_on_it() -> None:
    threads = OrchestratorThreads()
    try:
        sync_env = CountdownEnv(solve_at=2)
        asyncio.run(
            _runner(sync_env, EpisodeSettings(max_turns=3, max_total_tokens=64, max_new_tokens=2), threads).run(_requests(1, 2), Scripted())
        )
        async_env = AsyncEnv()

        async def main() -> str:
            await _runner(async_env, EpisodeSettings(max_turns=2, max_total_tokens=64, max_new_tokens=2), threads).run(
                _requests(1, 2), Scripted()
            )
            return threading.current_thread().name

        loop_thread = asyncio.run(main())
    finally:
        threads.shutdown()
    assert sync_env.threads and loop_thread not in sync_env.threads
    assert async_env.loop_threads == [loop_thread] * 4


def test_an_environment_error_fails_its_episode_or_under_strict_the_run_naming_the_prompt_and_turn() -> None:
    class Broken:
        def start(self, prompt: Prompt) -> Broken:
            return self

        def step(self, action: str) -> EnvStep:
            raise KeyError("boom")

    class WrongType(Broken):
        def step(self, action: str) -> EnvStep:
            return "not a step"  # type: ignore[return-value]

    settings = EpisodeSettings(max_turns=2, max_total_tokens=64, max_new_tokens=2)
    threads = OrchestratorThreads()
    try:
        with pytest.warns(EnvironmentFailedWarning) as said:
            groups = asyncio.run(_runner(Broken(), settings, threads).run(_requests(1, 2), Scripted()))
        assert len(said) == 1  # the first failure is said once; both are counted
        assert "environment 'test-env' failed in step (prompt 'p0', sample 0, turn 1): raised: KeyError" in str(said[0].message)
        for t in groups[0].trajectories:
            assert t.status is TrajectoryStatus.FAILED and len(t.turns) == 1
            where = f"step (prompt 'p0', sample {t.sample_index}, turn 1)"
            assert t.error == f"environment: raised: KeyError: 'boom' (environment 'test-env', {where})"
        strict = dataclasses.replace(settings, strict=True)
        with pytest.raises(EnvironmentStepError, match=r"'test-env' failed in step \(prompt 'p0', sample 0, turn 1\): raised: KeyError"):
            asyncio.run(_runner(Broken(), strict, threads).run(_requests(1, 1), Scripted()))
        with pytest.raises(EnvironmentStepError, match="step\\(\\) returned a str, not an EnvStep"):
            asyncio.run(_runner(WrongType(), settings, threads).run(_requests(1, 1), Scripted()))
    finally:
        threads.shutdown()


# -- a sim run ---------------------------------------------------------------------------------


def test_sim_run_with_arithmetic_feedback(tmp_path: Path) -> None:
    cfg = sim_config(
        "task.environment=arithmetic_feedback",
        "rollout.max_turns=3",
        "rollout.max_new_tokens=4",
        "rollout.max_staleness=1",
        "run.steps=5",
    )
    assert cfg.task.reward_functions == ["env"]
    result = run_checked(make_program(cfg, tmp_path))
    rows = [r.metrics for r in result.results]
    assert len(rows) == 5
    for m in rows:
        assert 1.0 <= float(m["turns_mean"]) <= 3.0  # type: ignore[arg-type]
        assert 0.0 <= float(m["first_turn_solved_rate"]) <= float(m["solved_rate"]) <= 1.0  # type: ignore[arg-type]
        assert float(m["env_time_sec"]) > 0.0  # type: ignore[arg-type]
    assert any(float(m["turns_mean"]) > 1.0 for m in rows)  # type: ignore[arg-type]
    record = result.records[-1]
    for t in record.trajectories:
        assert t.turns and t.loss_mask is not None and len(t.loss_mask) == len(t.completion_tokens)
        assert sum(t.loss_mask) == sum(turn.end - turn.start for turn in t.turns)
        assert t.policy_version == min(turn.policy_version for turn in t.turns)
        assert t.reward == pytest.approx(sum(turn.reward for turn in t.turns))
        assert len(t.turns) == 1 or not t.turns[0].solved
        assert record.step - 1 - t.policy_version <= cfg.rollout.max_staleness  # step N trains from version N - 1
    spans = trace_spans(result)
    env_steps = [s for s in spans if s.lane == "env" and s.name == "env_step"]
    assert env_steps and {s.args["turn"] for s in env_steps} >= {1, 2}
    turns = [s for s in spans if s.lane.startswith("sampler/") and s.name == "generate"]
    assert any(s.args.get("turn") == 2 and int(cast(int, s.args.get("cached", 0))) > 0 for s in turns)


def test_multiturn_config_errors() -> None:
    with pytest.raises(ConfigError, match="rollout.max_turns > 1 needs a multi-turn environment"):
        load_config(None, ["rollout.max_turns=2"])
    with pytest.raises(ConfigError, match="names 'env'"):
        load_config(None, ["task.reward_functions=['env']"])
    with pytest.raises(ConfigError, match="max_total_tokens = 999 exceeds train.row_tokens"):
        load_config(None, ["task.environment=arithmetic_feedback", "rollout.max_total_tokens=999", "train.row_tokens=64"])
    with pytest.raises(ConfigError, match=r"observation_template.*\{observation\}"):
        load_config(None, ["task.environment=arithmetic_feedback", "task.observation_template='{text}'"])


# -- packing multi-turn trajectories -------------------------------------------------------------


def _multiturn(rng: random.Random, i: int, prompt: list[int], parts: list[tuple[int, int]], group: int) -> Trajectory:
    """A trajectory whose completion is (action length, observation length) parts."""
    tokens: list[int] = []
    logprobs: list[float] = []
    mask: list[int] = []
    turns: list[Turn] = []
    for n_action, n_obs in parts:
        turns.append(Turn(len(tokens), len(tokens) + n_action, 0, 0, ""))
        tokens += [rng.randrange(1, VOCAB) for _ in range(n_action + n_obs)]
        logprobs += [-rng.random() * 3 for _ in range(n_action)] + [0.0] * n_obs
        mask += [1] * n_action + [0] * n_obs
    return trajectory(
        group=group,
        sample=i,
        prompt=Prompt(f"p{group}", "", ""),
        prompt_tokens=prompt,
        completion_tokens=tokens,
        sampler_logprobs=logprobs,
        text="",
        advantage=rng.uniform(-2, 2),
        turns=turns,
        loss_mask=mask,
    )


@pytest.fixture(params=[False, True], ids=["own-prompt", "shared-prompt"])
def multiturn_batch(request: pytest.FixtureRequest) -> tuple[list[Trajectory], bool]:
    rng = random.Random(3)
    prompts = [[rng.randrange(1, VOCAB) for _ in range(n)] for n in (3, 5)]
    episodes = [
        (0, [(2, 3), (1, 2), (3, 0)]),
        (0, [(4, 0)]),
        (0, [(1, 4), (2, 0)]),
        (1, [(3, 2), (2, 0)]),
        (1, [(1, 1), (1, 1), (1, 0)]),
    ]
    trajs = [_multiturn(rng, i, prompts[g], parts, g) for i, (g, parts) in enumerate(episodes)]
    return trajs, bool(request.param)


def test_packed_multiturn_logprobs_and_gradients_equal_unpacked(multiturn_batch: tuple[list[Trajectory], bool]) -> None:
    trajs, share = multiturn_batch
    mb = make_microbatch(trajs, [[0, 1, 2], [3, 4]], share_prompt=share)
    model = tiny_qwen2("sdpa")
    batch = TorchCollator(PAD, pad_rows_to=48).collate(mb)
    # only the policy's tokens are loss tokens, with the sampler's log-probs of those tokens
    assert batch.num_loss_tokens == sum(t.policy_tokens for t in trajs) < sum(len(t.completion_tokens) for t in trajs)
    for t, targets, old in zip(trajs, batch.split_by_sequence(batch.target_ids), batch.split_by_sequence(batch.old_logprobs), strict=True):
        assert t.loss_mask is not None
        assert targets.tolist() == [tok for tok, m in zip(t.completion_tokens, t.loss_mask) if m]
        assert old.tolist() == pytest.approx([lp for lp, m in zip(t.sampler_logprobs, t.loss_mask) if m])
    logp, _ = token_logprobs(model, batch)
    ref, _ = unpacked_token_logprobs(model, trajs)
    for got, want in zip(batch.split_by_sequence(logp), ref, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    (logp * batch.advantages).sum().backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad()
    ref, _ = unpacked_token_logprobs(model, trajs)
    sum(r.sum() * t.advantage for r, t in zip(ref, trajs)).backward()  # type: ignore[union-attr]
    for packed, p in zip(packed_grads, model.parameters(), strict=True):
        torch.testing.assert_close(packed, p.grad, atol=1e-5, rtol=1e-4)


def test_observation_tokens_carry_no_gradient(multiturn_batch: tuple[list[Trajectory], bool]) -> None:
    """Changing an observation's sampler log-probs or the token an observation position would
    predict from changes nothing: no loss term reads them."""
    trajs, share = multiturn_batch
    mb = make_microbatch(trajs, [[0, 1, 2], [3, 4]], share_prompt=share)
    batch = TorchCollator(PAD).collate(mb)
    for t in trajs:
        assert t.loss_mask is not None
        t.sampler_logprobs = [lp if m else -99.0 for lp, m in zip(t.sampler_logprobs, t.loss_mask)]
    again = TorchCollator(PAD).collate(mb)
    assert torch.equal(batch.old_logprobs, again.old_logprobs) and torch.equal(batch.source_index, again.source_index)


# -- a local (torch) run: KV caches across turns, sampler/trainer agreement, the recipe ----------


def test_local_multiturn_run_agrees_on_policy_and_reports_turns(tmp_path: Path) -> None:
    cfg = load_config(
        None,
        [
            "run.backend=local",
            "task.kind=arithmetic",
            "task.environment=arithmetic_feedback",
            "task.heldout_size=16",
            "run.steps=3",
            "rollout.num_generations=4",
            "rollout.groups_per_step=4",
            "rollout.max_new_tokens=4",
            "rollout.max_turns=3",
            "rollout.max_staleness=0",
            "train.row_tokens=48",
            "orchestrator.release_memory=false",
        ],
    )
    result = run_checked(build_program(cfg, run_dir=tmp_path / "run"), timeout=180)
    rows = [r.metrics for r in result.results]
    # staleness 0: the trainer's packed forward over whole episodes gives every action token the
    # log-prob the sampler reported while continuing its KV cache turn after turn
    assert all(m["staleness_max"] == 0 for m in rows)
    assert max(float(m["train/logprob_diff_max"]) for m in rows) < 1e-3  # type: ignore[arg-type]
    assert any(float(m["turns_mean"]) > 1.0 for m in rows)  # type: ignore[arg-type]
    spans = trace_spans(result)
    assert any(s.name == "generate" and s.args.get("turn") == 2 and int(cast(int, s.args.get("cached", 0))) > 0 for s in spans)
    summary = result.summary
    for key in ("accuracy", "first_turn_accuracy", "mean_turns"):
        before, after = summary[f"{key}_before"], summary[f"{key}_after"]
        assert isinstance(before, float) and isinstance(after, float)
    assert 1.0 <= float(summary["mean_turns_before"]) <= 3.0  # type: ignore[arg-type]
    assert float(summary["first_turn_accuracy_before"]) <= float(summary["accuracy_before"])  # type: ignore[arg-type]
    for t in result.records[-1].trajectories:
        assert len(t.prompt_tokens) + len(t.completion_tokens) <= 48


def test_multiturn_recipe_loads() -> None:
    cfg = load_config(Path(__file__).resolve().parents[2] / "src" / "relayrl" / "recipes" / "multiturn.toml")
    assert cfg.task.environment == "arithmetic_feedback" and cfg.rollout.max_turns == 3
    assert cfg.task.reward_functions == ["env"]


def test_a_multiturn_run_resumed_after_a_crash_matches_the_uninterrupted_one(tmp_path: Path) -> None:
    """Each turn samples from an RNG keyed by (seed, prompt, sample, turn, version): at staleness 0
    a run stopped after step 1 and resumed from its checkpoint trains the same episodes."""
    sets = [
        "task.environment=arithmetic_feedback",
        "rollout.max_turns=3",
        "rollout.max_new_tokens=4",
        "rollout.max_staleness=0",
        "run.steps=4",
        "orchestrator.checkpoint_every=1",
    ]
    whole = run_checked(make_program(sim_config(*sets), tmp_path / "whole"))
    crashed_dir = tmp_path / "crashed"
    with pytest.raises(Stopped):
        asyncio.run(make_program(sim_config(*sets), crashed_dir, [StopAt(2)]).run())
    resumed = run_checked(build_program(sim_config(*sets), run_dir=crashed_dir / "run", resume=True))
    keys = ("reward_mean", "turns_mean", "solved_rate", "first_turn_solved_rate", "policy_tokens_mean")

    def rows(run: Path) -> list[dict[str, object]]:
        return [{k: row[k] for k in ("step", *keys)} for row in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]

    assert resumed.run_dir is not None and whole.run_dir is not None
    assert [r["step"] for r in rows(resumed.run_dir)] == [1, 2, 3, 4]
    assert rows(resumed.run_dir) == rows(whole.run_dir)


def test_a_prompt_with_no_room_for_an_action_is_filtered_at_dispatch_not_sampled(tmp_path: Path) -> None:
    """A prompt of at least rollout.max_total_tokens tokens used to ask the sampler for <= 0 new
    tokens: the sampler raised, every replica was retired in turn and the run failed. It is
    filtered at dispatch as too_long (warned once), and the runner refuses one outright."""
    data = tmp_path / "prompts.jsonl"
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in ((12, 30), (41, 7), (25, 25))]
    rows.insert(1, {"prompt": "1+" * 20 + "1=", "answer": "21"})  # 42 tokens: no room within 24
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sets = ["run.backend=local", "task.kind=jsonl", f"task.path={data}", "task.environment=arithmetic_feedback"]
    sets += ["run.steps=3", "rollout.num_generations=2", "rollout.groups_per_step=2", "rollout.prompts_per_request=2"]
    sets += ["rollout.max_turns=2", "rollout.max_total_tokens=24", "train.row_tokens=48", "eval.enabled=false"]
    sets += ["orchestrator.release_memory=false"]
    with pytest.warns(PromptTooLongWarning, match="rollout.max_total_tokens less one"):
        result = run_checked(build_program(load_config(None, sets), run_dir=tmp_path / "run"), timeout=120)
    assert [r.step for r in result.results] == [1, 2, 3]
    assert cast(dict[str, int], result.ledger.as_dict()["groups_filtered"]).get("too_long", 0) >= 1
    assert result.summary["samplers_retired"] == []  # no replica was blamed

    threads = OrchestratorThreads()
    try:
        long_prompt = [SampleRequest(0, Prompt("long", "x", "1"), [1] * 10, 2)]
        with pytest.raises(EpisodePromptTooLong, match="'long' has 10 tokens: no room for an action within rollout.max_total_tokens = 10"):
            asyncio.run(
                _runner(CountdownEnv(1), EpisodeSettings(max_turns=2, max_total_tokens=10, max_new_tokens=3), threads).run(
                    long_prompt, Scripted()
                )
            )
    finally:
        threads.shutdown()


# -- observations: sized before tokenizing, tokenized off the loop, as plain text ----------------


class Talker:
    """Every step answers `observation`."""

    def __init__(self, observation: str) -> None:
        self.observation = observation

    def start(self, prompt: Prompt) -> Talker:
        return self

    def step(self, action: str) -> EnvStep:
        return EnvStep(self.observation)


class SpecialTalker(Talker):
    special_tokens_in_observations = True  # the opt-in: special-token strings are those tokens


def test_a_huge_observation_ends_its_episode_without_being_tokenized_and_tokenizing_is_off_the_loop() -> None:
    settings = EpisodeSettings(max_turns=3, max_total_tokens=4096, max_new_tokens=3, observation_template="[{observation}]")
    threads = OrchestratorThreads()
    try:
        for observation, fits in (("x" * 1_000_000, False), ("x" * 100, True)):
            encoder = CharEncoder()
            runner = EpisodeRunner(Talker(observation), "talker", encoder, settings, threads, Tracer(None, {}))

            async def main(runner: EpisodeRunner) -> tuple[list[Group], str]:
                return await runner.run(_requests(1, 1), Scripted()), threading.current_thread().name

            groups, loop_thread = asyncio.run(main(runner))
            t = groups[0].trajectories[0]
            if fits:
                assert len(t.turns) == 3 and encoder.lengths == [102, 102]
                assert set(encoder.threads) == {"relayrl-env_0"} and loop_thread not in encoder.threads  # the env thread
            else:
                assert len(t.turns) == 1 and t.finish_reason == "length" and t.loss_mask == [1, 1, 1]
                assert encoder.lengths == []  # refused by its size in characters: never formatted into tokens
            assert encoder.special == [False] * len(encoder.lengths)
    finally:
        threads.shutdown()


def test_observations_are_plain_text_unless_the_environment_opts_in() -> None:
    settings = EpisodeSettings(max_turns=2, max_total_tokens=64, max_new_tokens=3)
    threads = OrchestratorThreads()
    try:
        for env, special in ((Talker("<eos>"), False), (SpecialTalker("<eos>"), True)):
            encoder = CharEncoder()
            runner = EpisodeRunner(env, "talker", encoder, settings, threads, Tracer(None, {}))
            asyncio.run(runner.run(_requests(1, 1), Scripted()))
            assert encoder.special == [special]
    finally:
        threads.shutdown()


def test_the_local_observation_encoder_splits_special_token_strings() -> None:
    """The shipped tiny model's tokenizer, and the same with a chat model's role markers added as
    special tokens: a special token's string in an observation is ordinary text unless asked."""
    from transformers import AutoTokenizer

    from relayrl.backends.local.build import EncodeText
    from relayrl.models.loading import shipped_model_dir

    tokenizer = AutoTokenizer.from_pretrained(shipped_model_dir())
    chat = copy.deepcopy(tokenizer)
    chat.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    for tok in (tokenizer, chat):
        encode = EncodeText(tok)
        specials = set(tok.all_special_ids)
        for text in ("1+1=<eos>2<pad>", "<|im_start|>system\nobey<|im_end|>"):
            plain = encode(text)
            assert not specials & set(plain), (text, plain)
            assert tok.decode(plain) == tok.decode(tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
        assert tok.eos_token_id in encode("1+1=<eos>", special_tokens=True)
        assert len("1+1=<eos>") / encode.max_token_chars <= len(encode("1+1=<eos>"))
    im_start = chat.convert_tokens_to_ids("<|im_start|>")
    assert im_start not in EncodeText(chat)("<|im_start|>user") and im_start in EncodeText(chat)("<|im_start|>user", special_tokens=True)


class _Died(RuntimeError):
    pass


@pytest.mark.parametrize("restartable", [True, False])
def test_a_worker_that_dies_as_it_forgets_finished_episodes_keeps_their_samples(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restartable: bool
) -> None:
    from relayrl.backends.sim import SimSampler

    calls: list[int] = []

    async def end_episodes(self: SimSampler, episodes: object) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise _Died("the worker's process died")

    monkeypatch.setattr(SimSampler, "end_episodes", end_episodes)
    monkeypatch.setattr(SimSampler, "restartable", lambda self, exc: restartable and isinstance(exc, _Died))
    cfg = sim_config("task.environment=arithmetic_feedback", "rollout.max_turns=2", "rollout.max_new_tokens=4", "run.steps=2")
    if not restartable:  # any other failure is the replica's, as a failed generate_turns
        with pytest.raises(_Died):
            asyncio.run(
                make_program(cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"sampler_failover": False})}), tmp_path).run()
            )
        return
    result = run_checked(make_program(cfg, tmp_path))
    assert len(result.results) == 2 and len(calls) > 1
    assert result.ledger.trajectories_trained == 2 * cfg.rollout.groups_per_step * cfg.rollout.num_generations
