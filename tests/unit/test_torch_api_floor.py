"""Issue 30: relayrl must run on the GPU machines' torch 2.11, so it uses no torch API newer than
that. Every dotted torch name relayrl's source refers to (`torch.cuda.mem_get_info`, `from
torch.distributed.fsdp import fully_shard`, `F.linear` through an alias) must resolve in the
installed torch: CI runs this in the main venv and again in `.venv-tf517`, which holds torch
2.11.0 and transformers 5.17.0 (.ci/run). Method calls on tensors and keyword arguments are not
seen here: the tests CI runs under torch 2.11 cover those paths that run on a CPU."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.torch

SRC = Path(__file__).resolve().parents[2] / "src" / "relayrl"


def torch_names(tree: ast.Module) -> set[str]:
    """The dotted torch names a module refers to: what it imports from torch, and each attribute
    chain that starts at a name bound to torch or to something imported from it."""
    aliases: dict[str, str] = {}
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    aliases[a.asname or "torch"] = a.name if a.asname else "torch"
                    names.add(a.name)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "torch":
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                names.add(f"{node.module}.{a.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            parts: list[str] = []
            cur: ast.expr = node
            while isinstance(cur, ast.Attribute):
                parts.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name) and cur.id in aliases:
                names.add(".".join([aliases[cur.id], *reversed(parts)]))
    return names


def resolves(name: str) -> bool:
    """Whether `name` is a module of the installed torch or an attribute reachable from one."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if hasattr(obj, attr):
                obj = getattr(obj, attr)
            elif isinstance(obj, ModuleType):  # a submodule nothing has imported yet
                try:
                    obj = importlib.import_module(f"{obj.__name__}.{attr}")
                except ImportError:
                    return False
            else:
                return False
        return True
    return False


def test_the_scan_sees_imports_aliases_and_chains() -> None:
    tree = ast.parse(
        "import torch\nimport torch.nn.functional as F\nfrom torch.distributed.fsdp import fully_shard as fs\n"
        "torch.cuda.mem_get_info()\nF.linear(x, w)\nfs.__doc__\nother.cuda.thing\n"
    )
    assert torch_names(tree) == {
        "torch",
        "torch.nn.functional",
        "torch.distributed.fsdp.fully_shard",
        "torch.cuda",
        "torch.cuda.mem_get_info",
        "torch.nn.functional.linear",
        "torch.distributed.fsdp.fully_shard.__doc__",
    }
    assert resolves("torch.cuda.mem_get_info") and resolves("torch.distributed.fsdp.fully_shard")
    assert not resolves("torch.cuda.no_such_function") and not resolves("torch.no_such_module.x")


def test_every_torch_name_in_the_source_exists_in_the_installed_torch() -> None:
    import torch

    used: dict[str, set[str]] = {}
    for path in sorted(SRC.rglob("*.py")):
        for name in torch_names(ast.parse(path.read_text(), str(path))):
            used.setdefault(name, set()).add(str(path.relative_to(SRC)))
    assert "torch.cuda.is_available" in used and len(used) > 50  # (the scan found the source)
    # NCCL's process group class exists only in CUDA builds of torch (the GPU machines', and
    # .venv-tf517's): checked there, where NCCL is built in
    nccl_only = {name for name in used if name.startswith("torch.distributed.ProcessGroupNCCL")}
    if torch.distributed.is_nccl_available():
        nccl_only = set()
    missing = {name: sorted(files) for name, files in sorted(used.items()) if name not in nccl_only and not resolves(name)}
    assert not missing, f"torch {torch.__version__} lacks names relayrl uses: {missing}"
