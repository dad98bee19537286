"""Ctrl-C: a script run with ``mlx_actors.run`` stops within a short step, mid-prefill or
mid-decode, on asyncio and trio, says ``interrupted`` (no traceback), exits with 130, and
the turn it interrupted is undone (a new runtime on its state directory finds the agent
as it was)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import anyio
import pytest

from mlx_actors import Runtime
from mlx_actors.runtime._main import STOPPING
from mlx_actors.testing import tiny_config, write_random_model

#: As Python starts on a terminal: a shell that runs the suite in the background has
#: its children ignore Ctrl-C, and a script that ignores it is left so by ``run``.
CTRL_C = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)"

SCRIPT = CTRL_C + textwrap.dedent(
    """
    import sys
    from mlx_actors import Runtime, run

    async def main(model, state, trace, mode):
        async with Runtime(model, pool_blocks=400, state_dir=state, trace=trace,
                           log_level="off") as rt:
            agent = rt.agents.get("ann") or await rt.spawn("ann", max_tokens=100_000)
            if mode == "prefill":
                await agent.ask("x" * 3000)  # seconds of prefill on this model and CPU
            else:
                async with agent.stream("Go on.") as pieces:
                    async for piece in pieces:
                        print("decoding", flush=True)

    run(main, *sys.argv[1:4], sys.argv[4], backend=sys.argv[5])
    """
)


@pytest.fixture(scope="module")
def slow_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model slow enough on a small CPU that a prefill of 3000 tokens takes seconds."""
    return write_random_model(
        tmp_path_factory.mktemp("models") / "slow",
        tiny_config(
            num_hidden_layers=8,
            hidden_size=256,
            intermediate_size=512,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=32,
        ),
        seed=1,
    )


def wait_for(trace: Path, event: str, proc: subprocess.Popen[str], limit: float = 120) -> None:
    """Until the process's trace has ``event`` (polled: the trace is written as it goes)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        if trace.exists() and any(
            json.loads(line).get("event") == event for line in trace.read_text().splitlines()
        ):
            return
        time.sleep(0.05)
    raise AssertionError(f"no {event} in {trace}")


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_ctrl_c_stops_within_a_step_with_one_line_and_undoes_the_turn(
    slow_dir: Path, tmp_path: Path, mode: str, backend: str
) -> None:
    state, trace = tmp_path / "state", tmp_path / "run.jsonl"
    args = [sys.executable, "-c", SCRIPT, str(slow_dir), str(state), str(trace), mode, backend]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if mode == "prefill":
        wait_for(trace, "batch.step", proc)  # the prompt's prefill is under way
    else:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "decoding"
    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    assert not any(e["event"] == "turn.finished" for e in steps)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    took = time.monotonic() - sent
    assert proc.returncode == 130, err
    assert err == f"{STOPPING}\ninterrupted\n"
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    longest = max((e["ms"] for e in events if e["event"] == "batch.step"), default=0)
    assert took < 5 + longest / 1e3, (took, longest)  # the step under way, then out

    async def check() -> None:
        async with Runtime(slow_dir, pool_blocks=400, state_dir=state, log_level="off") as rt:
            assert rt.agent("ann").history == ()  # the interrupted turn was undone

    anyio.run(check)


#: A script whose clean-up after a Ctrl-C takes long (shielded): only a second Ctrl-C
#: shortens it. The runtime is still open meanwhile, its engine thread running.
SLOW_EXIT = CTRL_C + textwrap.dedent(
    """
    import sys
    import anyio
    from mlx_actors import Runtime, run

    async def main(model, state, trace):
        async with Runtime(model, pool_blocks=400, state_dir=state, trace=trace,
                           log_level="off") as rt:
            agent = rt.agents.get("ann") or await rt.spawn("ann", max_tokens=100_000)
            try:
                await agent.ask("x" * 3000)
            finally:
                with anyio.CancelScope(shield=True):
                    print("cleaning up", flush=True)
                    await anyio.sleep(600)

    run(main, *sys.argv[1:4], backend=sys.argv[4])
    """
)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_second_ctrl_c_stops_at_once_with_one_line(
    slow_dir: Path, tmp_path: Path, backend: str
) -> None:
    state, trace = tmp_path / "state", tmp_path / "run.jsonl"
    args = [sys.executable, "-c", SLOW_EXIT, str(slow_dir), str(state), str(trace), backend]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(trace, "batch.step", proc)  # the prompt's prefill is under way
    proc.send_signal(signal.SIGINT)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "cleaning up"
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err == f"{STOPPING}\ninterrupted\n"  # no engine thread's traceback
    assert time.monotonic() - sent < 10  # not the clean-up's ten minutes

    async def check() -> None:  # the state directory opens; the turn never happened
        async with Runtime(slow_dir, pool_blocks=400, state_dir=state, log_level="off") as rt:
            assert rt.agent("ann").history == ()

    anyio.run(check)


#: A script that is sent both of its Ctrl-Cs on another thread (``pthread_kill``) while its
#: main thread sleeps in the event loop: the signal's handler runs on the main thread
#: only once the loop wakes, so the loop must be woken by the signal itself.
OFF_THREAD = CTRL_C + textwrap.dedent(
    """
    import signal
    import sys
    import threading
    import anyio
    from mlx_actors import run

    async def ctrl_c_while_asleep():
        asleep = threading.Event()

        def send():
            asleep.wait()
            signal.pthread_kill(threading.get_ident(), signal.SIGINT)

        threading.Thread(target=send, daemon=True).start()
        asleep.set()
        await anyio.sleep(600)

    async def main():
        try:
            await ctrl_c_while_asleep()
        finally:
            with anyio.CancelScope(shield=True):
                print("cleaning up", flush=True)
                await ctrl_c_while_asleep()

    run(main, backend=sys.argv[1])
    """
)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_ctrl_c_received_by_another_thread_wakes_the_loop(backend: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", OFF_THREAD, backend], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 130, proc.stderr
    assert proc.stdout == "cleaning up\n"
    assert proc.stderr == f"{STOPPING}\ninterrupted\n"
