"""The vLLM rollout engine (`rollout.engine = "vllm"`): each sampler replica is one vLLM `AsyncLLM`
engine, next to the local backend's trainer.

Modules: `engine` (engine settings and start-up), `worker` (the extension vLLM loads into its
worker process: in-place weight reload), `sampler` (the `Sampler` on one engine), `build` (the
picklable factory the local compute kind uses for its sampler replicas). Importing this package
imports no vLLM; `engine` and `sampler` do.
"""
