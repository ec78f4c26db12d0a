"""The vLLM sampler replicas of the local compute kind (`rollout.engine = "vllm"`): a picklable
factory per replica, which starts that replica's engine in the process that calls it (the
driver's, or a Ray actor's), with settings resolved for its device.

Placement: replica i computes on rollout.replica_devices[i] when given, else rollout.device,
resolved in the process that starts it (`relayrl.backends.local.devices`: on Ray the GPU Ray
gave the actor). A CUDA build of vLLM (torch built for CUDA) cannot run on the CPU: such a
replica on "cpu" is refused in one line. On CUDA its gpu_memory_utilization is the driver's plan
(config/sizing.py: what the trainer, the evaluation's engine and the other replicas on that GPU
leave), or rollout.gpu_memory_utilization, or on Ray the replica's GPU share × vLLM's default.

Invariant: a factory carries only the config, the replica number, the model directory the local
kind resolved (`model.path`, `model.package` or the shipped tiny model; a `model.gguf_file` there
converted once to a Hugging Face directory in relayrl's cache, relayrl.models.gguf_dir) and the
planned memory share; the engine reads the model from that directory, never from the driver's loaded copy, so
it is the same in any process that sees the directory.
"""

from __future__ import annotations

from pathlib import Path

import torch

from relayrl.backends.local.devices import Accelerators, process_device
from relayrl.backends.protocols import Sampler
from relayrl.backends.transports import resolve
from relayrl.backends.vllm.engine import EngineSettings, context_length
from relayrl.config.schema import Config, ConfigError
from relayrl.config.sizing import VLLM_MAX_UTILIZATION

__all__ = ["VllmSamplerFactory", "check_on_driver", "engine_dtype", "engine_settings", "replica_device", "replica_key"]


def replica_key(cfg: Config, replica: int) -> tuple[str, str]:
    """(config key, device spec) placing sampler replica `replica`."""
    if cfg.rollout.replica_devices:
        return f"rollout.replica_devices[{replica}]", cfg.rollout.replica_devices[replica]
    return "rollout.device", cfg.rollout.device


def _refuse_cpu_on_cuda_build(key: str, spec: str, accel: Accelerators) -> None:
    if accel.cuda_build is not None:
        raise ConfigError(
            f"{key} = {spec!r} with rollout.engine = 'vllm': this vLLM is a CUDA build (torch {torch.__version__}, CUDA "
            f"{accel.cuda_build}), which cannot run on the CPU; set {key} = 'cuda', 'cuda:N' or 'auto'"
        )


def replica_device(cfg: Config, replica: int, accel: Accelerators | None = None) -> torch.device:
    """The device replica `replica`'s engine computes on, as this process sees it (a DeviceError,
    exit 2, for one the machine lacks, or for the CPU with a CUDA build)."""
    key, spec = replica_key(cfg, replica)
    device = process_device(spec, key, ray=cfg.ray.enabled)
    if device.type == "cpu":
        _refuse_cpu_on_cuda_build(key, spec, accel if accel is not None else Accelerators.probe())
    return device


def check_on_driver(cfg: Config) -> None:
    """On Ray, before any actor starts: replicas asked onto "cpu" from a driver whose torch is a
    CUDA build (so is the cluster's vLLM, as a rule) are refused here rather than in their actors
    (no GPU is asked for them: rollout.device = "cpu", the default, asks Ray for none)."""
    if cfg.ray.enabled:
        key, spec = replica_key(cfg, 0)
        if spec == "cpu":
            _refuse_cpu_on_cuda_build(key, spec, Accelerators.probe())


def engine_dtype(name: str, device: torch.device, accel: Accelerators) -> str:
    """The dtype vLLM computes in for `model.dtype` = `name` on `device`: bfloat16 for the bf16
    dtypes, and for "auto" on a CUDA device that supports it; else float32."""
    if name.startswith("bfloat16") or (name == "auto" and device.type == "cuda" and accel.bf16):
        return "bfloat16"
    return "float32"


def engine_settings(cfg: Config, directory: Path, replica: int = 0, utilization: float | None = None) -> EngineSettings:
    """The engine settings of replica `replica` of `cfg` for the model in `directory`, on its
    device (raises ConfigError for what vLLM cannot load or run here). `utilization`: its planned
    share of its GPU (the driver's plan; None: see the module)."""
    accel = Accelerators.probe()
    device = replica_device(cfg, replica, accel)
    cuda = device.type == "cuda"
    seeding = cfg.rollout.vllm_seeding
    share = None
    if cuda:
        gpus = cfg.ray.sampler_resources.get("GPU", 1.0) if cfg.ray.enabled else 1.0
        share = utilization or cfg.rollout.gpu_memory_utilization or round(min(1.0, gpus) * VLLM_MAX_UTILIZATION, 4)
    return EngineSettings(
        model=str(directory),
        dtype=engine_dtype(cfg.model.dtype, device, accel),
        max_model_len=context_length(directory),
        seed=cfg.run.seed,
        cuda_device=(device.index or 0) if cuda else None,
        gpu_memory_utilization=share,
        seed_requests=seeding == "request" or (seeding == "auto" and not cuda),
        # the collective transport received in the engine's worker, in one process
        # (relayrl.backends.vllm.broadcast) or in a Ray sampler actor (relayrl.backends.ray.collective);
        # "auto" may resolve to it on CUDA, and does on Ray (unused, the engine stays out of any group)
        weight_transfer=resolve(cfg) == "collective" or (cfg.rollout.weight_transport == "auto" and cuda),
    )


class VllmSamplerFactory:
    """Sampler replica `replica` on its own vLLM engine (see the module); `utilization`: its share
    of its GPU as the driver planned it (None: resolved where it starts)."""

    def __init__(self, cfg: Config, replica: int, model_dir: Path, utilization: float | None = None) -> None:
        self.cfg = cfg
        self.replica = replica
        self.model_dir = model_dir
        self.utilization = utilization

    def __call__(self) -> Sampler:
        from relayrl.backends.vllm.sampler import VllmSampler

        r = self.cfg.rollout
        return VllmSampler(
            engine_settings(self.cfg, self.model_dir, self.replica, self.utilization),
            temperature=r.temperature,
            max_new_tokens=r.max_new_tokens,
            replica=self.replica,
            seed=self.cfg.run.seed,
            interruptible=r.interrupts,
        )
