"""The vLLM sampler's weight files (issue 30 §3, issue 31 §4, issue 32; review T9), on a stand-in
engine (no vLLM needed): a /dev/shm without room (Docker's 64 MiB) sends the file to the temp
directory on disk; the file is written before the load takes the gate, so calls keep sampling
meanwhile; files left by processes that are gone are removed when a replica starts; nothing is
left behind."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import namedtuple
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from relayrl.backends.vllm import sampler as sampler_module
from relayrl.backends.vllm.engine import EngineSettings
from relayrl.backends.vllm.sampler import VllmSampler, remove_stale_weight_files, weights_dir
from relayrl.models.loading import load_model_and_tokenizer, shipped_model_dir
from relayrl.types import SampleRequest, Weights
from support.vllmoutputs import FakeLogprob, FakeOutput, FakeSample

MiB = 2**20
_Usage = namedtuple("_Usage", "total used free")


@dataclass
class FakeEngine:
    """Samples once `release` is set; records the weight files it is asked to load."""

    release: asyncio.Event = field(default_factory=asyncio.Event)
    started: int = 0
    done: int = 0
    files: list[tuple[str, bool]] = field(default_factory=list)  # (path, existed when loaded)

    async def generate(self, prompt: dict[str, list[int]], params: Any, request_id: str) -> AsyncIterator[FakeOutput]:
        self.started += 1
        await self.release.wait()
        self.done += 1
        yield FakeOutput(request_id, [FakeSample(i, [1], [{1: FakeLogprob(-1.0)}]) for i in range(params.n)])

    async def collective_rpc(self, method: str, args: tuple[str, ...]) -> list[dict[str, float]]:
        self.files.append((args[0], os.path.exists(args[0])))
        return [{"seconds": 0.0}]

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return True

    async def abort(self, ids: list[str]) -> None:
        return None


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    model, _ = load_model_and_tokenizer(shipped_model_dir())
    return dict(model.state_dict())


def _sampler(engine: FakeEngine) -> VllmSampler:
    return VllmSampler(EngineSettings(model=str(shipped_model_dir())), temperature=1.0, max_new_tokens=4, engine=engine)


def _small_shm(monkeypatch: pytest.MonkeyPatch, free: int) -> None:
    real = shutil.disk_usage

    def usage(path: str | os.PathLike[str]) -> Any:
        if os.fspath(path) == "/dev/shm":
            return _Usage(64 * MiB, 64 * MiB - free, free)
        return real(path)

    monkeypatch.setattr(shutil, "disk_usage", usage)
    monkeypatch.setattr(os.path, "isdir", lambda p, _real=os.path.isdir: True if p == "/dev/shm" else _real(p))
    monkeypatch.setattr(os, "access", lambda p, mode, _real=os.access: True if p == "/dev/shm" else _real(p, mode))


def test_a_64_mib_dev_shm_sends_a_large_file_to_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    _small_shm(monkeypatch, 60 * MiB)
    assert weights_dir(100 * MiB) == tempfile.gettempdir()
    _small_shm(monkeypatch, 60 * MiB - 1)
    assert weights_dir(1) == tempfile.gettempdir()  # room for the file, not for the spare others need
    _small_shm(monkeypatch, 1024 * MiB)
    assert weights_dir(100 * MiB) == "/dev/shm"


def test_the_sampler_writes_to_disk_when_dev_shm_is_full(monkeypatch: pytest.MonkeyPatch, weights: dict[str, torch.Tensor]) -> None:
    _small_shm(monkeypatch, 1 * MiB)  # less than the tiny model's weights plus the spare
    engine = FakeEngine()

    async def go() -> None:
        await _sampler(engine).load_weights(Weights(version=1, payload=weights))

    asyncio.run(go())
    ((path, existed),) = engine.files
    assert existed and Path(path).parent == Path(tempfile.gettempdir()) and not path.startswith("/dev/shm")
    assert not os.path.exists(path)  # removed once loaded
    assert f"relayrl-vllm-p{os.getpid()}-0-" in Path(path).name


def test_the_file_is_written_before_the_load_takes_the_gate(monkeypatch: pytest.MonkeyPatch, weights: dict[str, torch.Tensor]) -> None:
    engine = FakeEngine()
    written: list[tuple[int, int]] = []  # (calls started, calls done) when the file was written
    real_save = sampler_module.save_file

    def save(state: dict[str, torch.Tensor], path: str) -> None:
        written.append((engine.started, engine.done))
        real_save(state, path)

    monkeypatch.setattr(sampler_module, "save_file", save)
    monkeypatch.setattr(VllmSampler, "_params", lambda self, n, max_tokens, seed, greedy=False: SimpleNamespace(n=n))  # no vllm here

    async def go() -> None:
        sampler = _sampler(engine)
        request = SampleRequest(group_id=0, prompt=None, prompt_tokens=[5, 6], num_samples=2)  # type: ignore[arg-type]
        running = asyncio.ensure_future(sampler.generate([request]))
        for _ in range(1000):
            if engine.started or running.done():
                break
            await asyncio.sleep(0.001)
        assert engine.started == 1, running
        load = asyncio.ensure_future(sampler.load_weights(Weights(version=1, payload=weights)))
        deadline = time.monotonic() + 30
        while not written and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert written == [(1, 0)]  # written while the running call still samples (it holds the gate)
        engine.release.set()
        await asyncio.gather(running, load)

    asyncio.run(go())
    assert len(engine.files) == 1 and not os.path.exists(engine.files[0][0])


def test_a_load_cancelled_while_writing_leaves_no_file(
    monkeypatch: pytest.MonkeyPatch, weights: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    monkeypatch.setattr(sampler_module, "weights_dir", lambda nbytes: str(tmp_path))
    real_save = sampler_module.save_file

    def slow_save(state: dict[str, torch.Tensor], path: str) -> None:
        time.sleep(0.3)
        real_save(state, path)

    monkeypatch.setattr(sampler_module, "save_file", slow_save)

    async def go() -> None:
        load = asyncio.ensure_future(_sampler(FakeEngine()).load_weights(Weights(version=1, payload=weights)))
        await asyncio.sleep(0.05)
        load.cancel()
        with pytest.raises(asyncio.CancelledError):
            await load
        await asyncio.sleep(1.0)  # the writer thread finishes; its file goes with it

    asyncio.run(go())
    assert list(tmp_path.iterdir()) == []


def test_files_of_processes_that_are_gone_are_removed(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = tmp_path / f"relayrl-vllm-p{gone.pid}-0-abc.safetensors"
    fresh = tmp_path / f"relayrl-vllm-p{gone.pid}-1-abd.safetensors"  # (e.g. another container's live run: kept)
    mine = tmp_path / f"relayrl-vllm-p{os.getpid()}-0-def.safetensors"
    old_unowned = tmp_path / "relayrl-vllm-0-ghi.safetensors"  # an older relayrl's name: no owner
    new_unowned = tmp_path / "relayrl-vllm-1-jkl.safetensors"
    other = tmp_path / "something-else.safetensors"
    for f in (stale, fresh, mine, old_unowned, new_unowned, other):
        f.write_bytes(b"x")
    for f in (stale, mine, old_unowned):
        os.utime(f, (time.time() - 7200, time.time() - 7200))
    removed = remove_stale_weight_files([str(tmp_path)])
    assert sorted(removed) == sorted([str(stale), str(old_unowned)])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in (fresh, mine, new_unowned, other))
