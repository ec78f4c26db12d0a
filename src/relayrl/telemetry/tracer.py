"""Chrome trace-event writer (`trace.json`, opens in Perfetto and chrome://tracing).

Invariant: every span is a complete event (`ph: X`, `ts`/`dur` in µs since the run started) on a
named lane (`cat` = lane, one numeric `tid` per lane with `thread_name` metadata). Events are
appended to the file by `flush()` (from a worker thread) as a JSON array whose closing bracket is
written by `close()`; a crashed run leaves a readable prefix (`load_trace` tolerates it).

Memory: a tracer with a file keeps only the events recorded since the last `flush()` (the run
flushes after every step's bookkeeping), so what it holds does not grow with the number of steps;
`events` reads the rest back from the file. A tracer without a file (an in-memory run, which has
no disk to put them on) keeps every event: use a run directory for long runs.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, cast

from relayrl.errors import UserError
from relayrl.rundir.lock import writing

TraceEvent = dict[str, object]
PID = 1

# Lanes and their fixed thread ids; sampler lanes are added on demand after these.
LANES: dict[str, int] = {
    "trainer": 1,
    "trainer.fetch": 2,  # get_metrics overlaps train_step, so it gets a sub-lane of the trainer
    "orchestrator": 3,
    "bookkeeping": 4,
}


class Tracer:
    def __init__(self, path: Path | None, run_info: dict[str, object]) -> None:
        self._t0 = time.perf_counter()
        self._lock = threading.Lock()
        self._lanes = dict(LANES)
        self.path = path
        # recorded and not yet written (all of them without a file); deque: append from any
        # thread and popleft in flush() are each atomic, so no event is lost between the two
        self._pending: deque[TraceEvent] = deque()
        self._file: IO[str] | None = None
        self._first = True
        self._emit({"ph": "M", "pid": PID, "tid": 0, "name": "process_name", "args": {"name": "relayrl"}})
        self._emit({"ph": "M", "pid": PID, "tid": 0, "name": "relayrl_run", "args": dict(run_info)})
        for lane, tid in LANES.items():
            self._lane_meta(lane, tid)
        if path is not None:
            self._file = open(path, "w", encoding="utf-8")
            self._file.write("[")
            self.flush()

    def now(self) -> float:
        """Seconds since the run started (the trace's time base)."""
        return time.perf_counter() - self._t0

    def _lane_meta(self, lane: str, tid: int) -> None:
        self._emit({"ph": "M", "pid": PID, "tid": tid, "name": "thread_name", "args": {"name": lane}})
        self._emit({"ph": "M", "pid": PID, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}})

    def _tid(self, lane: str) -> int:
        tid = self._lanes.get(lane)
        if tid is None:
            with self._lock:
                tid = self._lanes.get(lane)
                if tid is None:
                    tid = max(self._lanes.values()) + 1
                    self._lanes[lane] = tid
                    self._lane_meta(lane, tid)
        return tid

    def _emit(self, event: TraceEvent) -> None:
        self._pending.append(event)  # deque.append is atomic

    @property
    def retained(self) -> int:
        """How many events this tracer holds in memory (with a file: those not flushed yet)."""
        return len(self._pending)

    @property
    def events(self) -> list[TraceEvent]:
        """Every event recorded so far. Without a file, from memory; with one, flushed and read
        back from it (a file read: for after the run, or a test; the run itself never calls it)."""
        if self.path is None:
            return list(self._pending)
        self.flush()
        return load_trace(self.path)

    def complete(self, lane: str, name: str, start: float, end: float, **args: object) -> None:
        """Record a span from `start` to `end` (seconds on the run's clock)."""
        self._emit(
            {
                "ph": "X",
                "pid": PID,
                "tid": self._tid(lane),
                "cat": lane,
                "name": name,
                "ts": round(start * 1e6, 1),
                "dur": round(max(0.0, end - start) * 1e6, 1),
                "args": args,
            }
        )

    def clock(self, lane: str, **estimate: object) -> None:
        """Record how `lane`'s spans were put onto the run's clock (an actor's clock offset and
        its error bound: `backends.ray.spans`) as a `relayrl_clock` metadata event."""
        self._emit({"ph": "M", "pid": PID, "tid": self._tid(lane), "name": "relayrl_clock", "args": {"lane": lane, **estimate}})

    @contextmanager
    def span(self, lane: str, name: str, **args: object) -> Iterator[dict[str, object]]:
        """Time the body; the yielded dict lets the body add args (e.g. results)."""
        extra: dict[str, object] = {}
        start = self.now()
        try:
            yield extra
        finally:
            self.complete(lane, name, start, self.now(), **args, **extra)

    def flush(self) -> None:
        """Append the events recorded since the last flush to the file, and let them go."""
        with self._lock:
            if self._file is None:
                return
            pending = self._pending
            parts: list[str] = []
            for _ in range(len(pending)):  # only what is there now; later appends wait for the next flush
                event = pending.popleft()
                parts.append(("\n" if self._first else ",\n") + json.dumps(event, separators=(",", ":")))
                self._first = False
            self._write("".join(parts))

    def _write(self, text: str) -> None:
        """Write and flush (holding the lock); an OSError (a full disk, a file-size limit) names
        the trace file, which a file object's write does not."""
        assert self._file is not None and self.path is not None
        with writing(self.path):
            self._file.write(text)
            self._file.flush()

    def close(self, status: str) -> None:
        """Mark the run's end (`status`: completed, failed, cancelled) and close the array."""
        self._emit(
            {"ph": "i", "s": "g", "pid": PID, "tid": 0, "name": "run_end", "ts": round(self.now() * 1e6, 1), "args": {"status": status}}
        )
        self.flush()
        with self._lock:
            if self._file is not None:
                self._write("\n]\n")
                self._file.close()
                self._file = None


