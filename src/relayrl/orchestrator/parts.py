"""A run's parts, assembled once: what the program supervises.

From a validated config, the backend's workers and the run's state (fresh or restored), this
builds everything a run holds besides its stages: the bounded trainer, the scorer, the trace,
the episode runner (multi-turn tasks), the held-out evaluator and its schedule, the per-step
bookkeeper with its sinks, and the checkpointer. orchestrator/build.py calls `assemble` once
everything was validated and the run directory prepared; `Program` (orchestrator/program.py)
only supervises what it returns.

Invariant: assembling writes nothing but the files it opens for the run to append to (trace.json,
metrics.jsonl and the sinks'), and every part that reads what a checkpoint records reads it off
the one `RunState`.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from relayrl.agents.context import AgentFn
from relayrl.backends.bundle import Backend
from relayrl.config.schema import Config
from relayrl.envs.base import Environment
from relayrl.errors import UserError
from relayrl.eval.heldout import HeldoutEvaluator
from relayrl.eval.schedule import EvalSchedule
from relayrl.orchestrator.checkpointing import Checkpointer, CheckpointPolicy, LoggedSteps
from relayrl.orchestrator.deadlines import BoundedTrainer
from relayrl.orchestrator.ledger import FilterWatch
from relayrl.orchestrator.stages.agents import AgentRollout, AgentSettings
from relayrl.orchestrator.stages.episodes import EpisodeRunner, EpisodeSettings
from relayrl.orchestrator.state import RunState
from relayrl.rewards.registry import ResolvedReward
from relayrl.rewards.scoring import Scorer, ScorerSettings
from relayrl.rundir.files import REWARD_WORKERS_LOG
from relayrl.tasks.build import correctness_check
from relayrl.telemetry.callbacks import Callback
from relayrl.telemetry.sinks import build_sinks
from relayrl.telemetry.stepbook import StepBookkeeper
from relayrl.telemetry.tracer import Tracer
from relayrl.threads import OrchestratorThreads
from relayrl.types import Prompt


@dataclass(slots=True, eq=False)
class RunParts:
    cfg: Config
    backend: Backend
    state: RunState
    run_dir: Path | None
    threads: OrchestratorThreads
    callbacks: list[Callback]  # the user's (and the console's), in order
    trainer: BoundedTrainer  # every trainer call bounded by train.call_timeout_s
    scorer: Scorer
    tracer: Tracer
    episodes: EpisodeRunner | None  # multi-turn episodes (task.environment); None: single completions
    agents: AgentRollout | None  # rollouts through the endpoint (task.agent)
    logged: LoggedSteps
    bookkeeper: StepBookkeeper
    eval_schedule: EvalSchedule
    checkpointer: Checkpointer


def episode_settings(cfg: Config, max_prompt_tokens: int | None) -> EpisodeSettings:
    """Multi-turn limits: `rollout.max_total_tokens` (0: `train.row_tokens`), never beyond the
    model's context (`max_prompt_tokens` + `rollout.max_new_tokens`)."""
    r = cfg.rollout
    total = r.max_total_tokens or cfg.train.row_tokens
    if max_prompt_tokens is not None:
        total = min(total, max_prompt_tokens + r.max_new_tokens)
    return EpisodeSettings(
        max_turns=r.max_turns,
        max_total_tokens=total,
        max_new_tokens=r.max_new_tokens,
        observation_template=cfg.task.observation_template,
        step_timeout_s=r.env_step_timeout_s,
        strict=r.strict_environment,
    )


def agent_rollout(cfg: Config, backend: Backend, agent: AgentFn, tracer: Tracer) -> AgentRollout:
    """The rollout of a `task.agent` run and its endpoint (not listening yet: the program starts it)."""
    from relayrl.agents.endpoint import AgentEndpoint, EndpointSettings, Tokenizer  # FastAPI, uvicorn: agent runs only

    if backend.tokenizer is None:
        raise UserError(f"task.agent needs a backend with a tokenizer (run.backend = {cfg.run.backend!r} has none)")
    r = cfg.rollout
    model = cfg.model.package or (Path(cfg.model.path).name if cfg.model.path else "tiny-arith")
    settings = EndpointSettings(
        host=r.agent_host,
        port=r.agent_port,
        model=model,
        max_new_tokens=r.max_new_tokens,
        max_total_tokens=episode_settings(cfg, backend.max_prompt_tokens).max_total_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        max_n=max(16, r.num_generations),
    )
    endpoint = AgentEndpoint(settings, cast(Tokenizer, backend.tokenizer))
    names = AgentSettings(
        name=cfg.task.agent or "",
        model=model,
        timeout_s=r.agent_timeout_s,
        strict=cfg.task.strict_agents,
        generate_timeout_s=r.generate_timeout_s,
    )
    processes = None
    if r.agent_processes > 0 and cfg.task.agent is not None:
        from relayrl.agents.processes import AgentProcesses

        processes = AgentProcesses(cfg.task.agent, r.agent_processes)
    return AgentRollout(agent, endpoint, names, tracer, processes)


