"""The layout rules of docs/architecture.md, checked on the source.

- no import cycles between mmgrpo's modules (imports inside functions count too: a lazy import
  hides a cycle, it does not remove it);
- no module outside `mmgrpo/templates/` and the tiny-model builders names a model family or a
  model class in its code: what the fast paths, loading and LoRA need to know about a family,
  its template declares;
- at most eight modules at the top of the package, and none of them imported by only one
  package (a helper lives beside its only user);
- no `Rollout` is copied field by field outside mmgrpo/rollout/base.py: `Rollout.select` and
  `Rollout.concat` keep every field;
- one registry type: no module keeps a dict of registered names of its own;
- packages stand on floors and import only packages on lower floors (FLOORS below);
- below the run's assembly no function takes the whole TrainConfig or the assembly's `Run`: each
  part is handed its own typed section;
- no two module files share a name (`__init__.py` and `base.py` aside), and at most three
  functions run over 80 lines.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

from mmgrpo.config import TrainConfig

PACKAGE = Path(__file__).resolve().parents[1] / "mmgrpo"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported(path: Path, known: set[str]) -> set[str]:
    """mmgrpo modules a file imports, anywhere in it (a package import counts as its __init__)."""
    found = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def test_no_import_cycles():
    mods = modules()
    graph = {name: imported(path, set(mods)) - {name} for name, path in mods.items()}
    # a package's __init__ importing its own submodules is how a package re-exports: not a cycle
    # unless a submodule imports the package back for something it defines itself.
    cycles = []
    for name, deps in graph.items():
        for dep in deps:
            if name in graph.get(dep, ()) and name < dep:
                parent = dep.startswith(name + ".") or name.startswith(dep + ".")
                if not parent:
                    cycles.append((name, dep))
    # longer cycles: depth-first search for a path back to the start
    def reaches(start, target, seen):
        for dep in graph.get(start, ()):
            if dep == target:
                return [start, dep]
            if dep not in seen and not dep.startswith(target + ".") and not target.startswith(dep + "."):
                seen.add(dep)
                path = reaches(dep, target, seen)
                if path:
                    return [start, *path]
        return None

    long_cycles = []
    for name in graph:
        if "." in name and not name.endswith("__init__"):
            path = reaches(name, name, set())
            if path and not any(a.startswith(b + ".") or b.startswith(a + ".") for a, b in zip(path, path[1:])):
                long_cycles.append(" -> ".join(path))
    assert not cycles, f"import cycles: {cycles}"
    assert not long_cycles, "import cycles:\n" + "\n".join(sorted(set(long_cycles)))


FAMILY = re.compile(r"qwen|gemma|llava|omni|whisper", re.IGNORECASE)
# the templates, and the builders of test checkpoints: tiny ones, and real sizes with random weights
# and the default of --model (a value, not a branch on a family)
ALLOWED = ("mmgrpo/templates/", "mmgrpo/models/tiny", "mmgrpo/models/real_configs.py", "mmgrpo/config/schema.py")


def code_strings_and_names(path: Path):
    """(line, text) of every identifier and string constant that is not a docstring."""
    tree = ast.parse(path.read_text())
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = getattr(node, "body", [])
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.lineno, node.value
        elif isinstance(node, ast.Name):
            yield node.lineno, node.id
        elif isinstance(node, ast.Attribute):
            yield node.lineno, node.attr
        elif isinstance(node, ast.alias):
            yield getattr(node, "lineno", 0), node.name


def test_family_knowledge_stays_in_templates():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = str(path.relative_to(PACKAGE.parent))
        if relative.startswith(ALLOWED):
            continue
        for line, text in code_strings_and_names(path):
            # user-facing text (an f-string's pieces, an error message) may mention a family as an
            # example; a short string or identifier naming one is code that branches on a family
            if FAMILY.search(text) and len(text) < 40 and " " not in text:
                offenders.append(f"{relative}:{line}: {text!r}")
    assert not offenders, "family names outside mmgrpo/templates/:\n" + "\n".join(offenders)


TOP_LEVEL_LIMIT = 8


def test_few_top_level_modules_each_used_by_more_than_one_package():
    mods = modules()
    top = sorted(name for name, path in mods.items() if path.parent == PACKAGE and path.name != "__init__.py")
    assert len(top) <= TOP_LEVEL_LIMIT, f"{len(top)} top-level modules (at most {TOP_LEVEL_LIMIT}): {top}"
    users: dict[str, set[str]] = {name: set() for name in top}
    for name, path in mods.items():
        owner = name.split(".")[1] if name.count(".") >= 1 else name
        for dep in imported(path, set(mods)):
            if dep in users and dep != name:
                users[dep].add(owner if name.count(".") >= 2 or path.name == "__init__.py" else name)
    lonely = {name: sorted(who) for name, who in users.items()
              if len(who) == 1 and next(iter(who)) in {d.name for d in PACKAGE.iterdir() if d.is_dir()}}
    assert not lonely, f"top-level modules used by one package only (move them beside it): {lonely}"


ROLLOUT_FIELDS = {"completion_ids", "completion_mask", "truncated", "logps", "weight_version", "row_versions", "loss_mask",
                  "completion_media", "texts", "columns", "metrics", "totals", "rewards", "reward_per_func"}


def test_no_rollout_is_copied_field_by_field():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "rollout" / "base.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "Rollout"):
                continue
            copied = []
            for keyword in node.keywords:
                value = keyword.value.value if isinstance(keyword.value, ast.Subscript) else keyword.value
                if isinstance(value, ast.Attribute) and value.attr in ROLLOUT_FIELDS:
                    copied.append(keyword.arg)
            if len(copied) >= 2:
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {', '.join(copied)}")
    assert not offenders, "Rollout fields copied by hand (use Rollout.select / Rollout.concat):\n" + "\n".join(offenders)


def test_registries_are_the_one_registry_type():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.AnnAssign | ast.Assign):
                targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
                names = [t.id for t in targets if isinstance(t, ast.Name)]
                if any(re.fullmatch(r"_?(REGISTRY|[A-Z]+S)", n) for n in names) and isinstance(node.value, ast.Dict) \
                        and not node.value.keys and "register" in path.read_text():
                    offenders.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {names}")
    assert not offenders, "a registry of its own (use mmgrpo.registry.Registry):\n" + "\n".join(offenders)


# The floors of docs/architecture.md, bottom first. A package imports only packages on lower floors
# (imports inside functions count: a lazy import hides a dependency, it does not remove it).
FLOORS = [
    ("errors",),  # user-facing errors
    ("registry",),  # the one registry type and plugin loading
    ("hub",),  # the HF hub cache: where a hub id's files are
    ("runstate",),  # the ground floor of a run: checkpoint files, locks, TrainState, logs
    ("config",),  # every option: dataclasses, flags, the field-level checks
    ("processors",),  # media decoding
    ("templates",),  # one file per model family
    ("tools",),  # multi-turn tools
    ("data",),  # samples, the dataset catalogue, prompt batches
    ("grpo",),  # tensors in, tensors out
    ("fusion",),  # fusion modules and the hooks that feed them
    ("models",),  # loading, which weights train, saving, tiny checkpoints
    ("forward",),  # the policy's forwards
    ("parallel",),  # one process, FSDP2, ZeRO-3
    ("rollout",),  # engines, the rollout pipeline, rounds, vLLM
    ("rewards",),  # reward functions, reward models and the judge (which generates with a rollout engine)
    ("eval",),  # metrics, evaluation, reports, the reliance probe
    ("training",),  # the run's assembly: build_run, resume, the output folder, the optimizer
    ("engine", "sft"),  # the GRPO loop and step; SFT
    ("estimate", "viz", "demo"),  # commands
    ("cli",),
    ("__main__",),
]


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_packages_import_only_downwards():
    floor = {name: level for level, names in enumerate(FLOORS) for name in names}
    mods = modules()
    unplaced = sorted({package_of(m) for m in mods} - set(floor) - {"mmgrpo"})
    assert not unplaced, f"packages on no floor (add them to FLOORS and docs/architecture.md): {unplaced}"
    upward = []
    for name, path in mods.items():
        source = package_of(name)
        if source == "mmgrpo":  # the package's face (`from mmgrpo import train`): lazy re-exports
            continue
        for dep in imported(path, set(mods)):
            target = package_of(dep)
            if target in (source, "mmgrpo"):
                continue
            if floor[target] >= floor[source]:
                upward.append(f"{name} -> {dep} (floor {floor[source]} -> {floor[target]})")
    assert not upward, "imports that do not point down a floor:\n" + "\n".join(sorted(upward))


# The run's assembly and what stands above it may hold the whole configuration; config/ defines it.
ASSEMBLY_AND_ABOVE = ("training", "engine", "sft", "estimate", "cli", "__main__", "demo", "config", "viz")
SECTIONS = {"model", "data", "rollout", "algo", "optim", "eval", "dist"}
# and the run's own options at the top of TrainConfig (output_dir, seed, bf16, save_steps ...)
SECTIONS |= {f.name for f in dataclasses.fields(TrainConfig)} - {"model", "data", "rollout", "algo", "optim", "eval", "dist"}
WHOLE_CONFIG_TYPES = re.compile(r"\b(TrainConfig|SFTConfig|RunOptions|Run|ModelRun)\b")
# Deliberate exceptions: "module:function" -> why it takes the whole configuration.
WHOLE_CONFIG_EXCEPTIONS: dict[str, str] = {}


def _sections_read(node: ast.AST, name: str) -> set[str]:
    """The TrainConfig sections and run options read through `name` (`name.rollout`, `name.seed`) or
    `self.name` inside node: a part that reads them was handed the whole configuration."""
    read = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and sub.attr in SECTIONS:
            holder = sub.value
            if isinstance(holder, ast.Name) and holder.id == name:
                read.add(sub.attr)
            elif isinstance(holder, ast.Attribute) and holder.attr == name and isinstance(holder.value, ast.Name) \
                    and holder.value.id == "self":
                read.add(sub.attr)
    return read


def whole_config_takers(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):  # an object that keeps the config and reads several sections of it
            for attr in ("cfg", "config"):
                if _sections_read(node, attr):
                    found.append(f"{node.name}: self.{attr} reads {sorted(_sections_read(node, attr))}")
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        arguments = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
        for arg in arguments:
            annotation = ast.unparse(arg.annotation) if arg.annotation is not None else ""
            if annotation and WHOLE_CONFIG_TYPES.search(annotation):
                found.append(f"{node.name}({arg.arg}: {annotation})")
            elif not annotation and arg.arg == "run":
                found.append(f"{node.name}(run): an untyped run")
            elif arg.arg in ("cfg", "config") and _sections_read(node, arg.arg):
                found.append(f"{node.name}({arg.arg}) reads {sorted(_sections_read(node, arg.arg))}")
    return found


def test_below_the_assembly_each_part_takes_its_own_section():
    offenders = []
    for name, path in modules().items():
        if package_of(name) in ASSEMBLY_AND_ABOVE or package_of(name) == "mmgrpo":
            continue
        for what in whole_config_takers(path):
            key = f"{name}:{what.split('(')[0].split(':')[0]}"
            if key not in WHOLE_CONFIG_EXCEPTIONS:
                offenders.append(f"{path.relative_to(PACKAGE.parent)}: {what}")
    assert not offenders, "parts handed the whole configuration (hand them their typed section):\n" + "\n".join(offenders)


def test_no_two_modules_share_a_file_name():
    by_name: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name not in ("__init__.py", "base.py"):
            by_name.setdefault(path.name, []).append(str(path.relative_to(PACKAGE.parent)))
    shared = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not shared, f"module names used twice (name each for what it holds): {shared}"


LONG_FUNCTION = 80
LONG_FUNCTIONS_ALLOWED = 3


def test_few_long_functions():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > LONG_FUNCTION:
                    long.append(f"{path.relative_to(PACKAGE.parent)}:{node.name} ({lines} lines)")
    assert len(long) <= LONG_FUNCTIONS_ALLOWED, (
        f"{len(long)} functions over {LONG_FUNCTION} lines (at most {LONG_FUNCTIONS_ALLOWED}):\n" + "\n".join(long))
