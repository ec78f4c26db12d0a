"""The documented Python API's old home: `relayrl.run.build_program` (README, "Writing a reward
function"). The run is built in `relayrl.orchestrator.build`; this module only re-exports it."""

from relayrl.orchestrator.build import build_program

__all__ = ["build_program"]
