"""The Chrome trace-event file of a runtime (it opens in Perfetto, ui.perfetto.dev): what
each engine step did, and each agent's turns split into their phases, written as the
events happen.

The file is in the format's JSON array form, one event per line, flushed as it goes:
its closing ``]`` is optional, so a process killed at any point leaves a trace that
readers open up to its last event. Lanes: the engine's steps on one track, each agent's
turns on its own (``queued``, ``prefill``, ``decode`` under one ``turn N`` span), with
flow arrows from a turn's admission to the first step that ran it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

#: Process id of the trace's events (one process: the runtime).
PID = 1


class ChromeTrace:
    """Writes log events to ``path`` as Chrome trace events. Not thread-safe: the caller
    serialises :meth:`write` and :meth:`close`."""

    def __init__(self, path: Path, *, process: str = "mlx-actors") -> None:
        self.path = path
        self._file: IO[str] | None = path.open("w", encoding="utf-8")
        self._t0 = time.perf_counter()
        self._lanes: dict[str, int] = {}
        #: Per turn id: when it was queued and admitted (µs), its agent, its flow id.
        self._turns: dict[Any, dict[str, Any]] = {}
        self._flows: dict[str, list[int]] = {}  # agent -> flows waiting for a step
        self._flow_ids = 0
        self._file.write("[\n")
        self._put({"name": "process_name", "ph": "M", "pid": PID, "args": {"name": process}})
        self._lane("engine")
        self._file.flush()

    def write(self, event: Mapping[str, Any]) -> None:
        """Add one log event (its ``event`` name and fields) as trace events."""
        if self._file is None:
            return
        now = (time.perf_counter() - self._t0) * 1e6
        name = str(event.get("event"))
        args = _jsonable({k: v for k, v in event.items() if k not in ("event", "level")})
        agent = event.get("agent")
        if name == "batch.step":
            self._step(event, args, now)
        elif name == "turn.queued" and agent is not None:
            self._turns[event.get("turn")] = {"agent": str(agent), "queued": now}
        elif name == "turn.admitted" and agent is not None:
            turn = self._turns.setdefault(event.get("turn"), {"agent": str(agent)})
            turn["admitted"] = now
            self._flow_ids += 1
            flow = self._flow_ids
            self._flows.setdefault(str(agent), []).append(flow)
            self._put(self._instant(name, str(agent), now, args))
            self._put(
                {
                    "name": "runs in",
                    "cat": "turn",
                    "ph": "s",
                    "id": flow,
                    "pid": PID,
                    "tid": self._lane(str(agent)),
                    "ts": now,
                }
            )
        elif name == "turn.finished" and agent is not None:
            self._turn_spans(event, args, now)
        elif name in ("turn.cancelled", "turn.refused") and agent is not None:
            self._put(self._instant(name, str(agent), now, args))
            self._end_turn(event, now)
        else:
            self._put(
                self._instant(name, str(agent) if agent is not None else "runtime", now, args)
            )
        self._file.flush()

    def close(self) -> None:
        """End the array (with one more metadata event): the file is then strict JSON."""
        if self._file is not None:
            end = {"name": "process_sort_index", "ph": "M", "pid": PID, "args": {"sort_index": 0}}
            self._file.write(json.dumps(end, separators=(",", ":")) + "]\n")
            self._file.close()
            self._file = None

    # -- the events ----------------------------------------------------------------------

    def _step(self, event: Mapping[str, Any], args: dict[str, Any], now: float) -> None:
        dur = float(event.get("ms", 0.0)) * 1e3
        prefilled = list(event.get("prefilled") or ())
        decoded = list(event.get("decoded") or ())
        parts = []
        if event.get("prefill_tokens"):
            who = f" for {', '.join(prefilled)}" if prefilled else ""
            parts.append(f"prefill {event.get('prefill_tokens')} tokens{who}")
        if event.get("batch"):
            parts.append(f"decode batch of {event.get('batch')}")
        label = "; ".join(parts) or "step"
        engine = self._lane("engine")
        self._put(
            {
                "name": label,
                "cat": "step",
                "ph": "X",
                "ts": now - dur,
                "dur": dur,
                "pid": PID,
                "tid": engine,
                "args": args,
            }
        )
        for agent in dict.fromkeys([*prefilled, *decoded]):
            for flow in self._flows.pop(agent, ()):
                self._put(
                    {
                        "name": "runs in",
                        "cat": "turn",
                        "ph": "f",
                        "bp": "e",
                        "id": flow,
                        "pid": PID,
                        "tid": engine,
                        "ts": now - dur,
                    }
                )

    def _turn_spans(self, event: Mapping[str, Any], args: dict[str, Any], now: float) -> None:
        agent = str(event["agent"])
        tid = self._lane(agent)
        known = self._turns.pop(event.get("turn"), {})
        total = float(event.get("total_ms", 0.0)) * 1e3
        ttft = float(event.get("ttft_ms", 0.0)) * 1e3
        admitted = known.get("admitted", now - total)
        queued = min(known.get("queued", admitted), admitted)
        first_token = min(admitted + ttft, now)
        label = f"turn {event.get('turn')}"
        self._put(
            {
                "name": label,
                "cat": "turn",
                "ph": "X",
                "ts": queued,
                "dur": now - queued,
                "pid": PID,
                "tid": tid,
                "args": args,
            }
        )
        for phase, start, end in (
            ("queued", queued, admitted),
            ("prefill", admitted, first_token),
            ("decode", first_token, now),
        ):
            if end > start:
                self._put(
                    {
                        "name": phase,
                        "cat": "turn",
                        "ph": "X",
                        "ts": start,
                        "dur": end - start,
                        "pid": PID,
                        "tid": tid,
                        "args": {},
                    }
                )

    def _end_turn(self, event: Mapping[str, Any], now: float) -> None:
        """A turn that ended without a reply: its span so far, and no flow left behind
        for a later turn's step to claim."""
        agent = str(event["agent"])
        known = self._turns.pop(event.get("turn"), None)
        self._flows.pop(agent, None)
        if known is None or "queued" not in known:
            return
        label = f"turn {event.get('turn')} ({str(event.get('event')).split('.')[-1]})"
        self._put(
            {
                "name": label,
                "cat": "turn",
                "ph": "X",
                "ts": known["queued"],
                "dur": now - known["queued"],
                "pid": PID,
                "tid": self._lane(agent),
                "args": {},
            }
        )

    def _instant(self, name: str, lane: str, now: float, args: dict[str, Any]) -> dict[str, Any]:
        return {
            "name": name,
            "ph": "i",
            "s": "t",
            "ts": now,
            "pid": PID,
            "tid": self._lane(lane),
            "args": args,
        }

    def _lane(self, name: str) -> int:
        """A thread id per lane (the engine, the runtime, each agent), named once."""
        tid = self._lanes.get(name)
        if tid is None:
            tid = self._lanes[name] = len(self._lanes) + 1
            self._put(
                {"name": "thread_name", "ph": "M", "pid": PID, "tid": tid, "args": {"name": name}}
            )
            self._put(
                {
                    "name": "thread_sort_index",
                    "ph": "M",
                    "pid": PID,
                    "tid": tid,
                    "args": {"sort_index": tid},
                }
            )
        return tid

    def _put(self, item: Mapping[str, Any]) -> None:
        assert self._file is not None
        self._file.write(json.dumps(item, separators=(",", ":")) + ",\n")


def _jsonable(args: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(args, default=str))  # type: ignore[no-any-return]


def read_trace(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The events of a trace file, complete or cut short (as a reader takes it: the
    closing ``]`` is optional, and a last line cut mid-way is dropped)."""
    events = []
    for line in Path(path).read_text(encoding="utf-8").splitlines()[1:]:
        line = line.rstrip().rstrip(",").rstrip("]")
        if not line:
            continue
        try:
            item = json.loads(line)
        except ValueError:
            break  # the line being written when the process died
        if item:
            events.append(item)
    return events
