"""A real agent framework against the server, on the embedded default model: the OpenAI
Agents SDK's agent calls a tool and answers, and a typed answer comes through
``response_format`` (``examples/agents_sdk.py``, run as a user runs it). This is where the
default model's tool use is checked: its template knows nothing of tools, so it is told
of them in its system prompt, calls the tool with the city asked and answers from the
result (tool conversations equal mlx-lm's on the tiny models, in ``tests/actors``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).parents[2] / "examples" / "agents_sdk.py"


@pytest.mark.smollm
def test_the_agents_sdk_runs_a_tool_and_a_typed_answer_on_the_default_model() -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.count("[tool] get_weather") == 1  # called once...
    assert out.startswith("[tool] get_weather('Paris')\nforecaster: ")  # ...with the city asked
    forecast = out[out.index("forecaster: ") : out.index("reader: ")]
    assert "sunny, 21 degrees" in forecast  # answered from the tool's result
    assert out.endswith("reader: Forecast(city='Rome', sunny=True)\n")
