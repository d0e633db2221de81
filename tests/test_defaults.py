"""One home per default: recipes.py sets every setting of a run, and no product module restates one.

`literal_defaults` reads a module's source and names each function parameter (lambdas included) and dataclass field
whose name is a setting and whose default is a literal: a number, string or bool, constant arithmetic on them
(`32 * 32`), or a tuple of them. None is allowed: it means "not set" (the caller passes the setting). A setting is a
key of recipes.PRESETS (each preset's keys, COMMON, the recipes' settings), of recipes.TINY_FRAMES, or a parameter
name in ALIASES. The product modules are the repo root's *.py but recipes.py, the home; tests/ and bench/ are not
product code. A hit prints as `file:line name=value`."""
import ast
from pathlib import Path

import recipes

ROOT = Path(__file__).resolve().parent.parent

# Parameter names that stand for a setting (or for a constant with a home of its own) under another name.
ALIASES = {
    "behav_cap": "behav_weight_cap",
    "budget_fraction": "sft_budget_fraction",
    "tool_free": "sft_tool_free",
    "batch_size": "eval_batch",
    "estimator": "kl_estimator",
    "choices": "gating_choices",
    "fps": "overview_fps, crop_fps, subagent_fps",
    "max_frames": "overview_max_frames, crop_max_frames, subagent_max_frames",
    "anchor_weight": "rewards.ANCHOR_WEIGHT",
    "compile": "the device's (--compile: on on CUDA, off on CPU)",
    "precision": "the device's (--precision: bf16 on CUDA, fp32 on CPU)",
}
SETTINGS = (set(recipes.COMMON) | set(recipes.TINY_FRAMES) | set(recipes.TINY) | set(ALIASES)
            | {key for preset in recipes.PRESETS for key in recipes.preset_values(preset)})


def _literal(node: ast.expr) -> bool:
    """A number, string or bool, constant arithmetic on them, or a tuple of them; None is not one."""
    if isinstance(node, ast.Constant):
        return node.value is not None and node.value is not Ellipsis
    if isinstance(node, ast.UnaryOp):
        return _literal(node.operand)
    if isinstance(node, ast.BinOp):
        return _literal(node.left) and _literal(node.right)
    if isinstance(node, ast.Tuple):
        return all(_literal(e) for e in node.elts)
    return False


def _is_dataclass(cls: ast.ClassDef) -> bool:
    for d in cls.decorator_list:
        d = d.func if isinstance(d, ast.Call) else d
        if (d.id if isinstance(d, ast.Name) else getattr(d, "attr", None)) == "dataclass":
            return True
    return False


def _field_default(value: ast.expr) -> ast.expr | None:
    """A dataclass field's default: the value, or field(default=...)'s."""
    if isinstance(value, ast.Call):
        name = value.func.id if isinstance(value.func, ast.Name) else getattr(value.func, "attr", None)
        if name == "field":
            return next((k.value for k in value.keywords if k.arg == "default"), None)
    return value


def literal_defaults(source: str, names: set, filename: str) -> list[str]:
    """`file:line name=value` of each parameter or dataclass field of `source` named in `names` whose default is a
    literal (`_literal`), in source order."""
    hits = []
    for node in ast.walk(ast.parse(source)):
        pairs = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            positional = a.posonlyargs + a.args
            pairs = list(zip(positional[len(positional) - len(a.defaults):], a.defaults))
            pairs += [(arg, d) for arg, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
            pairs = [(arg.arg, d) for arg, d in pairs]
        elif isinstance(node, ast.ClassDef) and _is_dataclass(node):
            pairs = [(s.target.id, _field_default(s.value)) for s in node.body
                     if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name) and s.value is not None]
        hits += [(d.lineno, d.col_offset, f"{filename}:{d.lineno} {name}={ast.unparse(d)}")
                 for name, d in pairs if d is not None and name in names and _literal(d)]
    return [h for *_, h in sorted(hits)]


def test_no_product_module_restates_a_default():
    """Every setting's default lives in recipes.py: a library signature takes it (no default, or None), and the
    settings dataclasses read recipes.TINY."""
    hits = [h for path in sorted(ROOT.glob("*.py")) if path.name != "recipes.py"
            for h in literal_defaults(path.read_text(encoding="utf-8"), SETTINGS, path.name)]
    print("\n".join(hits))
    assert not hits, ("a setting's default restated outside recipes.py (take it from the caller, or None):\n"
                      + "\n".join(hits))


def test_the_checker_finds_a_planted_default():
    """The checker on a planted module: literals for settings and aliases are found (a positional, a keyword-only,
    a tuple, constant arithmetic, a dataclass field, field(default=...), a lambda's); None, names that are no
    setting, and values read from recipes are not."""
    planted = (
        "import dataclasses\n"
        "def step(x, crop_fps=2.0, seed=0, *, behav_cap=5.0, fps=None, gating_choices=(4, 8), top_p=-1.0):\n"
        "    return lambda group_size=16, chunk_size=1024: x\n"
        "@dataclasses.dataclass(frozen=True)\n"
        "class Settings:\n"
        "    lr: float = 1e-4\n"
        "    group_size: int = T['group_size']\n"
        "    subagent_max_pixels: int = dataclasses.field(default=224 * 224)\n"
        "    compile: bool = True\n"
        "    name: str = 'x'\n"
        "class NotADataclass:\n"
        "    lr: float = 1e-4\n")
    assert literal_defaults(planted, SETTINGS, "planted.py") == [
        "planted.py:2 crop_fps=2.0", "planted.py:2 behav_cap=5.0", "planted.py:2 gating_choices=(4, 8)",
        "planted.py:2 top_p=-1.0", "planted.py:3 group_size=16", "planted.py:6 lr=0.0001",
        "planted.py:8 subagent_max_pixels=224 * 224", "planted.py:9 compile=True"]
    assert "chunk_size" not in SETTINGS and {"crop_fps", "n_eval", "save_every", "max_grad_norm"} <= SETTINGS
