"""The Ray host (`ray.enabled`, see `relayrl.backends.registry`): the compute kind's sampler
replicas and trainer, each built by its factory in its own Ray actor (`relayrl.backends.ray.actors`),
on a cluster the run starts or joins. It knows no compute kind.

What runs where: the actors host the sampler / trainer compute (each calls its factory in its own
process: the local kind loads the model there); the driver (this process) keeps the orchestrator
and the kind's driver-side pieces: the prompt and text encoders, the collator (micro-batches are
collated here and sent to the trainer actor), the held-out evaluation's greedy engine (loading
weights that arrive by object-store reference; on the CPU: this process is outside Ray's GPU
accounting, so it takes no GPU an actor may have been given) and the sim's simulated host work.

Start-up says what it does on the console (`cluster.say`): the cluster started or joined, the
actors starting, each actor ready (its worker built: the local kind loads the model there), the
evaluation's engine loading here.

Resources: before any actor starts, what the actors ask for (`ray.trainer_resources`, and
`ray.sampler_resources` once per replica) is compared with what the cluster has in all
(`ray.cluster_resources()`) and on its largest node; a request it cannot satisfy is refused in
one line naming the key, the actor and what the cluster has (a ConfigError, exit 2), instead of
waiting for ever. (An autoscaling cluster is judged by the nodes it has now.) Actors that still
do not start (resources held by others, a node lost) fail the build after READY_TIMEOUT_S,
naming them, what they ask for and what the cluster has free.

GPUs: an actor whose device (train.device, rollout.device) is CUDA asks for one GPU, unless its
`ray.*_resources` names GPU itself (`with_gpu`); "auto" asks for one when the cluster has any.
Ray then sets the actor's CUDA_VISIBLE_DEVICES, and the actor resolves its device itself (the
local kind: `relayrl.backends.local.devices`). The sim computes nowhere and asks for none.

Sharded trainer (train.world_size = N > 1): the trainer is N actors, one per rank, in a placement
group of N bundles of `ray.trainer_resources` (strategy PACK; see `relayrl.backends.ray.ranks`),
rank 0 the trainer actor the driver talks to; the resource check counts N of them. The placement
group is removed with the backend.

Invariant: the cluster is closed with the backend (`Backend.cleanup`), and at once if building
fails; a started cluster is shut down, a joined one is left running.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from relayrl.backends.bundle import Backend
from relayrl.backends.protocols import Sampler
from relayrl.backends.ray.cluster import RayCluster, connect, say
from relayrl.backends.registry import Compute
from relayrl.backends.transports import resolve
from relayrl.config.schema import Config, ConfigError, is_cuda_spec
from relayrl.config.sizing import StoreNeed, check_joined_store, object_store_mb, store_need

READY_TIMEOUT_S = 300.0  # actors that cannot be placed (resources the cluster lacks) fail the build


DEFAULT_BUNDLE: dict[str, float] = {"CPU": 1.0}  # a sharded trainer rank's bundle when ray.trainer_resources is empty
# Ray starts each worker process 15 nicer than its raylet (its worker_niceness), so the trainer
# actor ran below the driver (the orchestrator) and Ray's own processes, where in one process the
# trainer and sampler threads run at the orchestrator's priority: on 2 busy cores the trainer
# actor then waited behind the driver's packing, bookkeeping and Ray replies (bench e2e --ray D/C
# 0.66-0.73; its train_step spans up to 1.8x as long as at 0 in the same run, on the same CPU
# time). Each actor asks for 0 (read by the worker process at its start, as Ray's own job
# supervisor does): the raylet's priority, i.e. the driver's on a cluster the run started.
ACTOR_ENV: dict[str, str] = {"RAY_worker_niceness": "0"}


def actor_options(resources: dict[str, float]) -> dict[str, Any]:
    """`ray.remote` options for a `ray.*_resources` table: CPU → num_cpus, GPU → num_gpus, the
    rest as custom resources; every actor runs at the driver's priority (`ACTOR_ENV`)."""
    options: dict[str, Any] = {"runtime_env": {"env_vars": dict(ACTOR_ENV)}}
    custom = {k: v for k, v in resources.items() if k not in ("CPU", "GPU")}
    if "CPU" in resources:
        options["num_cpus"] = resources["CPU"]
    if "GPU" in resources:
        options["num_gpus"] = resources["GPU"]
    if custom:
        options["resources"] = custom
    return options


