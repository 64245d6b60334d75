"""The package's import floors (docs/architecture.md, "Module map"): a module imports only its own floor or below,
the import graph has no cycle, and a function-local import of a package module only reaches a lower floor (so no
local import exists to dodge a cycle). Parsed from the source with ``ast``; nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "relibra_moe"

# Floors as in docs/architecture.md; the first matching prefix wins (module names relative to the package).
FLOORS: tuple[tuple[str, int], ...] = (
    ("errors", 1), ("validate", 1), ("spec_sources", 1), ("specs", 1), ("npzio", 1),
    ("trace", 2), ("trace_files", 2), ("adapters", 2), ("dumps", 2), ("cost", 2), ("timing", 2), ("plan", 2),
    ("sample_order", 2),
    ("triton_kernels", 2),
    ("evaluate", 3), ("sim", 3), ("datasets", 3), ("synthetic", 3), ("metrics", 3), ("layers", 3),
    ("planners", 4),
    ("integrations", 5), ("steady", 5),
    ("commands", 6), ("cli", 6), ("report", 6),
    ("__init__", 7), ("__main__", 7),
)


PENDING_LOCAL_IMPORTS: set[str] = set()
"""Modules allowed to import a same-floor module inside a function (none: keep it empty)."""


def floor_of(module: str) -> int:
    for prefix, floor in FLOORS:
        if module == prefix or module.startswith(prefix + "."):
            return floor
    raise AssertionError(f"relibra_moe.{module} has no floor: add it to FLOORS and docs/architecture.md")


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom | ast.Import) -> list[str]:
    """Package-relative names of the relibra_moe modules an import statement reaches."""
    if isinstance(node, ast.Import):
        return [a.name[len("relibra_moe."):] for a in node.names if a.name.startswith("relibra_moe.")]
    if node.level == 0:
        if node.module is None or not (node.module + ".").startswith("relibra_moe."):
            return []
        base = node.module[len("relibra_moe."):] if node.module != "relibra_moe" else ""
    else:
        parts = importer.split(".") if importer != "__init__" else []
        pkg = parts if is_package else parts[:-1]
        pkg = pkg[:len(pkg) - (node.level - 1)]
        base = ".".join(pkg + ([node.module] if node.module else []))
    out = []
    for a in node.names:
        cand = f"{base}.{a.name}" if base else a.name
        if (PKG / (cand.replace(".", "/") + ".py")).exists() or (PKG / cand.replace(".", "/")).is_dir():
            out.append(cand)  # ``from . import x`` with x a module
        elif base:
            out.append(base)
    return out


def _in_type_checking(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def collect() -> tuple[dict[str, set[str]], list[tuple[str, str, int, bool]]]:
    """(module -> modules imported at module level, [(importer, imported, line, function_local)])."""
    graph: dict[str, set[str]] = {}
    edges: list[tuple[str, str, int, bool]] = []
    for path in sorted(PKG.rglob("*.py")):
        mod = module_name(path)
        tree = ast.parse(path.read_text(), str(path))
        parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
        graph.setdefault(mod, set())
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or _in_type_checking(node, parents):
                continue
            local = False
            p = node
            while p in parents:
                p = parents[p]
                if isinstance(p, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    local = True
                    break
            for target in _resolve(mod, path.name == "__init__.py", node):
                if target == mod or target == "":
                    continue
                edges.append((mod, target, node.lineno, local))
                if not local:
                    graph[mod].add(target)
    return graph, edges


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (c := visit(m)):
                return c
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (c := visit(n)):
            return c
    return None


def _pkg_of(module: str) -> str:
    return module.rsplit(".", 1)[0] if "." in module else ""


def violations(graph: dict[str, set[str]], edges: list[tuple[str, str, int, bool]]) -> list[str]:
    out = []
    for importer, target, line, local in edges:
        if importer.endswith("__init__") or importer == _pkg_of(target) or importer == "__init__":
            continue  # a package's __init__ re-exports its own modules
        fi, ft = floor_of(importer), floor_of(target)
        if ft > fi:
            out.append(f"relibra_moe.{importer}:{line} imports relibra_moe.{target} from a higher floor ({ft} > {fi})")
        elif local and ft == fi and importer not in PENDING_LOCAL_IMPORTS:
            out.append(f"relibra_moe.{importer}:{line} imports relibra_moe.{target} (same floor {fi}) inside a "
                       "function: a module-level import, or none")
    cycle = find_cycle(graph)
    if cycle:
        out.append("import cycle: " + " -> ".join(cycle))
    return out


def test_every_module_has_a_floor():
    graph, _ = collect()
    for mod in graph:
        floor_of(mod)


def test_imports_respect_the_floors_and_form_no_cycle():
    graph, edges = collect()
    assert violations(graph, edges) == []


@pytest.mark.parametrize("edges, graph, expect", [
    ([("planners.strategies", "commands.plan", 3, False)], {}, "from a higher floor"),
    ([("sim", "planners.reorder", 9, True)], {}, "from a higher floor"),
    ([("planners.strategies", "planners.replicate", 5, True)], {}, "inside a function"),
    ([], {"a": {"b"}, "b": {"a"}}, "import cycle: a -> b -> a"),
])
def test_the_checker_flags_each_kind_of_violation(edges, graph, expect):
    got = violations(graph, edges)
    assert len(got) == 1 and expect in got[0], got


def test_a_lower_floor_local_import_is_allowed():
    assert violations({}, [("commands.plan", "evaluate", 3, True), ("planners.strategies", "plan", 1, False)]) == []


POOL_OWNERS = {"planners/executor.py", "planners/service.py"}
"""The only modules that start process pools: every strategy runs its tasks on ``ctx.executor``."""


def pool_users(root: Path) -> set[str]:
    """Modules under ``root`` importing ``ProcessPoolExecutor`` (anywhere in the file, local imports too)."""
    out = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and any(a.name == "ProcessPoolExecutor" for a in node.names):
                out.add(path.relative_to(root).as_posix())
    return out


def test_only_the_executors_start_process_pools(tmp_path):
    assert pool_users(PKG) <= POOL_OWNERS
    (tmp_path / "m.py").write_text("def f():\n    from concurrent.futures import ProcessPoolExecutor\n")
    assert pool_users(tmp_path) == {"m.py"}  # the checker sees a function-local import


MAX_FUNCTION_LINES = 100
KERNEL_DECORATORS = ("triton.jit", "njit", "numba.njit", "jit")
"""A function under one of these decorators is a Triton / numba kernel: exempt (splitting one costs speed)."""

LONG_FUNCTIONS_ALLOWED: set[str] = set()
"""Files (a trailing ``/``: a folder) whose host functions may still run over MAX_FUNCTION_LINES. Empty: no host
function of the package is longer; keep it so."""


def long_host_functions(root: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``file:function:lines`` of every function under ``root`` longer than ``limit`` lines (decorators
    excluded, docstring included), kernels (``KERNEL_DECORATORS``) left out."""
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            names = {ast.unparse(d.func if isinstance(d, ast.Call) else d) for d in node.decorator_list}
            if names & set(KERNEL_DECORATORS):
                continue
            n = node.end_lineno - node.lineno + 1
            if n > limit:
                out.append(f"{path.relative_to(root).as_posix()}:{node.name}:{n}")
    return out


