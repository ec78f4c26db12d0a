"""A "draft, then answer" arithmetic agent through /v1/completions (`task.agent =
"examples/agents/completions_agent.py:agent"`; the recipe src/relayrl/recipes/agent.toml trains it
on the shipped tiny model, which has no chat template).

Each episode makes two calls with the `openai` client: the first drafts an answer to the prompt
("23+9="), the second is shown the draft and the question again ("23+9=31\n23+9=") and gives the
final answer. The second prompt extends the first call's prompt and completion, so relayrl trains
both calls' tokens as one sequence (the draft and the answer trained, the rest context). The
episode's reward: 1 for a right final answer, plus 0.5 when the draft was already right.
"""

from __future__ import annotations

from typing import Any

import openai


async def agent(ctx: Any) -> float:
    # the endpoint is plain HTTP on loopback: no TLS, so no CA certificates to load (~70 ms a client)
    http = openai.DefaultAsyncHttpxClient(verify=False)
    async with openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0, http_client=http) as client:
        question = ctx.prompt.text
        draft = await client.completions.create(model=ctx.model, prompt=question, max_tokens=4)
        first = draft.choices[0].text.strip()
        final = await client.completions.create(model=ctx.model, prompt=f"{question}{first}\n{question}", max_tokens=4)
        answer = final.choices[0].text.strip()
    return float(answer == ctx.prompt.answer) + 0.5 * float(first == ctx.prompt.answer)
