"""The pipeline stages: dispatch, sample, collect, episodes, score, advantage, sync, train loop. Each
is one asyncio task (or one per replica) fed by queues; each module's docstring states its
invariant, and docs/design.md the rules they keep together."""