def test_no_host_function_over_100_lines():
    def allowed(entry: str) -> bool:
        rel = entry.split(":")[0]
        return any(rel == a or (a.endswith("/") and rel.startswith(a)) for a in LONG_FUNCTIONS_ALLOWED)

    assert [e for e in long_host_functions(PKG) if not allowed(e)] == []


def test_the_length_check_counts_lines_and_skips_kernels(tmp_path):
    body = "    x = 1\n" * 100
    (tmp_path / "m.py").write_text(f"def long():\n{body}\n\ndef short():\n    return 1\n\n"
                                   f"@triton.jit\ndef kernel():\n{body}\n\n@njit(cache=True)\ndef nb():\n{body}")
    assert long_host_functions(tmp_path) == ["m.py:long:101"]
    assert long_host_functions(tmp_path, limit=101) == []


TESTS = Path(__file__).resolve().parents[1]

#: Test modules that pin no single package module (end to end across modules); nothing else lives in tests/e2e.
E2E_TESTS = frozenset({
    "test_adversarial_files.py",  # bad files through the CLI, planners and simulator
    "test_adversarial_ranks.py",  # one bad rank in a multi-rank layer/replay/relayout group
    "test_adversarial_service.py",  # bad batches through the planning service and strategies
    "test_architecture.py",  # import floors, test layout, docs/architecture.md names
    "test_fsdp_example.py",  # examples/rl_step_fsdp.py
    "test_gpu_check.py",  # bench/gpu_check.sh
    "test_kernels_compile.py",  # torch.library opcheck / torch.compile of every Triton op
    "test_kernels_cuda.py",  # every Triton kernel compiled on a GPU
    "test_kernels_sm90.py",  # every Triton kernel compiled ahead of time for sm_90
    "test_megatron_example.py",  # examples/megatron_step.py
    "test_never_lose.py",  # property: relibra never slower than the baselines (planners + simulator)
    "test_oracle.py",  # bench/oracle.py: plans and figures of a fixed matrix
    "test_rl_step.py",  # examples/rl_step.py
})


def unmapped_tests(tests: Path, pkg: Path) -> list[str]:
    """Test files whose path does not mirror a package module: ``tests/<dirs>/test_<name>.py`` pins
    ``relibra_moe/<dirs>/<name>.py``; ``tests/e2e`` holds exactly :data:`E2E_TESTS`."""
    bad = []
    for path in sorted(tests.rglob("test_*.py")):
        rel = path.relative_to(tests)
        if rel.parts[0] == "e2e":
            if len(rel.parts) != 2 or rel.name not in E2E_TESTS:
                bad.append(f"{rel.as_posix()}: not in E2E_TESTS")
            continue
        module = pkg.joinpath(*rel.parts[:-1], rel.name.removeprefix("test_"))
        if not module.is_file():
            bad.append(f"{rel.as_posix()}: no module relibra_moe/{module.relative_to(pkg).as_posix()}")
    missing = sorted(E2E_TESTS - {p.name for p in (tests / "e2e").glob("test_*.py")})
    bad += [f"e2e/{name}: listed in E2E_TESTS but absent" for name in missing]
    return bad


def test_tests_mirror_the_package():
    assert unmapped_tests(TESTS, PKG) == []


def test_the_mapping_check_flags_a_stray_test(tmp_path):
    pkg, tests = tmp_path / "pkg", tmp_path / "tests"
    (pkg / "layers").mkdir(parents=True)
    (pkg / "layers" / "moe.py").write_text("")
    for rel in ("layers/test_moe.py", "test_layers_moe.py", "planners/test_moe.py", "e2e/test_demo.py"):
        (tests / rel).parent.mkdir(parents=True, exist_ok=True)
        (tests / rel).write_text("")
    bad = unmapped_tests(tests, pkg)
    assert [b.split(":")[0] for b in bad] == ["e2e/test_demo.py", "planners/test_moe.py", "test_layers_moe.py"] + [
        f"e2e/{n}" for n in sorted(E2E_TESTS)]
