"""The vLLM sampler replicas of the local compute kind (`rollout.engine = "vllm"`): a picklable
factory per replica, which starts that replica's engine in the process that calls it (the
driver's, or a Ray actor's).

Invariant: a factory carries only the config, the replica number and the model directory the local
kind resolved (`model.path`, `model.package` or the shipped tiny model); the engine reads the
model from that directory, never from the driver's loaded copy, so it is the same in any process
that sees the directory.
"""

from __future__ import annotations

from pathlib import Path

from relayrl.backends.protocols import Sampler
from relayrl.backends.vllm.engine import EngineSettings, context_length
from relayrl.config.schema import Config, ConfigError

__all__ = ["VllmSamplerFactory", "engine_settings"]


def engine_settings(cfg: Config, directory: Path) -> EngineSettings:
    """The engine settings of `cfg` for the model in `directory` (raises ConfigError for what
    vLLM cannot load here)."""
    if cfg.model.gguf_file:
        raise ConfigError("model.gguf_file is not supported with rollout.engine = 'vllm': give a safetensors model directory")
    return EngineSettings(model=str(directory), dtype=cfg.model.dtype, max_model_len=context_length(directory), seed=cfg.run.seed)


class VllmSamplerFactory:
    """Sampler replica `replica` on its own vLLM engine (see the module)."""

    def __init__(self, cfg: Config, replica: int, model_dir: Path) -> None:
        self.cfg = cfg
        self.replica = replica
        self.model_dir = model_dir

    def __call__(self) -> Sampler:
        from relayrl.backends.vllm.sampler import VllmSampler

        r = self.cfg.rollout
        return VllmSampler(
            engine_settings(self.cfg, self.model_dir),
            temperature=r.temperature,
            max_new_tokens=r.max_new_tokens,
            replica=self.replica,
            seed=self.cfg.run.seed,
            interruptible=r.interrupts,
        )
