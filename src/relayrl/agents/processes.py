"""Agent processes (`rollout.agent_processes` > 0): the agents' calls run in worker processes of
their own, off the run's event loop.

Why: an agent's own code (its `openai` client building each request and parsing each answer, its
HTTP connection handling, whatever it computes) costs CPU per call; on the run's event loop that
time is taken from the endpoint, the orchestrator and, through the interpreter lock, from the
trainer's and the samplers' threads. In a process of its own it runs beside them. An agent that
blocks its loop (time.sleep, CPU work) then stalls only the agents of its own process.

Job: `AgentProcesses` starts `count` processes (`python -m relayrl.agents.processes`), each
importing `task.agent` itself (with the run's `sys.path`) and running an asyncio loop that serves
calls: the run sends one `AgentContext` and the bound `rollout.agent_timeout_s`, the process runs
`agents/calls.call_agent` on it exactly as the run's process would (its own `EpisodeTasks`) and
sends back the `Outcome`. The agent still reaches the policy through the endpoint's URL (HTTP on
loopback), so nothing else changes. A call goes to the process with the fewest calls running.
Messages are pickled, length-prefixed, over two pipes of each process's own (not stdin/stdout:
an agent that prints does not break them; its output goes where the run's goes).

Invariants:
- an episode's tasks are ended in its process before the run closes the episode at the endpoint:
  a call still in flight then is cancelled with its HTTP client (a disconnected call is not
  recorded), so nothing is recorded after the agent's outcome;
- a call cancelled in the run (the rollout cancelled) is cancelled in its process too;
- a process that dies (its exit seen as the end of its pipe) fails the calls it was running
  (`raised`, naming its exit code) and is started again for the next call; one that does not
  answer a bounded call within its bound plus CANCEL_GRACE_S plus REPLY_SLACK_S (an agent holding
  that process's event loop) is killed, which fails its calls as `timeout`; a process that
  cannot import the agent fails the start in one line;
- the processes ignore SIGINT (Ctrl-C reaches the run, which stops them) and exit when their
  request pipe closes (`stop`, or the run's process dying), ending their episodes' tasks first;
  `stop` waits for them at most STOP_WAIT_S, then kills them.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
import struct
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

from relayrl.agents.calls import Outcome, call_agent, one_line
from relayrl.agents.context import AgentContext, AgentFn, load_agent
from relayrl.agents.tasks import CANCEL_GRACE_S
from relayrl.errors import UserError

__all__ = ["REPLY_SLACK_S", "START_TIMEOUT_S", "STOP_WAIT_S", "AgentProcesses"]

#: how long a process may take to start and import the agent
START_TIMEOUT_S = 120.0
#: past a bounded call's bound and CANCEL_GRACE_S, how long its process has to answer before it is killed
REPLY_SLACK_S = 5.0
#: how long `stop` waits for a process to exit once its request pipe is closed
STOP_WAIT_S = CANCEL_GRACE_S + 3.0

_HEADER = struct.Struct("!I")


def _frame(message: object) -> bytes:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


async def _read(reader: asyncio.StreamReader) -> Any:
    """The next message, or None at the pipe's end."""
    try:
        size = _HEADER.unpack(await reader.readexactly(_HEADER.size))[0]
        return pickle.loads(await reader.readexactly(size))
    except asyncio.IncompleteReadError:
        return None


async def _pipes(read_fd: int, write_fd: int) -> tuple[asyncio.StreamReader, asyncio.WriteTransport]:
    """Asyncio ends of two pipe descriptors (owned from here on)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(read_fd, "rb", 0))
    transport, _ = await loop.connect_write_pipe(asyncio.Protocol, os.fdopen(write_fd, "wb", 0))
    return reader, transport


class _Lost(Exception):
    """The process running a call died or was killed: `reason`, `detail` fail the call."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


@dataclass(eq=False)
class _Process:
    index: int
    proc: asyncio.subprocess.Process
    reader: asyncio.StreamReader
    writer: asyncio.WriteTransport
    calls: dict[int, asyncio.Future[Outcome]] = field(default_factory=dict)
    pump: asyncio.Task[None] | None = None
    killed_for: str | None = None  # why the run killed it

    def send(self, message: object) -> None:
        if not self.writer.is_closing():
            self.writer.write(_frame(message))


