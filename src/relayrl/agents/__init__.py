"""Agents: rollouts through an OpenAI-compatible endpoint (`task.agent`).

Contract: context (what an agent gets, resolving `task.agent`), endpoint (the FastAPI app on the
run's loop, auth, routing a call to its episode's replica), transcript (calls → token-exact
training samples), chat (templates and tool calls), tasks (an agent call's own task, the
tasks it starts ended with its episode, its steps timed). The agent stage is orchestrator/stages/agents.py.
"""
