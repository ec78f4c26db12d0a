"""The Ray host (`ray.enabled`, see `relayrl.backends.registry`): the compute kind's sampler
replicas and trainer, each built by its factory in its own Ray actor (`relayrl.backends.ray.actors`),
on a cluster the run starts or joins. It knows no compute kind.

What runs where: the actors host the sampler / trainer compute (each calls its factory in its own
process: the local kind loads the model there); the driver (this process) keeps the orchestrator
and the kind's driver-side pieces: the prompt and text encoders, the collator (micro-batches are
collated here and sent to the trainer actor), the held-out evaluation's greedy engine (loading
weights that arrive by object-store reference) and the sim's simulated host work.

Invariant: the cluster is closed with the backend (`Backend.cleanup`), and at once if building
fails; a started cluster is shut down, a joined one is left running.
"""

from __future__ import annotations

import functools
from typing import Any

from relayrl.backends.bundle import Backend
from relayrl.backends.protocols import Sampler
from relayrl.backends.ray.cluster import RayCluster, connect
from relayrl.backends.registry import Compute
from relayrl.config.schema import Config

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


def place_on_ray(cfg: Config, compute: Compute, evaluate: bool) -> Backend:
    """A `Backend` whose samplers and trainer are Ray actors built by `compute`'s factories;
    `evaluate`: build the greedy engine (in this process) for the held-out evaluation."""
    cluster = connect(cfg.ray)
    actors: list[Any] = []
    try:
        return _place(cfg, compute, evaluate, cluster, actors)
    except BaseException:
        _kill(actors)
        cluster.close()
        raise


def _place(cfg: Config, compute: Compute, evaluate: bool, cluster: RayCluster, actors: list[Any]) -> Backend:
    import ray

    from relayrl.backends.ray.actors import RaySampler, RayTrainer, ResolvingEngine, SamplerActor, TrainerActor, attach_tracer

    sampler_opts = actor_options(cfg.ray.sampler_resources)
    trainer_opts = actor_options(cfg.ray.trainer_resources)
    trainer_actor = TrainerActor.options(**trainer_opts).remote(compute.trainer)
    actors.append(trainer_actor)
    sampler_actors = []
    for factory, placement in zip(compute.samplers, spread(len(compute.samplers), cfg.ray.sampler_resources), strict=True):
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
    greedy = ResolvingEngine(compute.greedy_engine()) if evaluate and compute.greedy_engine is not None else None
    trainer = RayTrainer(trainer_actor, queue_ahead=cfg.ray.queue_ahead)
    ray_samplers = [RaySampler(a, i) for i, a in enumerate(sampler_actors)]
    samplers: list[Sampler] = list(ray_samplers)
    return compute.backend(
        trainer=trainer,
        samplers=samplers,
        greedy=greedy,
        startup={"ray_start": cluster.start_seconds},
        cleanup=cluster.close,
        attach_tracer=functools.partial(attach_tracer, [trainer, *ray_samplers]),
    )


def _kill(actors: list[Any]) -> None:
    import ray

    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:
            pass


__all__ = ["actor_options", "place_on_ray"]
