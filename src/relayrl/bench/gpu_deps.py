"""What relayrl[local] needs that a given Python lacks, for `scripts/gpu_wheels.sh` and
`scripts/gpu_check.sh --offline` (issue 30): run by that Python with `PYTHONPATH=src`, standard
library only (plus `packaging`, or pip's vendored copy when the Python has no `packaging`), so it
runs before pydantic or anything else of relayrl's is there.

    python -m relayrl.bench.gpu_deps missing [--extra local] [--wheels DIR]
        the requirements (one per line, `name<specifier>`) that neither this Python's installed
        distributions nor the wheels in DIR satisfy, following the requirements of DIR's wheels
    python -m relayrl.bench.gpu_deps plan --wheels DIR [--extra local]
        `name==version` of every wheel in DIR to install (the closure); exit 1 naming what DIR lacks
    python -m relayrl.bench.gpu_deps target
        the `pip download` flags (one per line) for this Python's version, ABI and platforms

Invariant: an installed distribution that satisfies a requirement is never replaced (its own
requirements are the environment's business and are not followed, except the extras asked for),
so what is installed into a folder of its own never shadows the torch or transformers there.
"""

from __future__ import annotations

import argparse
import email.parser
import importlib
import importlib.metadata
import sys
import tomllib
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Resolution", "pip_target_flags", "resolve"]

PYPROJECT = Path(__file__).resolve().parents[3] / "pyproject.toml"


def _packaging(module: str) -> Any:
    """`packaging.<module>`, or pip's vendored copy (a Python with pip but no packaging)."""
    try:
        return importlib.import_module(f"packaging.{module}")
    except ImportError:
        pass
    try:
        return importlib.import_module(f"pip._vendor.packaging.{module}")
    except ImportError:
        raise SystemExit(f"gpu_deps: {sys.executable} has neither `packaging` nor pip (which vendors it): install pip there") from None


def _canonical(name: str) -> str:
    return str(_packaging("utils").canonicalize_name(name))


@dataclass(slots=True)
class _Wheel:
    name: str
    version: Any  # packaging Version
    path: Path
    requires: list[str]


@dataclass(slots=True)
class Resolution:
    """`chosen`: canonical name -> the wheel of DIR to install; `missing`: canonical name -> the
    requirement strings nothing satisfies (installed or in DIR)."""

    chosen: dict[str, _Wheel] = field(default_factory=dict)
    missing: dict[str, list[str]] = field(default_factory=dict)

    def missing_lines(self) -> list[str]:
        """One requirement per missing project, its specifiers combined (pip's input)."""
        specifiers = _packaging("specifiers")
        out = []
        for name, reqs in sorted(self.missing.items()):
            combined = specifiers.SpecifierSet()
            requirements = _packaging("requirements")
            for r in reqs:
                combined &= requirements.Requirement(r).specifier
            out.append(f"{name}{combined}")
        return out


def project_requirements(extras: Sequence[str], pyproject: Path = PYPROJECT) -> list[str]:
    """relayrl's own requirements (pyproject.toml: dependencies plus these optional extras)."""
    project = tomllib.loads(pyproject.read_text())["project"]
    reqs = list(project.get("dependencies", []))
    optional = project.get("optional-dependencies", {})
    for extra in extras:
        if extra not in optional:
            raise SystemExit(f"gpu_deps: {pyproject} has no optional extra {extra!r} (has: {', '.join(optional)})")
        reqs += optional[extra]
    return reqs


def _installed() -> dict[str, Any]:
    """canonical name -> the distribution this Python imports (the first on sys.path)."""
    out: dict[str, Any] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            out.setdefault(_canonical(name), dist)
    return out


