"""Agents that act: a clerk with a calculator and a file reader as tools, and a judge whose
verdict is a pydantic model the script branches on.

    python examples/tools.py [MODEL]

The default model (SmolLM2-135M) seldom calls a tool on its own, so the clerk is told to
(``tool_choice``): its first reply is then a call, and it answers from the result. A
model that small often only echoes the result it was shown, markup and all
(``<tool_response>``); a larger model (its path as MODEL) answers from it.
"""

import sys
from pathlib import Path

import pydantic

from mlx_actors import Runtime, run

HERE = Path(__file__).parent.resolve()


def multiply(a: float, b: float) -> float:
    """Multiply two numbers.

    Args:
        a: the first factor.
        b: the second factor.
    """
    return a * b


def read_file(name: str) -> str:
    """Read a file of the examples folder.

    Args:
        name: the file's name, such as "debate.py".
    """
    path = (HERE / name).resolve()
    if path.parent != HERE:
        raise ValueError("only files of the examples folder can be read")
    return path.read_text()[:1500]


class Verdict(pydantic.BaseModel):
    correct: bool
    reason: str = pydantic.Field(max_length=100)


async def main(model: str | None) -> None:
    async with Runtime(model, log_level="warning") as rt:
        clerk = await rt.spawn(
            "clerk", system="You are a careful clerk.", tools=[multiply, read_file], max_tokens=96
        )
        answer = await clerk.ask("What is 12.5 times 8?", tool_choice="multiply")
        for call in answer.tool_calls:
            print(f"clerk called {call.name}({call.arguments}) -> {call.result!r}")
        print("clerk:", answer.text)
        summary = await clerk.ask("What does debate.py do? One sentence.", tool_choice="read_file")
        (call,) = summary.tool_calls
        print(f"clerk read {call.arguments} ({len(call.result or '')} characters)")
        print("clerk:", summary.text)

        judge = await rt.spawn("judge", system="You check a clerk's answers.", max_tokens=96)
        question = f"The clerk said 12.5 times 8 is: {answer.text}\nIs that correct?"
        verdict = (await judge.ask(question, schema=Verdict)).data
        if verdict.correct:
            print("judge: correct,", verdict.reason)
        else:
            print("judge: wrong,", verdict.reason)


if __name__ == "__main__":
    run(main, sys.argv[1] if len(sys.argv) > 1 else None)
