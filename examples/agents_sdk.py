"""An agent of the OpenAI Agents SDK on mlx-actors' server: it calls a tool, then a second
agent gives a typed answer (a pydantic model, through ``response_format``).

    pip install 'mlx-actors[serve]' openai-agents
    python examples/agents_sdk.py                         # starts a server here
    python examples/agents_sdk.py http://127.0.0.1:8000   # or uses `mlx-actors serve`'s

The SDK speaks Chat Completions to the server; each of its runs is a session whose cache
the server keeps, so the request after the tool call prefills only the tool's result. The
default model (SmolLM2-135M) is told to call the tool (``tool_choice="required"``, which
the SDK lifts after the call) and often answers by echoing the result.
"""

import sys
from typing import Literal

import anyio
import pydantic
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

from mlx_actors import Runtime, run
from mlx_actors.server import listen, serve

set_tracing_disabled(True)  # the SDK would send traces to OpenAI


@function_tool
def get_weather(city: str) -> str:
    """Get the current weather in a city.

    Args:
        city: the city's name.
    """
    print(f"[tool] get_weather({city!r})")
    return f"The weather in {city} is sunny, 21 degrees."


class Forecast(pydantic.BaseModel):
    city: Literal["Paris", "London", "Rome"]
    sunny: bool


async def talk(url: str) -> None:
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none")
    name = (await client.models.list()).data[0].id
    model = OpenAIChatCompletionsModel(model=name, openai_client=client)
    forecaster = Agent(
        name="forecaster",
        instructions="You answer questions about the weather with the get_weather tool.",
        tools=[get_weather],
        model=model,
        model_settings=ModelSettings(tool_choice="required", max_tokens=60),
    )
    result = await Runner.run(forecaster, "What is the weather in Paris?")
    print(f"forecaster: {result.final_output}")
    reader = Agent(
        name="reader",
        instructions="Say which city is named and whether it is sunny there.",
        model=model,
        output_type=Forecast,
    )
    result = await Runner.run(reader, "It is sunny in Rome today.")
    print(f"reader: {result.final_output!r}")


async def main() -> None:
    if len(sys.argv) > 1:
        await talk(sys.argv[1].rstrip("/"))
        return
    async with Runtime() as rt, anyio.create_task_group() as tg:
        sock = listen("127.0.0.1", 0)  # any free port
        tg.start_soon(lambda: serve(rt, sock=sock))
        await talk(f"http://127.0.0.1:{sock.getsockname()[1]}")
        tg.cancel_scope.cancel()


run(main)
