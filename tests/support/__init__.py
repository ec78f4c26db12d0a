"""Helpers shared by the tests in unit/, integration/ and ray/ (importable as `support.x`: the
tests folder is on sys.path through its conftest.py): trajectories, the CLI runner, a quick sim
config and checked runs, a random Qwen2, a local Ray cluster. No test lives here."""
