"""The import rules of DESIGN.md, checked on the source tree.

types and config import nothing of ours (and no torch); libraries import only lower layers; stages
import libraries and each other's top-level package, never each other's internals; nothing imports
the applications (cli, demo, bench) except cli; test-only libraries never reach the runtime package.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "realtime_rl"

BASE = {"types": 0, "config": 0}
LIBRARIES = {"monitor": 1, "model": 2, "environments": 3, "collect": 4, "rewards": 5}  # rewards reads the event store
STAGES = {"engine", "rollout", "train", "serve", "evaluate", "deploy", "adapt", "loop"}
APPS = {"cli", "demo", "bench"}
TEST_ONLY = {"transformers", "trl"}


def component(module: str) -> str:
    parts = module.split(".")
    assert parts[0] == "realtime_rl"
    return parts[1] if len(parts) > 1 else "__root__"


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> list[tuple[str, int]]:
    """Absolute names imported by a file, with line numbers (relative imports resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = module_name(path).split(".")
    if path.name != "__init__.py":
        here = here[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
            out.append((base, node.lineno))
            out += [(f"{base}.{a.name}", node.lineno) for a in node.names if base == "realtime_rl"]
    return out


def violation(src: str, target: str) -> str | None:
    s, t = component(src), component(target)
    if s == t or t == "__root__":
        return None
    if t in APPS and not (s == "cli"):
        return f"nothing but cli imports the application module {t}"
    if s in BASE:
        return f"{s} imports nothing of ours"
    if s in LIBRARIES:
        ok = t in BASE or (t in LIBRARIES and LIBRARIES[t] < LIBRARIES[s])
        return None if ok else f"library {s} may import only lower layers, not {t}"
    if s in STAGES:
        if t in BASE or t in LIBRARIES:
            return None
        if t in STAGES:
            return None if target == f"realtime_rl.{t}" else f"stage {s} imports {target}, an internal of stage {t}"
        return f"stage {s} may not import {t}"
    if s in APPS or s == "__root__":
        return None
    return f"component {s} is not classified in tests/unit/test_layering.py: add it to a layer"


def test_every_component_is_classified():
    known = set(BASE) | set(LIBRARIES) | STAGES | APPS
    found = {component(module_name(p)) for p in SRC.rglob("*.py")} - {"__root__"}
    assert found <= known, f"unclassified components: {sorted(found - known)}"


def test_import_layering():
    problems = []
    for path in sorted(SRC.rglob("*.py")):
        src = module_name(path)
        for target, line in imports(path):
            if target == "realtime_rl" or target.startswith("realtime_rl."):
                why = violation(src, target)
                if why:
                    problems.append(f"{path.relative_to(SRC.parent)}:{line}: {why}")
    assert not problems, "\n".join(problems)


def test_types_and_config_do_not_import_torch():
    for path in [SRC / "types.py", *sorted((SRC / "config").glob("*.py"))]:
        roots = {t.split(".")[0] for t, _ in imports(path)}
        assert "torch" not in roots, f"{path.name} imports torch"


def test_runtime_never_imports_test_only_libraries():
    problems = []
    for path in SRC.rglob("*.py"):
        if component(module_name(path)) == "bench":
            continue
        for target, line in imports(path):
            if target.split(".")[0] in TEST_ONLY:
                problems.append(f"{path.relative_to(SRC.parent)}:{line} imports {target}")
    assert not problems, "\n".join(problems)


def test_checker_catches_violations():
    assert violation("realtime_rl.config", "realtime_rl.model")
    assert violation("realtime_rl.model.qwen3", "realtime_rl.environments.tasks")
    assert violation("realtime_rl.serve.app", "realtime_rl.engine.scheduler")
    assert violation("realtime_rl.train.loop", "realtime_rl.cli")
    assert violation("realtime_rl.newthing", "realtime_rl.model")
    assert violation("realtime_rl.serve.app", "realtime_rl.engine") is None
    assert violation("realtime_rl.environments.sandbox", "realtime_rl.model") is None
