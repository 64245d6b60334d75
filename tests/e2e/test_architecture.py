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
    ("errors", 1), ("validate", 1), ("spec_sources", 1), ("specs", 1), ("npzio", 1), ("safe_pickle", 1),
    ("atomic", 1),
    ("trace", 2), ("trace_files", 2), ("adapters", 2), ("dumps", 2), ("cost", 2), ("timing", 2), ("plan", 2),
    ("plan_stats", 2), ("cost_terms", 2),
    ("sample_order", 2), ("sample_placements", 2),
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


MAX_FUNCTION_LINES = 80
KERNEL_DECORATORS = ("triton.jit", "njit", "numba.njit", "nb.njit", "jit")
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


def test_no_host_function_over_80_lines():
    def allowed(entry: str) -> bool:
        rel = entry.split(":")[0]
        return any(rel == a or (a.endswith("/") and rel.startswith(a)) for a in LONG_FUNCTIONS_ALLOWED)

    assert [e for e in long_host_functions(PKG) if not allowed(e)] == []


def test_the_length_check_counts_lines_and_skips_kernels(tmp_path):
    body = "    x = 1\n" * 80
    (tmp_path / "m.py").write_text(f"def long():\n{body}\n\ndef short():\n    return 1\n\n"
                                   f"@triton.jit\ndef kernel():\n{body}\n\n@njit(cache=True)\ndef nb():\n{body}"
                                   f"\n\n@nb.njit(cache=True)\ndef nb2():\n{body}")
    assert long_host_functions(tmp_path) == ["m.py:long:81"]
    assert long_host_functions(tmp_path, limit=81) == []


TESTS = Path(__file__).resolve().parents[1]