def with_gpu(resources: dict[str, float], device: str, cluster_gpus: float) -> dict[str, float]:
    """An actor's resources: `resources` (a `ray.*_resources` table) plus one GPU when its `device`
    spec is CUDA, or "auto" on a cluster with a GPU; a table that names GPU is kept as it is."""
    if "GPU" in resources:
        return resources
    if is_cuda_spec(device) or (device == "auto" and cluster_gpus > 0):
        return {**resources, "GPU": 1.0}
    return resources


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


def _amount(value: float) -> str:
    return f"{value:g}"


def _table(resources: Mapping[str, float]) -> str:
    """Resources as a recipe writes them: {CPU=1, GPU=1}."""
    return "{" + ", ".join(f"{name}={_amount(amount)}" for name, amount in sorted(resources.items())) + "}"


def _asking(resources: Mapping[str, float]) -> str:
    return f" {_table(resources)}" if resources else ""


def _schedulable(resources: Mapping[str, float]) -> dict[str, float]:
    """A cluster's or node's resources that actors ask for (not its memory nor its `node:` labels)."""
    return {
        name: float(amount)
        for name, amount in resources.items()
        if not name.startswith("node:") and name not in ("memory", "object_store_memory") and not name.startswith("accelerator_type:")
    }


def _has(resources: Mapping[str, float]) -> str:
    return _table(resources) if resources else "none of them"


def check_resources(
    asks: Sequence[tuple[str, str, Mapping[str, float], int]], total: Mapping[str, float], nodes: Sequence[Mapping[str, float]]
) -> None:
    """Refuse (ConfigError) what the cluster cannot satisfy. `asks`: per kind of actor (its
    name, its config key, the resources one asks for, how many start); `total`: the cluster's
    resources (`ray.cluster_resources()`); `nodes`: each alive node's. An actor whose request
    fits on no single node, or all of them together asking more than the cluster has, is refused
    naming the key, the actor, the resource and what the cluster has."""
    have = _schedulable(total)
    for actor, key, resources, _ in asks:
        for name, amount in sorted(resources.items()):
            if amount > have.get(name, 0.0):
                has = f"{name}={_amount(have[name])}" if name in have else f"no {name}"
                raise ConfigError(
                    f"{key}={_table(resources)}: {actor} asks for {name}={_amount(amount)} but the Ray cluster has {has} "
                    f"(it has {_has(have)})"
                )
        if resources and nodes and not any(all(node.get(n, 0.0) >= a for n, a in resources.items()) for node in nodes):
            raise ConfigError(
                f"{key}={_table(resources)}: no node of the Ray cluster has all that {actor} asks for "
                f"(its nodes have {'; '.join(_has(_schedulable(node)) for node in nodes)})"
            )
    for name in sorted({n for _, _, resources, _ in asks for n in resources}):
        parts = [(key, resources[name], count) for _, key, resources, count in asks if resources.get(name, 0.0) > 0]
        need = sum(amount * count for _, amount, count in parts)
        if need > have.get(name, 0.0) + 1e-9:
            said = " and ".join(f"{key} ({name}={_amount(amount)}) × {count}" for key, amount, count in parts)
            raise ConfigError(
                f"the Ray actors ask for {name}={_amount(need)} in all ({said}) but the Ray cluster has "
                f"{name}={_amount(have.get(name, 0.0))}: lower them, or run fewer sampler replicas (rollout.num_samplers)"
            )