class AgentProcesses:
    """The run's agent processes (see the module): `start`, then `call` per episode, then `stop`."""

    def __init__(self, spec: str, count: int) -> None:
        self._spec = spec
        self._count = count
        self._slots: list[_Process | None] = [None] * count
        self._starting: list[asyncio.Future[_Process] | None] = [None] * count
        self._ids = 0
        self._stopping = False

    async def start(self) -> None:
        """Start every process; raises `UserError` (one line) when one cannot import the agent."""
        await asyncio.gather(*(self._get(i) for i in range(self._count)))

    async def call(self, ctx: AgentContext, timeout_s: float) -> Outcome:
        """Run the agent on `ctx` in the least busy process (see the module's invariants)."""
        index = min(range(self._count), key=lambda i: len(p.calls) if (p := self._slots[i]) is not None else 0)
        process = await self._get(index)
        self._ids += 1
        call_id = self._ids
        future: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        process.calls[call_id] = future
        process.send(("call", call_id, ctx, timeout_s))
        bound = timeout_s + CANCEL_GRACE_S + REPLY_SLACK_S if timeout_s > 0 else None
        try:
            return await asyncio.wait_for(asyncio.shield(future), bound)
        except TimeoutError:
            why = (
                f"its agent process did not answer within rollout.agent_timeout_s = {timeout_s:g} s "
                f"+ {CANCEL_GRACE_S + REPLY_SLACK_S:g} s (an agent held that process's event loop): it was killed"
            )
            self._kill(process, why)
            try:
                return await future
            except _Lost as lost:
                return Outcome(failure=(lost.reason, lost.detail))
        except _Lost as lost:
            return Outcome(failure=(lost.reason, lost.detail))
        except asyncio.CancelledError:
            if not future.done():
                process.send(("cancel", call_id))
                future.cancel()
            raise
        finally:
            process.calls.pop(call_id, None)

    async def stop(self) -> None:
        """Close every process's request pipe and wait for it to exit (STOP_WAIT_S, then killed)."""
        self._stopping = True
        for waiting in self._starting:  # a start still under way ends first (its failure was the caller's)
            if waiting is None:
                continue
            if not waiting.done():
                await asyncio.wait({waiting})
            if not waiting.cancelled():
                waiting.exception()
        self._starting = [None] * self._count
        processes = [p for p in self._slots if p is not None]
        for p in processes:
            p.writer.close()
        for p in processes:
            try:
                await asyncio.wait_for(p.proc.wait(), STOP_WAIT_S)
            except TimeoutError:
                self._kill(p, "the run stopped")
                await p.proc.wait()
            if p.pump is not None:
                await p.pump
        self._slots = [None] * self._count

    async def _get(self, index: int) -> _Process:
        """Process `index`, started (again) if it is not running."""
        process = self._slots[index]
        if process is not None:
            return process
        waiting = self._starting[index]
        if waiting is None:
            waiting = self._starting[index] = asyncio.ensure_future(self._spawn(index))
        try:
            return await asyncio.shield(waiting)
        finally:
            if waiting.done():
                self._starting[index] = None

    async def _spawn(self, index: int) -> _Process:
        if self._stopping:
            raise RuntimeError("the agent processes are stopping")
        to_child, from_run = os.pipe()  # the run writes requests to from_run; the child reads to_child
        to_run, from_child = os.pipe()  # the child writes outcomes to from_child; the run reads to_run
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "relayrl.agents.processes",
                str(to_child),
                str(from_child),
                stdin=subprocess.DEVNULL,
                pass_fds=(to_child, from_child),
                env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},  # relayrl importable as here
            )
        except BaseException:
            for fd in (to_child, from_run, to_run, from_child):
                os.close(fd)
            raise
        os.close(to_child)
        os.close(from_child)
        reader, writer = await _pipes(to_run, from_run)
        process = _Process(index, proc, reader, writer)
        process.send(("start", list(sys.path), self._spec))
        try:
            ready = await asyncio.wait_for(_read(reader), START_TIMEOUT_S)
        except TimeoutError:
            ready = ("failed", f"it did not start within {START_TIMEOUT_S:g} s")
        if ready != ("ready",):
            writer.close()
            if proc.returncode is None:
                proc.kill()
            await proc.wait()
            why = ready[1] if isinstance(ready, tuple) and len(ready) == 2 else f"it exited with code {proc.returncode}"
            raise UserError(f"rollout.agent_processes: agent process {index} could not run task.agent = {self._spec!r}: {why}")
        process.pump = asyncio.create_task(self._pump(process), name=f"agents/process/{index}")
        self._slots[index] = process
        return process

    async def _pump(self, process: _Process) -> None:
        """Hand each outcome to its call; at the pipe's end, fail the process's calls still running."""
        while (message := await _read(process.reader)) is not None:
            _, call_id, outcome = message
            future = process.calls.get(call_id)
            if future is not None and not future.done():
                future.set_result(outcome)
        if self._slots[process.index] is process:  # the next call starts another
            self._slots[process.index] = None
        code = await process.proc.wait()
        process.writer.close()
        if process.killed_for is not None:
            lost = _Lost("timeout", process.killed_for)
        else:
            lost = _Lost("raised", f"its agent process exited with code {code} while the agent ran")
        for future in process.calls.values():
            if not future.done():
                future.set_exception(lost)

    def _kill(self, process: _Process, why: str) -> None:
        if process.killed_for is None:
            process.killed_for = why
        if process.proc.returncode is None:
            process.proc.kill()


# ---- the process's side -------------------------------------------------------------------------


async def _serve(read_fd: int, write_fd: int) -> None:
    reader, writer = await _pipes(read_fd, write_fd)
    start = await _read(reader)
    if start is None:
        return
    _, path, spec = start
    sys.path[:] = path
    try:
        agent = load_agent(spec)
    except BaseException as exc:  # the run reports it in one line
        writer.write(_frame(("failed", one_line(exc))))
        return
    writer.write(_frame(("ready",)))
    running: dict[int, asyncio.Task[None]] = {}

    async def run(call_id: int, ctx: AgentContext, timeout_s: float, agent: AgentFn) -> None:
        name = f"agent/{ctx.prompt.prompt_id}/{ctx.sample_index}/call"
        try:
            outcome = await call_agent(agent, ctx, timeout_s, name, lambda: None)
        finally:
            running.pop(call_id, None)
        writer.write(_frame(("done", call_id, outcome)))

    while (message := await _read(reader)) is not None:
        if message[0] == "call":
            _, call_id, ctx, timeout_s = message
            running[call_id] = asyncio.create_task(run(call_id, ctx, timeout_s, agent))
        elif message[0] == "cancel" and (task := running.get(message[1])) is not None:
            task.cancel()
    tasks = list(running.values())  # the run closed the pipe: its episodes end here
    for task in tasks:
        task.cancel()
    if tasks:
        _, left = await asyncio.wait(tasks, timeout=CANCEL_GRACE_S + 1.0)
        if left:  # they ignore cancelling: asyncio.run would wait for them for ever
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the run, which stops this
    read_fd, write_fd = int(sys.argv[1]), int(sys.argv[2])
    asyncio.run(_serve(read_fd, write_fd))


if __name__ == "__main__":
    main()