#: Test modules that pin no single package module (end to end across modules); nothing else lives in tests/e2e.
E2E_TESTS = frozenset({
    "test_adversarial_dumps.py",  # hostile framework dumps: no code runs, sizes bounded, named errors
    "test_adversarial_files.py",  # bad files through the CLI, planners and simulator
    "test_adversarial_numbers.py",  # absurd profile rates, model configs, swap and trainer arguments
    "test_adversarial_ranks.py",  # one bad rank in a multi-rank layer/replay/relayout group
    "test_adversarial_writes.py",  # a save killed at every member boundary; outputs into bad targets
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


# --- docs/architecture.md against the code -------------------------------------------------------------------

DOC = PKG.parent / "docs" / "architecture.md"

#: Names in the doc's code blocks that stand for a value, with the package class they hold (``plan.samples``
#: is checked as ``BatchPlan.samples``).
DOC_VARIABLES = {"plan": "BatchPlan", "batch": "TraceBatch", "future": None, "loss": None, "optimizer": None,
                 "model": None}
#: Names the code blocks show that are not the package's.
DOC_EXTERNAL = frozenset({"Future"})


def package_index(pkg: Path = PKG) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """``{module: top-level names}`` and ``{class: attributes}`` (methods, properties, fields, class
    attributes, inherited from package bases) of every module, from the source: a dataclass field without a
    default is no class attribute, so ``getattr`` on the imported class would miss it."""
    modules: dict[str, set[str]] = {}
    classes: dict[str, set[str]] = {}
    bases: dict[str, list[str]] = {}
    for path in pkg.rglob("*.py"):
        name = module_name(path)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        top = modules.setdefault(name, set())
        for node in tree.body:
            targets: list[ast.expr] = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                top.add(node.name)
            elif isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, ast.AnnAssign):
                targets = [node.target]
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                top.update((a.asname or a.name).split(".")[0] for a in node.names)
            top.update(t.id for t in targets if isinstance(t, ast.Name))
            if isinstance(node, ast.ClassDef):
                attrs = classes.setdefault(node.name, set())
                bases.setdefault(node.name, []).extend(b.id for b in node.bases if isinstance(b, ast.Name))
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        attrs.add(item.name)
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        attrs.add(item.target.id)
                    elif isinstance(item, ast.Assign):
                        attrs.update(t.id for t in item.targets if isinstance(t, ast.Name))
    for cls in classes:
        todo = list(bases.get(cls, []))
        while todo:
            base = todo.pop()
            if base in classes:
                classes[cls] |= classes[base]
                todo.extend(bases.get(base, []))
    return modules, classes


def resolve(dotted: str, modules: dict[str, set[str]], classes: dict[str, set[str]]) -> bool:
    """``a.b.c`` names a package module, a module's name, or a class's attribute (``relibra_moe.`` optional;
    a leading name of :data:`DOC_VARIABLES` stands for its class); ``a/b.py`` or ``b.py`` a module file."""
    if dotted.endswith(".py"):
        return any(p.name == dotted.split("/")[-1] for p in PKG.rglob("*.py"))
    parts = dotted.removeprefix("relibra_moe.").split(".")
    head, rest = parts[0], parts[1:]
    if head in DOC_VARIABLES and rest:
        cls = DOC_VARIABLES[head]
        if cls is None or (rest[0] in classes.get(cls, set()) and _resolve_attrs(rest[0], rest[1:], classes)):
            return True
    for i in range(len(parts), 0, -1):
        mod = ".".join(parts[:i])
        if mod in modules or f"{mod}.__init__" in modules:
            names = modules.get(mod, modules.get(f"{mod}.__init__", set()))
            left = parts[i:]
            return not left or (left[0] in names and _resolve_attrs(left[0], left[1:], classes))
    if not rest:
        return any(head in names for names in modules.values()) or head in DOC_EXTERNAL
    return head in classes and rest[0] in classes[head] and _resolve_attrs(rest[0], rest[1:], classes)


def _resolve_attrs(owner: str, attrs: list[str], classes: dict[str, set[str]]) -> bool:
    """Beyond ``Class.attr`` only an attribute holding a package class resolves (``plan.samples.gpu``)."""
    if not attrs:
        return True
    kinds = {"samples": "SamplePlacement", "placement": "Placement", "replicas": "ReplicaPlan", "stats": "PlanStats",
             "migration": "MigrationStats", "portfolio": "PortfolioStats"}
    cls = kinds.get(owner, owner)
    return attrs[0] in classes.get(cls, set()) and _resolve_attrs(attrs[0], attrs[1:], classes)


def doc_names(text: str) -> list[str]:
    """The names the doc shows as code: every backticked dotted name whose head is a package module
    (``evaluate.PlanScore``, ``relibra_moe.layers.moe``) anywhere; in the module map every backticked name
    (``score_plan``, ``relayout(...)`` -> ``relayout``); in the code blocks every snake_case or CamelCase
    identifier and every dotted name (a call, a class, ``plan.num_micro_batches``; ``mb.routing`` fails: ``mb``
    is no package name and not in :data:`DOC_VARIABLES`) that is not a keyword argument or a ``#`` comment."""
    import re

    heads = {p.stem for p in PKG.iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()} | {"relibra_moe"}
    names: list[str] = []
    for m in re.finditer(r"`([A-Za-z_][\w.]*)[`(\[]", text):
        name = m.group(1)
        dotted_code = "." in name and name.split(".")[0] in heads | set(DOC_VARIABLES)
        if dotted_code and not re.search(r"\.(json|npz|md)$", name):
            names.append(name)
    blocks = [re.sub(r"#.*", "", b) for b in re.findall(r"```\n(.*?)```", text, re.S)]
    module_map = text.split("## Module map", 1)[1].split("## ", 1)[0]
    names += [m.group(1) for m in re.finditer(r"`([A-Za-z_][\w.]*)[`(\[]", module_map)]
    ident = r"(?<![\w.])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?!\w|\s*=[^=]|\.py)"
    for block in blocks:
        if block.startswith("relibra_moe/"):
            continue  # the module map's tree is checked by test_the_module_map_lists_every_module
        for m in re.finditer(ident, block):
            word = m.group(1)
            head = word.split(".")[0]
            if "." in word or "_" in head.strip("_") or re.fullmatch(r"[A-Z][a-z0-9]+(?:[A-Z][a-z0-9]*)+", head):
                names.append(word)
    return names


def test_every_name_the_architecture_page_shows_exists():
    modules, classes = package_index()
    names = doc_names(DOC.read_text(encoding="utf-8"))
    assert len(names) > 50, names  # the parse found the blocks
    assert sorted({n for n in names if not resolve(n, modules, classes)}) == []


def test_the_name_check_flags_a_missing_name():
    modules, classes = package_index()
    text = ("## Module map\n\n`score_plan` `evaluate.PlanScore.t_moe_s` `plan.micro_batches`\n\n"
            "```\nfor mb in plan.micro_batches:\n    with replay(model, mb.routing, mb.replicas, micro_batch=m):\n"
            "        relayout_all(model)\n```\n## Contracts\n`sim.StepTime.nothing`\n")
    bad = sorted({n for n in doc_names(text) if not resolve(n, modules, classes)})
    assert bad == ["mb.replicas", "mb.routing", "plan.micro_batches", "relayout_all", "sim.StepTime.nothing"]


def module_map(text: str) -> dict[str, int]:
    """``{module: floor}`` of the module map's tree: the leading ``name.py`` / ``pkg/`` words of each line, a
    module in the package of the nearest ``pkg/`` line above with less indentation; the floor ``(n)`` of its
    line, else its package's."""
    import re

    block = text.split("## Module map", 1)[1].split("```\n", 2)[1]
    listed: dict[str, int] = {}
    stack: list[tuple[int, str, int]] = []  # (indent, dotted package, floor)
    for line in block.splitlines()[1:]:  # below "relibra_moe/"
        indent = len(line) - len(line.lstrip())
        if indent == 0:
            break
        while stack and stack[-1][0] >= indent:
            stack.pop()
        pkg, floor = (stack[-1][1], stack[-1][2]) if stack else ("", 0)
        m = re.search(r"\((\d)\)", line)
        floor = int(m.group(1)) if m else floor
        for word in line.split():
            if word.endswith("/"):
                listed[pkg + word[:-1]] = floor  # the package itself (its __init__.py)
                pkg += word[:-1] + "."
                stack.append((indent, pkg, floor))
            elif word.endswith(".py"):
                listed[pkg + word[:-3]] = floor
            else:
                break
    return listed


def test_the_module_map_lists_every_module_at_its_floor():
    listed = module_map(DOC.read_text(encoding="utf-8"))
    existing = {module_name(p) for p in PKG.rglob("*.py")}
    assert len(listed) > 60, listed  # the parse found the tree
    assert sorted(set(listed) ^ existing) == []
    assert {m: f for m, f in listed.items() if f != floor_of(m)} == {}


#: Package modules without a test file of their own (a folder: a trailing ``/``): the Triton kernels, which only
#: their host module launches (``triton_kernels/<name>.py``, tested in ``tests/triton_kernels/test_<name>.py``).
NO_TEST_FILE = frozenset({"triton_kernels/_details/"})


def untested_modules(pkg: Path, tests: Path) -> list[str]:
    """Package modules (``__init__`` and ``__main__`` aside) with no ``tests/<dirs>/test_<name>.py``."""
    out = []
    for path in sorted(pkg.rglob("*.py")):
        rel = path.relative_to(pkg)
        if path.name in ("__init__.py", "__main__.py"):
            continue
        if not tests.joinpath(*rel.parts[:-1], f"test_{rel.name}").is_file():
            out.append(rel.as_posix())
    return out


def test_every_module_has_a_test_file():
    allowed = [m for m in untested_modules(PKG, TESTS) if any(m.startswith(a) for a in NO_TEST_FILE)]
    assert [m for m in untested_modules(PKG, TESTS) if m not in allowed] == []


def test_the_test_file_check_flags_a_module_without_one(tmp_path):
    pkg, tests = tmp_path / "pkg", tmp_path / "tests"
    for rel in ("a.py", "sub/b.py", "sub/__init__.py", "__main__.py"):
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text("")
    (tests / "sub").mkdir(parents=True)
    (tests / "sub" / "test_b.py").write_text("")
    assert untested_modules(pkg, tests) == ["a.py"]
