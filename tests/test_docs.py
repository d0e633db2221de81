"""docs/method.md's "Where each equation lives", checked against the code, so the table cannot drift.

Each row's path is backticked names joined by arrows:
    `a` -> `b`    a's body calls b (a Call whose function is named b, plain or as an attribute)
    `a` ~> `b`    a hands b on as a callback (b named inside a, not called there: a thread runs it)
A name is `module.function`, `module.Class.method`, `Class.method`, or a bare name that one project module defines.
`x=module.f` is a call named x that runs f: the recipe's `score=rewards.para_grpo_score` (a Recipe field holds f).
The row's "calls" column is its number of arrows and "files" the modules its names live in.
"""
import ast
import re
from pathlib import Path

import pytest

import recipes

ROOT = Path(__file__).resolve().parent.parent
MODULES = {p.stem: ast.parse(p.read_text()) for p in ROOT.glob("*.py")}
HOP = re.compile(r"`([^`]+)`\s*(->|~>)\s*(?=`)")


def definitions() -> dict[str, list[tuple[str, ast.AST]]]:
    """Every function and method by its qualified names: 'module.f', 'module.Class.m', 'Class.m', 'f'."""
    out: dict[str, list] = {}
    for mod, tree in MODULES.items():
        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                for name in (f"{mod}.{node.name}", node.name):
                    out.setdefault(name, []).append((mod, node))
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef):
                        for name in (f"{mod}.{node.name}.{item.name}", f"{node.name}.{item.name}", item.name):
                            out.setdefault(name, []).append((mod, item))
    return out


DEFS = definitions()


def resolve(name: str) -> tuple[str, ast.AST]:
    found = DEFS.get(name, [])
    if len(found) != 1:
        raise AssertionError(f"`{name}`: {'no' if not found else len(found)} definitions in the project's modules"
                             + ("" if not found else f" ({sorted({m for m, _ in found})}): qualify it"))
    return found[0]