class TraceError(UserError):
    """A file that is not a trace (nor the prefix of one a crash leaves); the message names the
    file, the event (1-based, in file order) and the problem."""


def load_trace(path: Path) -> list[TraceEvent]:
    """The events of a trace written by `Tracer`, also of one whose run crashed before `close()`.

    Accepted: a JSON array of events (or an object holding one as `traceEvents`), and what a
    crashed run leaves of one: a prefix without the closing bracket, maybe ending in a comma or
    in the middle of an event (that torn last event is dropped). Every event is checked for the
    fields the checker, the timeline and the report read (`_event_problem`), so nothing
    downstream trips over a wrong type. Anything else (random bytes, an empty file, events that
    are not objects or hold wrong types) raises `TraceError`, a ValueError naming the file, the
    event and the problem; a missing file raises FileNotFoundError.
    """
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise TraceError(f"{path}: cannot read the trace ({exc.strerror or exc})") from None
    events = _parse_events(raw, str(path))
    for number, event in enumerate(events, start=1):
        problem = _event_problem(event)
        if problem is not None:
            raise TraceError(f"{path}: event {number}: {problem}")
    return cast("list[TraceEvent]", events)


_JSON_WS = " \t\n\r"
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
_NUMBER_PREFIX = re.compile(r"-?(?:(?:0|[1-9][0-9]*)(?:\.[0-9]*|(?:\.[0-9]+)?[eE][-+]?[0-9]*)?)?")
_LITERALS = ("true", "false", "null", "NaN", "Infinity", "-Infinity")  # Python's json writes NaN, Infinity
_ATOM = re.compile(r"[-+.0-9A-Za-z]+")
_STRING_CHUNK = re.compile(r'[^"\\\x00-\x1f]*')
_ESCAPE = re.compile(r'\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})')
_ESCAPE_PREFIX = re.compile(r"\\(?:u[0-9a-fA-F]{0,3})?")


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _JSON_WS:
        i += 1
    return i


def _line(text: str, i: int) -> int:
    return text.count("\n", 0, i) + 1


def _where(events: list[object], text: str, i: int) -> str:
    """The event that would come next, and its line (for messages only: counting lines is slow)."""
    return f"event {len(events) + 1} (line {_line(text, i)})"


