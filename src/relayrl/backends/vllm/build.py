"""The vLLM sampler replicas of the local compute kind (`rollout.engine = "vllm"`): a picklable
factory per replica, which starts that replica's engine in the process that calls it (the
driver's, or a Ray actor's).

Invariant: a factory carries only the config and the replica number; the engine reads the model
from its directory (`model.path`, `model.package` or the shipped tiny model), never from the
driver's loaded copy, so it is the same in any process.
"""

from __future__ import annotations

from relayrl.backends.local.build import model_dir
from relayrl.backends.protocols import Sampler
from relayrl.backends.vllm.engine import EngineSettings, context_length
from relayrl.config.schema import Config, ConfigError

__all__ = ["VllmSamplerFactory", "engine_settings"]


def engine_settings(cfg: Config) -> EngineSettings:
    """The engine settings of `cfg` (raises ConfigError for what vLLM cannot load here)."""
    if cfg.model.gguf_file:
        raise ConfigError("model.gguf_file is not supported with rollout.engine = 'vllm': give a safetensors model directory")
    directory = model_dir(cfg)
    return EngineSettings(model=str(directory), dtype=cfg.model.dtype, max_model_len=context_length(directory), seed=cfg.run.seed)


class VllmSamplerFactory:
    """Sampler replica `replica` on its own vLLM engine (see the module)."""

    def __init__(self, cfg: Config, replica: int) -> None:
        self.cfg = cfg
        self.replica = replica

    def __call__(self) -> Sampler:
        from relayrl.backends.vllm.sampler import VllmSampler

        r = self.cfg.rollout
        return VllmSampler(
            engine_settings(self.cfg),
            temperature=r.temperature,
            max_new_tokens=r.max_new_tokens,
            replica=self.replica,
            seed=self.cfg.run.seed,
        )
