"""Sizes bounded up front and start-up work that stays interruptible (issue 19).

`task.reward_workers` and `task.dataset_size` beyond their caps or the memory budget are refused in
one line (exit 2) before anything starts; the reward workers' stdout and stderr land, capped, in
the run directory's reward_workers.log and not on the console; SIGTERM while the reward workers
start or while a dataset is generated exits at once (143).
"""

from __future__ import annotations

import signal
import subprocess
import textwrap
import threading
import time
from pathlib import Path

import pytest

from relayrl.config.schema import load_config
from relayrl.config.sizing import MIN_REWARD_WORKERS_CAP, check_reward_workers, max_reward_workers
from relayrl.rewards.output import CONSOLE_CAP_BYTES
from relayrl.rewards.pool import PoolLimits, RewardPool, RewardPoolAborted
from support.cli import child_env, relayrl, relayrl_argv

ROOT = Path(__file__).resolve().parents[2]
SIM_RECIPE = str(ROOT / "src" / "relayrl" / "recipes" / "sim.toml")
MiB = 1024 * 1024


def _sets(*overrides: str) -> list[str]:
    return [arg for o in overrides for arg in ("--set", o)]


# -- bounds -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["task.reward_workers=100000"], "task.reward_workers=100,000 is more than "),
        (
            ["task.reward_workers=8", "orchestrator.max_host_memory_gb=0.1"],
            "task.reward_workers=8 worker processes need an estimated 0.2 GB",
        ),
        (
            ["task.kind=reasoning_gym", "task.dataset=chain_sum", "task.dataset_size=100000000"],
            "task.dataset_size=100,000,000 is more than 1,000,000: the training set is generated up front",
        ),
        (
            ["task.kind=reasoning_gym", "task.dataset=chain_sum", "task.dataset_size=900000", "orchestrator.max_host_memory_gb=1"],
            "task.dataset_size=900,000 entries need an estimated 3.4 GB of host memory (~4 KB each), "
            "more than orchestrator.max_host_memory_gb (1.0 GB)",
        ),
        (
            ["run.backend=local", "task.kind=arithmetic", "train.lora.r=100000"],
            "invalid config key 'train.lora.r': 100,000 is more than 64, the width of the narrowest targeted layer",
        ),
        (["train.ppo_epochs=1e6"], "invalid config key 'train.ppo_epochs' (from --set): Input should be less than or equal to 100"),
    ],
    ids=["workers-cap", "workers-memory", "dataset-cap", "dataset-memory", "lora-rank", "ppo-epochs"],
)
def test_a_size_beyond_its_bound_is_refused_in_one_line_before_anything_starts(tmp_path: Path, overrides: list[str], expected: str) -> None:
    """Before the bounds, 100000 workers were spawned at the first reward call and a dataset of
    100,000,000 entries was generated for hours (this test then times out); train.lora.r=100000 on
    the tiny model was OOM-killed with no message, and ppo_epochs=1e6 made no step and said nothing."""
    if any("reasoning_gym" in o for o in overrides):
        pytest.importorskip("reasoning_gym")
    done = relayrl("train", SIM_RECIPE, *_sets(*overrides, f"run.output_dir={tmp_path / 'runs'}"), timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {expected}"), done.stderr
    assert not (tmp_path / "runs").exists()


def test_the_lora_adapters_are_counted_against_the_host_memory_budget() -> None:
    from relayrl.config.schema import ConfigError
    from relayrl.config.sizing import LORA_BYTES_PER_PARAM, LORA_SAMPLER_BYTES_PER_PARAM, check_lora
    from relayrl.models.loading import load_model_and_tokenizer, shipped_model_dir

    model, _ = load_model_and_tokenizer(shipped_model_dir())
    cfg = load_config(None, ["run.backend=local", "train.lora.r=64"])
    widths = [(m.in_features, m.out_features) for n, m in model.named_modules() if n.rpartition(".")[2] in cfg.train.lora.target_modules]  # type: ignore[union-attr]
    need = sum(64 * (i + o) for i, o in widths) * (LORA_BYTES_PER_PARAM + LORA_SAMPLER_BYTES_PER_PARAM)
    check_lora(cfg, model, (need, "a test budget"))  # exactly enough
    with pytest.raises(ConfigError, match=r"^train.lora.r=64 on \d+ layers is [\d,]+ adapter parameters: an estimated") as info:
        check_lora(cfg, model, (need - 1, "a test budget"))
    assert "\n" not in str(info.value) and "more than a test budget" in str(info.value)
    check_lora(load_config(None, ["run.backend=local", "train.lora.r=64"]), model)  # the rank bound itself: 64 is allowed


def test_the_reward_worker_cap_follows_the_cpus() -> None:
    assert max_reward_workers(1) == MIN_REWARD_WORKERS_CAP == 8
    assert max_reward_workers(16) == 64
    check_reward_workers(load_config(None, ["task.reward_workers=64"]), None, cpus=16)
    with pytest.raises(ValueError, match=r"^task\.reward_workers=65 is more than 64 \(max\(8, 4 per CPU × 16 CPUs\)\)"):
        check_reward_workers(load_config(None, ["task.reward_workers=65"]), None, cpus=16)


# -- the reward workers' output -------------------------------------------------------------------

CHATTY = """
import os, subprocess, sys

def chatty(t):
    print("py-stdout", t.sample_index)
    print("py-stderr", t.sample_index, file=sys.stderr)
    subprocess.run(["echo", "from-a-subprocess"], check=True)
    os.write(1, b"c-level " + b"z" * (1024 * 1024) + b"\\n")  # 1 MiB a call, past print's buffers
    return 1.0
"""


def test_a_chatty_rewards_output_lands_capped_in_the_run_directorys_log_not_on_the_console(tmp_path: Path) -> None:
    """Before, every byte went to the console (the child's stdout/stderr here: tens of MB)."""
    (tmp_path / "chatty.py").write_text(textwrap.dedent(CHATTY))
    done = relayrl(
        "train", SIM_RECIPE, *_sets("run.steps=3", 'task.reward_functions=["chatty.py:chatty"]', "run.output_dir=runs"), cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(done.stdout) + len(done.stderr) < 4000, (len(done.stdout), len(done.stderr))
    log = tmp_path / "runs" / "sim" / "reward_workers.log"
    assert done.stderr.count(f"relayrl: reward workers' output goes to {Path('runs', 'sim', 'reward_workers.log')} (its first 10 MiB)") == 1
    assert done.stderr.count("reward workers' output reached its cap of 10 MiB; the rest is discarded") == 1
    text = log.read_bytes()
    assert 10 * MiB < len(text) <= 10 * MiB + 200
    assert text.startswith(b"# relayrl: the reward workers' stdout and stderr; the first 10 MiB are kept\n")
    assert text.endswith(b"\n# relayrl: reward workers' output reached its cap of 10 MiB; the rest is discarded\n")
    for what in (b"py-stdout", b"py-stderr", b"from-a-subprocess", b"c-level zzz"):
        assert what in text, what


PRINTS = "def noisy(t):\n    print('x' * 999)\n    return 1.0\n"


def test_the_log_cap_holds_across_pools_writing_the_same_file(tmp_path: Path) -> None:
    """A resumed run appends to reward_workers.log: its earlier output counts against the cap."""
    (tmp_path / "noisy.py").write_text(PRINTS)
    log = tmp_path / "reward_workers.log"
    discarded = []
    for _ in range(2):
        pool = RewardPool([f"{tmp_path / 'noisy.py'}:noisy"], 1, PoolLimits(timeout_s=30), log_path=log, log_cap_bytes=4096)
        try:
            pool.run([(0, None)] * 3)  # 3000 bytes printed
        finally:
            pool.close()
        discarded.append(pool.output.discarded)
    cap_line = "# relayrl: reward workers' output reached its cap of 4 KiB; the rest is discarded\n"
    assert discarded[0] == 0 and discarded[1] > 1000, discarded
    text = log.read_text()
    assert text.startswith("# relayrl: the reward workers' stdout and stderr; the first 4 KiB are kept\n")
    assert text.endswith(cap_line) and text.count(cap_line) == 1
    assert 4096 < len(text) <= 4096 + len(cap_line) + 1


def test_without_a_run_directory_only_a_short_head_reaches_the_console(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "noisy.py").write_text(PRINTS)
    pool = RewardPool([f"{tmp_path / 'noisy.py'}:noisy"], 2, PoolLimits(timeout_s=30))
    try:
        pool.run([(0, None)] * 200)  # 200 KB printed
    finally:
        pool.close()
    err = capfd.readouterr().err
    assert pool.output.kept == CONSOLE_CAP_BYTES and pool.output.discarded == 200 * 1000 - CONSOLE_CAP_BYTES
    assert CONSOLE_CAP_BYTES < len(err) < CONSOLE_CAP_BYTES + 400
    assert err.count("relayrl: reward workers' output follows (its first 64 KiB; no run directory)") == 1
    assert err.count("relayrl: reward workers' output reached its cap of 64 KiB; the rest is discarded") == 1


# -- interruptible start-up -----------------------------------------------------------------------


def test_a_pool_whose_caller_stops_starts_no_further_worker() -> None:
    """Before, every worker was spawned before the abort flag was first looked at."""
    pool = RewardPool(["relayrl.rewards.registry:exact_match"], 20, PoolLimits(timeout_s=30))
    abort = threading.Event()
    abort.set()
    try:
        with pytest.raises(RewardPoolAborted):
            pool.run([(0, None)], abort)
    finally:
        pool.close()
    assert pool.started_pids == []


SLOW_START = """
import os, sys, time

if sys.argv[0] == "-c":  # in a reward worker (not the parent checking the entry): starts slowly
    open(os.path.join(os.environ["RW_MARKS"], str(os.getpid())), "w").close()
    time.sleep(120)

def f(t):
    return 1.0
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigterm_while_the_reward_workers_start_exits_at_once_and_leaves_none(tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    (tmp_path / "slow.py").write_text(textwrap.dedent(SLOW_START))
    argv = relayrl_argv(
        "train",
        SIM_RECIPE,
        *_sets('task.reward_functions=["slow.py:f"]', "task.reward_workers=8", "orchestrator.stop_grace_s=120", "run.output_dir=runs"),
    )
    env = child_env({"RW_MARKS": str(marks)})
    proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not any(marks.iterdir()) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None and any(marks.iterdir()), proc.communicate()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)  # well before stop_grace_s
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143, err
    time.sleep(0.5)
    assert not [p for p in (int(m.name) for m in marks.iterdir()) if _alive(p)]


def test_sigterm_while_a_dataset_is_generated_exits_at_once_after_showing_progress(tmp_path: Path) -> None:
    pytest.importorskip("reasoning_gym")
    argv = relayrl_argv(
        "train",
        SIM_RECIPE,
        *_sets("task.kind=reasoning_gym", "task.dataset=chain_sum", "task.dataset_size=1000000", "run.output_dir=runs"),
    )
    proc = subprocess.Popen(argv, cwd=tmp_path, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()  # the first progress line, ~1.5 s into generating
        assert line.startswith("relayrl: generating reasoning-gym dataset 'chain_sum' entries: "), line
        assert "/1,000,000 (" in line
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143, err
    assert not (tmp_path / "runs").exists()
