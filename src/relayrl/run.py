"""The documented Python API's home: `relayrl.run.build_program` (docs/rewards.md). The run is
built in `relayrl.orchestrator.build`; this module only re-exports it."""

from relayrl.orchestrator.build import build_program

__all__ = ["build_program"]
