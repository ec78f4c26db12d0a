"""The benchmark bodies behind `relayrl bench` (boundary, control plane, e2e, Ray scale): each runs a
workload and returns printed figures with a baseline measured in the same run. Not imported by a
training run."""