def names_in(node: ast.AST, called: bool) -> set[str]:
    """The names a function calls (called) or mentions without calling (not called)."""
    calls, seen, funcs = set(), set(), set()
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            funcs.add(id(n.func))
            calls.add(n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", None))
    for n in ast.walk(node):
        if isinstance(n, (ast.Attribute, ast.Name)) and id(n) not in funcs:
            seen.add(n.attr if isinstance(n, ast.Attribute) else n.id)
    return calls if called else seen


def check_path(path: str) -> tuple[int, set[str]]:
    """Checks every hop of a path; returns (arrows, modules)."""
    tokens = re.findall(r"`([^`]+)`|(->|~>)", path)
    names = [t for t, arrow in tokens if t]
    arrows = [arrow for t, arrow in tokens if arrow]
    if len(names) != len(arrows) + 1:
        raise AssertionError(f"{path!r}: expected `name` -> `name` ..., got {len(names)} names and {len(arrows)} arrows")
    modules = set()
    for i, (caller, arrow, callee) in enumerate(zip(names, arrows, names[1:])):
        caller = caller.split("=")[-1]
        mod, node = resolve(caller)
        modules.add(mod)
        called_as, _, target = callee.partition("=")
        if target:                                   # a call named `called_as` that runs `target` (a Recipe field)
            fn = resolve(target)[1].name
            assert any(getattr(r, called_as).__name__ == fn for r in recipes.RECIPES.values()), \
                f"no recipe's {called_as} is {target}"
        else:
            resolve(callee)
        want = called_as.split(".")[-1]
        assert want in names_in(node, called=arrow == "->"), \
            f"`{caller}` does not {'call' if arrow == '->' else 'hand on'} `{want}` ({path})"
    modules.add(resolve(names[-1].split("=")[-1])[0])
    return len(arrows), modules


def table_rows() -> list[tuple[str, str, int, int]]:
    text = (ROOT / "docs" / "method.md").read_text()
    section = text.split("## Where each equation lives", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[2].isdigit():
            rows.append((cells[0], cells[1], int(cells[2]), int(cells[3])))
    return rows


ROWS = table_rows()


def test_the_table_has_its_rows():
    assert len(ROWS) >= 14, [r[0] for r in ROWS]


@pytest.mark.parametrize("piece, path, calls, files", ROWS, ids=[r[0] for r in ROWS])
def test_each_row_is_a_path_in_the_code(piece, path, calls, files):
    arrows, modules = check_path(path)
    assert (arrows, len(modules)) == (calls, files), f"{piece}: {arrows} calls in {sorted(modules)}, table says " \
                                                     f"{calls} calls, {files} files"


@pytest.mark.parametrize("path, why", [
    ("`grpo.policy_update` -> `grpo.kl_penalty`", "does not call"),                    # a hop skipped
    ("`grpo.grpo_loss` -> `grpo.no_such_function`", "no definitions"),                # a renamed function
    ("`grpo.collect_groups` -> `score=rewards.vtgr_reward`", "no recipe's score"),    # a field that runs another
    ("`sft.run_sft` ~> `sft.sft_backward`", "does not hand on"),                       # called, not handed on
])
def test_a_broken_row_fails(path, why):
    with pytest.raises(AssertionError, match=why):
        check_path(path)


def imports() -> dict[str, set[str]]:
    """Each project module's imports of project modules, at any depth of its code (lazy imports included)."""
    out = {}
    for mod, tree in MODULES.items():
        deps = set()
        for n in ast.walk(tree):
            if isinstance(n, ast.Import):
                deps |= {a.name for a in n.names}
            elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
                deps.add(n.module)
        out[mod] = {d for d in deps if d in MODULES and d != mod}
    return out


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph`, or None (depth-first, each module's stack)."""
    state = {}

    def visit(m, path):
        state[m] = "open"
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                return path[path.index(d):] + [d] if d in path else [m, d]
            if d not in state and (found := visit(d, path + [d])):
                return found
        state[m] = "done"
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m, [m])):
            return found
    return None


def test_no_import_cycle():
    """The modules form layers: no module imports (even lazily) one that imports it back."""
    assert cycle(imports()) is None, " -> ".join(cycle(imports()))
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]     # the check can fail


HISTORY = re.compile(r"since removed|issue [0-9]|defect [0-9]|2026-|Before,")


def test_modules_do_not_narrate_history():
    """Docstrings and comments state the formula, the shapes and the source; measurements and history live in docs/."""
    hits = [f"{p.name}:{i}: {line.strip()}" for p in sorted(ROOT.glob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if HISTORY.search(line)]
    assert not hits, "\n".join(hits)
    assert HISTORY.search("# measured 2026-12-01, since removed")          # the pattern finds what it names


def longer_docstrings(tree: ast.AST, lines: list[str]) -> list[str]:
    """Functions whose docstring has more lines than their code (blank and comment-only lines not counted)."""
    out = []
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(n) is not None and n.body[1:]:
            doc = n.body[0].end_lineno - n.body[0].lineno + 1
            code = sum(1 for i in range(n.body[1].lineno, n.end_lineno + 1)
                       if lines[i - 1].strip() and not lines[i - 1].strip().startswith("#"))
            if doc > code:
                out.append(n.name)
    return out


def test_few_docstrings_are_longer_than_their_code():
    """At most 15 (a formula on a one-line reward is the point; prose on the reading path is not)."""
    longer = [f"{mod}.{name}" for mod, tree in MODULES.items()
              for name in longer_docstrings(tree, (ROOT / f"{mod}.py").read_text().splitlines())]
    assert len(longer) <= 15, longer
    planted = 'def f(x):\n    """One.\n    Two."""\n    return x\n'
    assert longer_docstrings(ast.parse(planted), planted.splitlines()) == ["f"]


def test_no_module_over_950_lines():
    sizes = {p.name: len(p.read_text().splitlines()) for p in ROOT.glob("*.py")}
    assert max(sizes.values()) <= 950, sorted(sizes.items(), key=lambda kv: -kv[1])[:3]