def place_on_ray(cfg: Config, compute: Compute, evaluate: bool) -> Backend:
    """A `Backend` whose samplers and trainer are Ray actors built by `compute`'s factories;
    `evaluate`: build the greedy engine (in this process) for the held-out evaluation."""
    need = _store_need(cfg)
    ray_cfg = cfg.ray
    if not ray_cfg.address:  # a cluster this run starts: its object store sized, or a size too small refused
        mb = object_store_mb(cfg, need)
        if ray_cfg.object_store_mb == 0 and need is not None:
            say(f"ray.object_store_mb = 0: an object store of {mb:,} MB, sized from the model (it must hold {need.why()})")
        ray_cfg = ray_cfg.model_copy(update={"object_store_mb": mb})
    cluster = connect(ray_cfg)
    actors: list[Any] = []
    cleanups: list[Callable[[], None]] = []  # before the cluster closes (the trainer's placement group)
    try:
        if not cluster.owned:
            import ray

            stores = [float(n["Resources"].get("object_store_memory", 0.0)) for n in ray.nodes() if n.get("Alive")]
            check_joined_store(need, stores, ray_cfg.address or cluster.address)
        return _place(cfg, compute, evaluate, cluster, actors, cleanups)
    except BaseException:
        _kill(actors)
        _close(cleanups, cluster)
        raise


def _store_need(cfg: Config) -> StoreNeed | None:
    """What the run puts in the object store at once (`relayrl.config.sizing.store_need`); None
    for the sim (no model) or a model whose shape is unknown."""
    if cfg.run.backend != "local":
        return None
    from relayrl.backends.local.build import model_dir

    return store_need(cfg, model_dir(cfg))


def _close(cleanups: list[Callable[[], None]], cluster: RayCluster) -> None:
    for cleanup in cleanups:
        try:
            cleanup()
        except Exception:
            pass
    cluster.close()


def _remove_group(group: Any) -> None:
    from ray.util.placement_group import remove_placement_group

    remove_placement_group(group)