def _parse_events(raw: bytes, name: str) -> list[object]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.end != len(raw) or exc.reason != "unexpected end of data":
            raise TraceError(f"{name}: not a trace: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
        text = raw[: exc.start].decode("utf-8")  # cut inside a character: that is inside the torn event
    stripped = text.strip(_JSON_WS)
    if not stripped:
        raise TraceError(f"{name}: not a trace: the file is empty")
    if stripped.startswith("[") and not stripped.endswith("]"):  # no closing bracket: a live or crashed run's
        return _parse_prefix(text, name)
    try:
        data: object = json.loads(text)
    except (ValueError, RecursionError):
        return _parse_prefix(text, name)
    if isinstance(data, dict) and "traceEvents" in data:
        data = data["traceEvents"]
    if not isinstance(data, list):
        raise TraceError(f"{name}: not a trace: a JSON {type(data).__name__}, not an array of events")
    return data


def _closed(head: str) -> list[object] | None:
    """`head` (an array's beginning, ending after an event or its comma, or at '[') closed with
    ']' and parsed in one go; None when that is not a JSON array."""
    head = head.rstrip(_JSON_WS).removesuffix(",")
    try:
        data = json.loads(head + "]")
    except (ValueError, RecursionError):
        return None
    return data if isinstance(data, list) else None


def _parse_prefix(text: str, name: str) -> list[object]:
    """Events of a trace-event array that does not parse as a whole: cut short by a crash (fine)
    or broken (TraceError naming the event and its line)."""
    # Fast paths for what `Tracer` leaves (one event a line): the array without its closing
    # bracket, or that plus a torn last line; anything else takes the event-by-event parse below.
    if text.lstrip(_JSON_WS).startswith("["):
        whole = _closed(text)
        if whole is not None:
            return whole
        cut = text.rfind("\n")
        head, tail = text[:cut], text[cut:].lstrip(_JSON_WS)
        if cut > 0 and tail.startswith("{") and head.rstrip(_JSON_WS).endswith((",", "[")) and _is_json_prefix(tail, 0):
            before = _closed(head)
            if before is not None:
                return before
    decoder = json.JSONDecoder()
    i = _skip_ws(text, 0)
    if text[i] != "[":
        raise TraceError(f"{name}: not a trace: it does not start with '[' (an array of events)")
    events: list[object] = []
    i, after_comma = i + 1, False
    while True:
        i = _skip_ws(text, i)
        if i == len(text):
            return events  # cut after '[' or a comma
        if text[i] == "]":
            if after_comma:
                raise TraceError(f"{name}: {_where(events, text, i)}: a comma before the closing ']'")
            end = _skip_ws(text, i + 1)
            if end == len(text):
                return events
            raise TraceError(f"{name}: text after the closing ']' (line {_line(text, end)})")
        try:
            value, i = decoder.raw_decode(text, i)
        except (ValueError, RecursionError) as exc:
            if text[i] == "{" and _is_json_prefix(text, i):
                return events  # the last event, torn by a crash mid-write: dropped
            why = (
                exc.msg if isinstance(exc, json.JSONDecodeError) else ("nested too deeply" if isinstance(exc, RecursionError) else str(exc))
            )
            raise TraceError(f"{name}: {_where(events, text, i)}: invalid JSON ({why})") from None
        events.append(value)
        i = _skip_ws(text, i)
        if i == len(text):
            return events  # cut after an event, before its comma
        if text[i] == ",":
            i, after_comma = i + 1, True
        elif text[i] == "]":
            after_comma = False
        else:
            raise TraceError(f"{name}: {_where(events, text, i)}: expected ',' or ']' after event {len(events)}")


def _scan_string(text: str, i: int) -> int | None:
    """End of the JSON string starting at text[i] ('"'); len(text) if it is cut off validly;
    None if it is not valid JSON."""
    j = i + 1
    while True:
        j = _STRING_CHUNK.match(text, j).end()  # type: ignore[union-attr]  # matches the empty string
        if j == len(text):
            return j
        if text[j] == '"':
            return j + 1
        if text[j] != "\\":
            return None  # a raw control character
        escape = _ESCAPE.match(text, j)
        if escape is None:
            return len(text) if _ESCAPE_PREFIX.fullmatch(text, j) else None
        j = escape.end()


def _is_json_prefix(text: str, i: int) -> bool:
    """Whether text[i:] is the beginning of one JSON value cut off before its end (and nothing
    else): what a crash in the middle of writing an event leaves."""
    stack: list[str] = []  # open containers: '{' or '['
    expect = "value"  # value, value_or_close, key, key_or_close, colon, comma_or_close
    while True:
        i = _skip_ws(text, i)
        if i == len(text):
            return True
        c = text[i]
        if (expect == "value_or_close" and c == "]") or (expect == "key_or_close" and c == "}"):
            stack.pop()
            i, expect = i + 1, "comma_or_close"
        elif expect == "comma_or_close":
            if not stack:
                return False  # a complete value followed by more text
            if c == ",":
                i, expect = i + 1, ("key" if stack[-1] == "{" else "value")
            elif c == ("}" if stack[-1] == "{" else "]"):
                stack.pop()
                i += 1
            else:
                return False
        elif expect == "colon":
            if c != ":":
                return False
            i, expect = i + 1, "value"
        elif c == '"':  # a key or a string value
            end = _scan_string(text, i)
            if end is None:
                return False
            i, expect = end, ("colon" if expect in ("key", "key_or_close") else "comma_or_close")
        elif expect in ("key", "key_or_close"):
            return False
        elif c in "{[":
            stack.append(c)
            i, expect = i + 1, ("key_or_close" if c == "{" else "value_or_close")
        else:
            atom = _ATOM.match(text, i)
            if atom is None:
                return False
            token, i = atom.group(), atom.end()
            if i == len(text):
                return bool(_NUMBER_PREFIX.fullmatch(token)) or any(lit.startswith(token) for lit in _LITERALS)
            if not (_NUMBER.fullmatch(token) or token in _LITERALS):
                return False
            expect = "comma_or_close"


def _show(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:39] + "…"


def _not_number(value: object) -> str | None:
    """Why `value` is not a finite number, or None."""
    if type(value) is float and math.isfinite(value):  # the common case, first
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"is not a number (got {_show(value)})"
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an integer beyond float range
        finite = False
    return None if finite else f"is not a finite number (got {_show(value)})"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _event_problem(event: object) -> str | None:
    """What is wrong with one trace event for the checker, the timeline and the report, or None:
    an object; 'ph' a string; 'name' and 'cat' strings; 'ts' and 'dur' finite numbers ('name' and
    'ts' present on a complete event, ph X; 'dur' not negative); 'args' an object whose 'step' is
    an integer; the run-info event's max_staleness and first_step integers."""
    if not isinstance(event, dict):
        return f"not an object (got {_show(event)})"
    for key in ("ph", "name", "cat"):
        if key in event and not isinstance(event[key], str):
            return f"{key!r} is not a string (got {_show(event[key])})"
    ph = event.get("ph")
    if ph is None:
        return "has no 'ph' (its phase)"
    for key in ("ts", "dur"):
        if key in event and (why := _not_number(event[key])) is not None:
            return f"{key!r} {why}"
    if ph == "X":
        missing = [key for key in ("name", "ts") if key not in event]
        if missing:
            return f"a complete event (ph X) without {', '.join(repr(k) for k in missing)}"
    if "dur" in event and float(event["dur"]) < 0:
        return f"'dur' is negative (got {_show(event['dur'])})"
    args = event.get("args", {})
    if not isinstance(args, dict):
        return f"'args' is not an object (got {_show(args)})"
    if "step" in args and not _is_int(args["step"]):
        return f"'args.step' is not an integer (got {_show(args['step'])})"
    if ph == "M" and event.get("name") == "relayrl_run":
        for key in ("max_staleness", "first_step"):
            if key in args and not _is_int(args[key]) and not (key == "first_step" and args[key] is None):
                return f"'args.{key}' is not an integer (got {_show(args[key])})"
    return None