def _wheel_requires(path: Path) -> list[str]:
    with zipfile.ZipFile(path) as zf:
        meta = next((n for n in zf.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")), None)
        if meta is None:
            return []
        message = email.parser.Parser().parsestr(zf.read(meta).decode("utf-8", "replace"), headersonly=True)
    return list(message.get_all("Requires-Dist") or [])


def _wheels(directory: Path | None) -> dict[str, list[_Wheel]]:
    """The wheels of `directory` this Python can install, per canonical name, newest first."""
    if directory is None or not directory.is_dir():
        return {}
    utils, tags = _packaging("utils"), _packaging("tags")
    supported = set(tags.sys_tags())
    out: dict[str, list[_Wheel]] = {}
    for path in sorted(directory.glob("*.whl")):
        try:
            name, version, _build, wheel_tags = utils.parse_wheel_filename(path.name)
        except Exception:  # not a wheel name pip would accept either
            continue
        if supported.isdisjoint(wheel_tags):
            continue
        out.setdefault(str(name), []).append(_Wheel(str(name), version, path, _wheel_requires(path)))
    for found in out.values():
        found.sort(key=lambda w: w.version, reverse=True)
    return out


def _applies(requirement: Any, extras: Iterable[str]) -> bool:
    if requirement.marker is None:
        return True
    return any(requirement.marker.evaluate({"extra": e}) for e in (*extras, ""))


def resolve(roots: Sequence[str], wheel_dir: Path | None) -> Resolution:
    """Follow `roots` through this Python's installed distributions and the wheels of
    `wheel_dir` (see the module's invariant)."""
    requirements, specifiers = _packaging("requirements"), _packaging("specifiers")
    installed = _installed()
    wheels = _wheels(wheel_dir)
    res = Resolution()
    combined: dict[str, Any] = {}  # canonical name -> every specifier asked of it so far
    asked: dict[str, list[str]] = {}
    queue: list[tuple[str, tuple[str, ...]]] = [(r, ()) for r in roots]  # (requirement, extras of its parent)
    followed: set[tuple[str, str]] = set()  # (wheel path, extra) whose requirements are queued
    while queue:
        text, parent_extras = queue.pop(0)
        req = requirements.Requirement(text)
        if not _applies(req, parent_extras):
            continue
        name = _canonical(req.name)
        combined[name] = combined.get(name, specifiers.SpecifierSet()) & req.specifier
        asked.setdefault(name, []).append(str(req))
        spec = combined[name]
        dist = installed.get(name)
        if dist is not None and spec.contains(dist.version, prereleases=True):
            for extra in sorted(req.extras):  # an extra asked of an installed distribution: its requirements
                queue += [(r, (extra,)) for r in (dist.requires or []) if "extra" in r]
            continue
        candidates = [w for w in wheels.get(name, []) if spec.contains(w.version, prereleases=True)]
        if not candidates:
            res.chosen.pop(name, None)
            res.missing[name] = asked[name]
            continue
        wheel = candidates[0]
        res.chosen[name] = wheel
        res.missing.pop(name, None)
        for extra in ("", *sorted(req.extras)):
            if (str(wheel.path), extra) not in followed:
                followed.add((str(wheel.path), extra))
                queue += [(r, (extra,) if extra else ()) for r in wheel.requires]
    return res


def pip_target_flags() -> list[str]:
    """`pip download` flags that fetch wheels for this Python: version, implementation, ABIs and
    every platform tag it accepts (most specific first)."""
    tags = _packaging("tags")
    abis: list[str] = []
    platforms: list[str] = []
    for tag in tags.sys_tags():
        if tag.abi not in abis:
            abis.append(tag.abi)
        if tag.platform not in platforms and tag.platform != "any":
            platforms.append(tag.platform)
    flags = [f"--python-version={sys.version_info.major}.{sys.version_info.minor}", f"--implementation={tags.interpreter_name()}"]
    flags += [f"--abi={a}" for a in abis]
    flags += [f"--platform={p}" for p in platforms]
    return flags


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m relayrl.bench.gpu_deps", description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("command", choices=("missing", "plan", "target"))
    parser.add_argument("--extra", action="append", default=None, help="relayrl's optional extras to include (default: local)")
    parser.add_argument("--wheels", type=Path, default=None, help="a folder of wheels (scripts/gpu_wheels.sh fills it)")
    parser.add_argument("--pyproject", type=Path, default=PYPROJECT)
    args = parser.parse_args(argv)
    if args.command == "target":
        print("\n".join(pip_target_flags()))
        return 0
    if args.wheels is not None and not args.wheels.is_dir():
        print(f"gpu_deps: --wheels {args.wheels}: no such folder", file=sys.stderr)
        return 2
    res = resolve(project_requirements(args.extra or ["local"], args.pyproject), args.wheels)
    if args.command == "missing":
        lines = res.missing_lines()
        if lines:
            print("\n".join(lines))
        return 0
    if res.missing:
        where = f"in {args.wheels}" if args.wheels is not None else "(no --wheels folder given)"
        print(f"no wheel {where} for: {', '.join(res.missing_lines())}", file=sys.stderr)
        return 1
    for wheel in sorted(res.chosen.values(), key=lambda w: w.name):
        print(f"{wheel.name}=={wheel.version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