def _place(
    cfg: Config, compute: Compute, evaluate: bool, cluster: RayCluster, actors: list[Any], cleanups: list[Callable[[], None]]
) -> Backend:
    import ray

    from relayrl.backends.ray.actors import RaySampler, RayTrainer, ResolvingEngine, SamplerActor, TrainerActor, attach_tracer

    replicas = len(compute.samplers)
    total = ray.cluster_resources()
    trainer_res, trainer_key = cfg.ray.trainer_resources, "ray.trainer_resources"
    sampler_res, sampler_key = cfg.ray.sampler_resources, "ray.sampler_resources"
    if cfg.run.backend != "sim":  # the workers compute on their devices: CUDA ones ask for a GPU
        gpus = float(total.get("GPU", 0.0))
        trainer_res = with_gpu(trainer_res, cfg.train.device, gpus)
        # (vLLM replicas given their own GPUs, rollout.replica_devices: each actor asks for one)
        sampler_device = cfg.rollout.replica_devices[0] if cfg.rollout.replica_devices else cfg.rollout.device
        sampler_res = with_gpu(sampler_res, sampler_device, gpus)
        if trainer_res is not cfg.ray.trainer_resources:
            trainer_key += f" (with train.device = {cfg.train.device!r})"
        if sampler_res is not cfg.ray.sampler_resources:
            sampler_key += f" (with rollout.device = {sampler_device!r})"
    ranks = cfg.train.world_size  # > 1: one trainer actor per rank, in a placement group (ray/ranks.py)
    transport = resolve(cfg, trainer_on_cuda="GPU" in trainer_res)
    if ranks > 1:
        trainer_res = trainer_res or dict(DEFAULT_BUNDLE)
    check_resources(
        [
            ("the trainer actor" if ranks == 1 else f"each of the {ranks} trainer rank actors", trainer_key, trainer_res, ranks),
            ("each sampler actor", sampler_key, sampler_res, replicas),
        ],
        total,
        [node.get("Resources", {}) for node in ray.nodes() if node.get("Alive")],
    )
    sampler_opts = actor_options(sampler_res)
    trainer_opts = actor_options(trainer_res)
    started = time.perf_counter()
    trainer_is = "the trainer" if ranks == 1 else f"the trainer's {ranks} ranks (a placement group, PACK)"
    say(
        f"starting {ranks + replicas} Ray actors: {trainer_is}{_asking(trainer_res)} and {replicas} sampler "
        f"replica{'s' if replicas != 1 else ''}{_asking(sampler_res)}; each builds its worker (loads its model)"
    )
    group = None
    rank_actors: list[Any] = []
    if ranks > 1:
        from relayrl.backends.ray.ranks import place_ranks

        stream = transport == "collective"  # each rank streams its shards (collective.py)
        group, trainer_actor, rank_actors = place_ranks(compute.trainer, ranks, trainer_res, trainer_opts, stream)  # type: ignore[arg-type]
        cleanups.append(functools.partial(_remove_group, group))
    else:
        trainer_actor = TrainerActor.options(**trainer_opts).remote(compute.trainer)
    actors.append(trainer_actor)
    actors.extend(rank_actors)
    sampler_actors = []
    for factory, placement in zip(compute.samplers, spread(replicas, sampler_res), strict=True):
        actor = SamplerActor.options(**sampler_opts, **placement).remote(factory)
        actors.append(actor)
        sampler_actors.append(actor)
    names = ["trainer" if ranks == 1 else "trainer rank 0", *(f"trainer rank {r}" for r in range(1, ranks))]
    names += [f"sampler {i}" for i in range(replicas)]
    asks = [*([trainer_res] * ranks), *([sampler_res] * replicas)]
    _await_ready(actors, names, asks, started)
    say(f"Ray actors ready in {time.perf_counter() - started:.1f}s")
    greedy = None
    if evaluate and compute.greedy_engine is not None:
        say("loading the held-out evaluation's engine in this process (on the CPU)")
        greedy = ResolvingEngine(compute.greedy_engine())
    trainer = RayTrainer(trainer_actor, queue_ahead=cfg.ray.queue_ahead, ranks=ranks)
    ray_samplers = [RaySampler(a, i, interruptible=cfg.rollout.interrupts) for i, a in enumerate(sampler_actors)]
    samplers: list[Sampler] = list(ray_samplers)
    broadcast = None
    if transport == "collective":
        from relayrl.backends.ray.collective import join

        started = time.perf_counter()
        broadcast = join(trainer, ray_samplers, cfg.rollout.weight_load_timeout_s)
        took = time.perf_counter() - started
        who = "the trainer" if ranks == 1 else f"the trainer's {ranks} ranks"
        say(f"rollout.weight_transport = collective: {who} and {replicas} sampler actors joined the weight group ({took:.1f}s)")
    backend = compute.backend(
        trainer=trainer,
        samplers=samplers,
        greedy=greedy,
        startup={"ray_start": cluster.start_seconds},
        cleanup=functools.partial(_close, cleanups, cluster),
        attach_tracer=functools.partial(attach_tracer, [trainer, *ray_samplers]),
    )
    backend.broadcast = broadcast
    return backend


def _await_ready(actors: Sequence[Any], names: Sequence[str], asks: Sequence[Mapping[str, float]], started: float) -> None:
    """Wait until every actor's constructor ran, saying each one that is ready; an actor whose
    constructor failed raises its error; those not ready within READY_TIMEOUT_S fail the build
    naming them, what they ask for and what the cluster has free."""
    import ray

    waiting = {actor.ready.remote(): i for i, actor in enumerate(actors)}
    deadline = started + READY_TIMEOUT_S
    while waiting:
        done, _ = ray.wait(list(waiting), num_returns=1, timeout=max(0.0, deadline - time.perf_counter()))
        if not done:
            late = sorted(waiting.values())
            what = ", ".join(f"{names[i]} {_table(asks[i])}" for i in late)
            raise RuntimeError(
                f"Ray actors did not start within {READY_TIMEOUT_S:.0f}s: {what} (the resources they ask for, "
                f"ray.trainer_resources / ray.sampler_resources); the cluster has {_has(_schedulable(ray.available_resources()))} free"
            )
        for ref in done:
            i = waiting.pop(ref)
            ray.get(ref)  # an actor whose constructor failed raises here
            say(f"{names[i]} actor ready ({time.perf_counter() - started:.1f}s)")


def _kill(actors: list[Any]) -> None:
    import ray

    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:
            pass


__all__ = ["actor_options", "check_resources", "place_on_ray", "with_gpu"]
