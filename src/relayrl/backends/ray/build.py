"""Build the Ray backend: the configured backend's sampler replicas and trainer, each in its own
Ray actor (`relayrl.backends.ray.actors`), on a cluster the run starts or joins.

What runs where: the actors host the sampler / trainer compute (for `run.backend = "local"` each
actor loads the model itself); the driver (this process) keeps the orchestrator, the prompt
encoder, the collator (micro-batches are collated here and sent to the trainer actor), the
held-out evaluator (local backend) and the sim's simulated host work.

Invariant: the cluster is closed with the backend (`Backend.cleanup`), and at once if building
fails; a started cluster is shut down, a joined one is left running.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

from relayrl.backends.bundle import Backend
from relayrl.backends.protocols import Collator, Evaluator, HostWork, PromptEncoder
from relayrl.backends.ray.cluster import RayCluster, connect
from relayrl.config.schema import Config
from relayrl.types import Prompt

READY_TIMEOUT_S = 300.0  # actors that cannot be placed (resources the cluster lacks) fail the build


def actor_options(resources: dict[str, float]) -> dict[str, Any]:
    """`ray.remote` options for a `ray.*_resources` table: CPU → num_cpus, GPU → num_gpus, the
    rest as custom resources."""
    options: dict[str, Any] = {}
    custom = {k: v for k, v in resources.items() if k not in ("CPU", "GPU")}
    if "CPU" in resources:
        options["num_cpus"] = resources["CPU"]
    if "GPU" in resources:
        options["num_gpus"] = resources["GPU"]
    if custom:
        options["resources"] = custom
    return options


def spread(replicas: int, resources: dict[str, float]) -> list[dict[str, Any]]:
    """Per replica, the scheduling option that spreads the replicas round robin over the alive
    nodes holding the resources they ask for (soft node affinity: Ray places a replica elsewhere
    if its node cannot take it). Ray's own SPREAD strategy is only a hint, and packs replicas
    that fit on one node there. One such node: no option (Ray's default)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = sorted(
        str(node["NodeID"])
        for node in ray.nodes()
        if node.get("Alive") and all(node.get("Resources", {}).get(name, 0.0) >= amount for name, amount in resources.items())
    )
    if len(nodes) < 2:
        return [{} for _ in range(replicas)]
    return [{"scheduling_strategy": NodeAffinitySchedulingStrategy(nodes[i % len(nodes)], soft=True)} for i in range(replicas)]


# -- factories, run inside the actor's process --------------------------------------------------
def _sim_sampler(cfg: Config, replica: int) -> Any:
    from relayrl.backends.sim.workers import SimSampler

    return SimSampler(cfg.sim, cfg.rollout.max_new_tokens, cfg.run.seed, replica=replica)


def _sim_trainer(cfg: Config) -> Any:
    from relayrl.backends.sim.workers import SimTrainer

    return SimTrainer(cfg.sim)


def _local_sampler(cfg: Config, replica: int, threads: int) -> Any:
    from relayrl.backends.local.build import load_base, make_sampler

    model, tokenizer = load_base(cfg)
    return make_sampler(cfg, model, tokenizer, replica, threads)


def _local_trainer(cfg: Config, threads: int) -> Any:
    from relayrl.backends.local.build import load_base, make_trainer

    model, _ = load_base(cfg)
    return make_trainer(cfg, model, threads)


def build_ray_backend(cfg: Config, heldout: Sequence[Prompt], abort: threading.Event) -> Backend:
    """A `Backend` whose samplers and trainer are Ray actors; `abort` is the orchestrator's abort
    flag (the sim collator's CPU burn checks it)."""
    cluster = connect(cfg.ray)
    actors: list[Any] = []
    try:
        return _build(cfg, heldout, abort, cluster, actors)
    except BaseException:
        _kill(actors)
        cluster.close()
        raise


def _build(cfg: Config, heldout: Sequence[Prompt], abort: threading.Event, cluster: RayCluster, actors: list[Any]) -> Backend:
    import ray

    from relayrl.backends.ray.actors import RaySampler, RayTrainer, ResolvingEngine, SamplerActor, TrainerActor, attach_tracer

    n = cfg.rollout.num_samplers
    collator: Collator
    tokenize: PromptEncoder
    evaluator: Evaluator | None = None
    host_work: HostWork | None = None
    prompt_bound: int | None = None
    if cfg.run.backend == "local":
        from relayrl.backends.local.build import (
            EncodeText,
            load_base,
            make_collator,
            make_evaluator,
            make_tokenize,
            max_prompt_tokens,
            worker_threads,
        )

        model, tokenizer = load_base(cfg)  # the driver's copy: tokenizer, collator, evaluator
        trainer_threads, sampler_threads = worker_threads(cfg)
        sampler_factories = [functools.partial(_local_sampler, cfg, i, sampler_threads) for i in range(n)]
        trainer_factory = functools.partial(_local_trainer, cfg, trainer_threads)
        collator = make_collator(cfg, tokenizer)
        tokenize = make_tokenize(cfg, tokenizer)
        evaluator = make_evaluator(cfg, model, tokenizer, heldout, sampler_threads, wrap=ResolvingEngine)
        prompt_bound = max_prompt_tokens(cfg, model)
        encode_text: Callable[[str], list[int]] = EncodeText(tokenizer)
    else:
        from relayrl.backends.sim.workers import SimCollator, SimHostWork, SimTokenizer, sim_encode_text

        sampler_factories = [functools.partial(_sim_sampler, cfg, i) for i in range(n)]
        trainer_factory = functools.partial(_sim_trainer, cfg)
        collator = SimCollator(cfg.sim, abort)
        tokenize = SimTokenizer(cfg.sim.prompt_tokens)
        host_work = SimHostWork(cfg)
        encode_text = sim_encode_text
    sampler_opts = actor_options(cfg.ray.sampler_resources)
    trainer_opts = actor_options(cfg.ray.trainer_resources)
    trainer_actor = TrainerActor.options(**trainer_opts).remote(trainer_factory)
    actors.append(trainer_actor)
    sampler_actors = []
    for factory, placement in zip(sampler_factories, spread(len(sampler_factories), cfg.ray.sampler_resources), strict=True):
        actor = SamplerActor.options(**sampler_opts, **placement).remote(factory)
        actors.append(actor)
        sampler_actors.append(actor)
    ready = [a.ready.remote() for a in actors]
    done, pending = ray.wait(ready, num_returns=len(ready), timeout=READY_TIMEOUT_S)
    if pending:
        raise RuntimeError(
            f"{len(pending)} of {len(ready)} Ray actors did not start within {READY_TIMEOUT_S:.0f}s: the cluster may lack the "
            f"resources they ask for (ray.sampler_resources={cfg.ray.sampler_resources}, ray.trainer_resources={cfg.ray.trainer_resources})"
        )
    ray.get(done)  # an actor whose constructor failed raises here
    trainer = RayTrainer(trainer_actor, queue_ahead=cfg.ray.queue_ahead)
    samplers = [RaySampler(a, i) for i, a in enumerate(sampler_actors)]
    return Backend(
        trainer=trainer,
        samplers=list(samplers),
        collator=collator,
        tokenize=tokenize,
        encode_text=encode_text,
        host_work=host_work,
        evaluator=evaluator,
        startup={"ray_start": cluster.start_seconds},
        cleanup=cluster.close,
        attach_tracer=functools.partial(attach_tracer, [trainer, *samplers]),
        max_prompt_tokens=prompt_bound,
    )


def _kill(actors: list[Any]) -> None:
    import ray

    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:
            pass


__all__ = ["actor_options", "build_ray_backend"]