def assemble(
    cfg: Config,
    backend: Backend,
    state: RunState,
    rewards: Sequence[ResolvedReward],
    *,
    run_dir: Path | None,
    threads: OrchestratorThreads,
    callbacks: Sequence[Callback] = (),
    environment: Environment | None = None,
    heldout: Sequence[Prompt] = (),
    agent: AgentFn | None = None,
) -> RunParts:
    trainer = BoundedTrainer(backend.trainer, cfg.train.call_timeout_s)
    t = cfg.task
    worker_log = run_dir / REWARD_WORKERS_LOG if run_dir is not None else None
    settings = ScorerSettings(
        t.reward_workers, t.reward_timeout_s, t.reward_concurrency, t.reward_memory_mb, t.reward_cpu_s, t.reward_clip, worker_log
    )
    # the reward functions, on the scoring thread, in worker processes (started at their first
    # call, ended with the run) or on the loop; the held-out evaluator judges through it too
    scorer = Scorer(rewards, settings, threads)
    # a run whose groups are all filtered fails instead of spinning (orchestrator.max_filtered_per_step)
    state.ledger.watch = FilterWatch.of(cfg.rollout.groups_per_step, cfg.orchestrator.max_filtered_per_step, state.start_step + 1)
    logged = LoggedSteps(cfg.orchestrator.checkpoint_every if run_dir is not None else 0, state.ledger.as_dict())
    run_info: dict[str, object] = {
        "overlap_bookkeeping": cfg.orchestrator.overlap_bookkeeping,
        "max_staleness": cfg.rollout.max_staleness,
        "interruptible": cfg.rollout.interrupts,  # sampler loads run beside generate calls (the checker's actors rule)
        "groups_per_step": cfg.rollout.groups_per_step,
        "steps": cfg.run.steps,
        "backend": cfg.run.backend,
        "loop_thread": threading.current_thread().name,
        "first_step": state.start_step + 1,  # the first step this process trains (numbered from 1)
    }
    tracer = Tracer(run_dir / "trace.json" if run_dir else None, run_info)
    backend.attach_tracer(tracer)
    for name, seconds in backend.startup.items():  # before the run's clock started: ends at 0
        tracer.complete("orchestrator", name, -seconds, 0.0, seconds=round(seconds, 3))
    episodes = None
    if environment is not None:
        limits = episode_settings(cfg, backend.max_prompt_tokens)
        episodes = EpisodeRunner(environment, cfg.task.environment or "", backend.encode_text, limits, threads, tracer)
    agents = agent_rollout(cfg, backend, agent, tracer) if agent is not None else None
    # the held-out evaluator is the orchestrator's: the backend's greedy engine (built when the
    # run evaluates), rewarded through the run's scorer, judged correct by the task's own check
    # (a scorer of its own, which starts no process and never clips: a check's 1.0 must stay 1.0
    # whatever task.reward_clip), greedy episodes for multi-turn tasks
    evaluator = (
        HeldoutEvaluator(
            backend.greedy,
            heldout,
            backend.tokenize,
            backend.decode,
            cfg.eval.max_new_tokens,
            scorer=scorer,
            episodes=episodes,
            correctness=Scorer([correctness_check(cfg.task.kind)], dataclasses.replace(settings, clip=0.0, worker_log=None), threads),
        )
        if backend.greedy is not None and heldout
        else None
    )
    user_callbacks = list(callbacks)
    checkpointer = Checkpointer(
        run_dir=run_dir,
        policy=CheckpointPolicy(
            cfg.orchestrator.checkpoint_every, cfg.run.steps, cfg.orchestrator.keep_checkpoints, cfg.orchestrator.checkpoint_every_s
        ),
        backend_name=cfg.run.backend,
        trainer=trainer,
        threads=threads,
        tracer=tracer,
        logged=logged,
        state=state,
    )
    bookkeeper = StepBookkeeper(
        tracer=tracer,
        run_dir=run_dir,
        callbacks=[logged, state, *user_callbacks],
        host_work=backend.host_work,
        abort=threads.abort,
        log_trajectories=cfg.orchestrator.log_trajectories,
        release=cfg.orchestrator.release_memory,
        trim=cfg.orchestrator.malloc_trim,
        checkpoint_after=checkpointer.due,  # a checkpoint follows this step's logs
        sinks=build_sinks(
            run_dir,
            cfg.telemetry.sinks,
            cfg.run.name,
            cfg.model_dump(),
            project=cfg.telemetry.project,
            resume_step=state.start_step + 1 if state.resumed else None,  # each sink's record restarts at the checkpoint
        )
        if run_dir is not None
        else None,
    )
    eval_schedule = EvalSchedule(
        evaluator=evaluator,
        trainer=trainer,
        every=cfg.eval.every_steps,
        steps=cfg.run.steps,
        run_dir=run_dir,
        threads=threads,
        tracer=tracer,
        callbacks=user_callbacks,
        results=state.evals,
    )
    return RunParts(
        cfg=cfg,
        backend=backend,
        state=state,
        run_dir=run_dir,
        threads=threads,
        callbacks=user_callbacks,
        trainer=trainer,
        scorer=scorer,
        tracer=tracer,
        episodes=episodes,
        agents=agents,
        logged=logged,
        bookkeeper=bookkeeper,
        eval_schedule=eval_schedule,
        checkpointer=checkpointer,
    )
