"""The package's shape and the packaging facts: import layers, docstrings for readers, version floors."""

import ast
import importlib
import inspect
import re
import subprocess
from pathlib import Path

import pytest

import helpers

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "helpers"
# A module is a file helpers/NAME.py or a subpackage helpers/NAME/ (its files are one module of the map).
SUBPACKAGES = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))
MODULES = sorted([p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"] + SUBPACKAGES)


def module_map() -> list[str]:
    """The modules in the order the map at the top of helpers/__init__.py lists them."""
    return re.findall(r"^- ``(\w+)``", helpers.__doc__, flags=re.M)


def module_files(module: str) -> list[Path]:
    """The source files of a module: helpers/NAME.py, or every .py file of the subpackage helpers/NAME/."""
    if module in SUBPACKAGES:
        return sorted((PACKAGE / module).glob("*.py"))
    return [PACKAGE / f"{module}.py"]


def imported_names(path: Path) -> set[str]:
    """Dotted names under ``helpers`` that a file imports (anywhere in it): ``"measure"``, ``"plan.setup"``.

    A relative import (``from .setup import x``) is reported from ``helpers`` too."""
    tree = ast.parse(path.read_text())
    here = path.relative_to(PACKAGE).with_suffix("").parts[:-1]  # the subpackage a file sits in, if any
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:  # from .setup import x / from . import setup
            base = here[: len(here) - node.level + 1]
            if node.module:
                found.add(".".join((*base, node.module)))
            else:
                found |= {".".join((*base, a.name)) for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module == "helpers":
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("helpers."):
            found.add(node.module.split(".", 1)[1])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".", 1)[1] for a in node.names if a.name.startswith("helpers.")}
    return found


def helper_imports(module: str) -> set[str]:
    """The other helpers modules that ``module`` imports (anywhere in its files)."""
    tops = {name.split(".")[0] for path in module_files(module) for name in imported_names(path)}
    return tops - {module}


def test_module_map_lists_every_module_once():
    assert sorted(module_map()) == MODULES


@pytest.mark.parametrize("module", MODULES)
def test_modules_import_only_modules_above_them_in_the_map(module):
    """No upward imports, hence no cycles: the map can be read from the top down."""
    order = module_map()
    above = set(order[: order.index(module)])
    assert helper_imports(module) <= above, f"{module} imports {helper_imports(module) - above} from below it"


def submodule_map(package: str) -> list[str]:
    """The submodules in the order the map in the subpackage's docstring lists them."""
    doc = importlib.import_module(f"helpers.{package}").__doc__ or ""
    return re.findall(r"^- ``(\w+)``", doc, flags=re.M)


@pytest.mark.parametrize("package", SUBPACKAGES)
def test_subpackage_map_lists_every_submodule_once(package):
    files = sorted(p.stem for p in (PACKAGE / package).glob("*.py") if p.stem != "__init__")
    assert sorted(submodule_map(package)) == files


@pytest.mark.parametrize("package", SUBPACKAGES)
def test_submodules_import_only_submodules_above_them(package):
    """Inside a subpackage the same rule: its map reads from the top down (``__init__`` gathers them all)."""
    order = submodule_map(package)
    for i, sub in enumerate(order):
        mine = {n.split(".")[1] for n in imported_names(PACKAGE / package / f"{sub}.py")
                if n.startswith(f"{package}.")}
        assert mine <= set(order[:i]), f"{package}.{sub} imports {mine - set(order[:i])} from below it"


@pytest.mark.parametrize("path", [p for pkg in SUBPACKAGES for p in sorted((PACKAGE / pkg).glob("*.py"))],
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_subpackage_files_say_what_they_hold(path):
    assert ast.get_docstring(ast.parse(path.read_text())), f"helpers/{path.parent.name}/{path.name} has no docstring"


def module_names(module: str) -> list[str]:
    """Importable names of a module's files: ``helpers.NAME``, or the subpackage and each of its submodules."""
    if module not in SUBPACKAGES:
        return [f"helpers.{module}"]
    return [f"helpers.{module}"] + [f"helpers.{module}.{p.stem}" for p in sorted((PACKAGE / module).glob("*.py"))
                                    if p.stem != "__init__"]


def public_objects():
    for mod in (importlib.import_module(n) for module in MODULES for n in module_names(module)):
        module = mod.__name__.removeprefix("helpers.")
        for name, obj in vars(mod).items():
            if name.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
                continue
            if inspect.isfunction(obj) or inspect.isclass(obj):
                yield f"{module}.{name}", obj


INTERNAL_WORDS = re.compile(r"the seeds|seeds'|BOOK_STANDARD|STYLE\.md|book standard", re.I)


@pytest.mark.parametrize(("name", "obj"), list(public_objects()), ids=lambda v: v if isinstance(v, str) else "")
def test_public_helpers_say_where_the_book_introduces_them(name, obj):
    doc = inspect.getdoc(obj) or ""
    assert doc, f"{name} has no docstring"
    assert re.search(r"Introduced in chapter \d+(, section \d+\.\d+|'s setup cell|'s last cell)|Not used in a chapter", doc), (
        f"{name}'s docstring does not name the chapter (and section) that introduces it")
    assert not INTERNAL_WORDS.search(doc), f"{name}'s docstring uses a word only the book's authors know"


@pytest.mark.parametrize("module", MODULES)
def test_module_docstrings_speak_to_readers(module):
    for path in module_files(module):
        text = path.read_text()
        assert not INTERNAL_WORDS.search(text), f"{path.relative_to(ROOT)} uses a word only the book's authors know"


def test_sections_named_in_docstrings_exist_in_the_chapters():
    import nbformat

    sections = set()
    for nb_path in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"):
        nb = nbformat.read(nb_path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "markdown":
                sections |= set(re.findall(r"^## (\d+\.\d+) ", cell.source, flags=re.M))
    for name, obj in public_objects():
        for chapter, section in re.findall(r"chapter (\d+), section (\d+\.\d+)", inspect.getdoc(obj) or ""):
            assert section.split(".")[0] == chapter and section in sections, f"{name}: no section {section}"


# --- packaging facts --------------------------------------------------------------------------------


def floor(requirement: str) -> tuple[int, ...]:
    found = re.search(r">=\s*([\d.]+)", requirement)
    assert found, requirement
    return tuple(int(x) for x in found.group(1).split("."))


def dependency(name: str) -> str:
    text = (ROOT / "pyproject.toml").read_text()  # (tomllib needs Python 3.11; the package supports 3.10)
    deps = re.search(r"^dependencies = \[(.*?)^\]", text, flags=re.M | re.S).group(1)
    return next(d for d in re.findall(r'"([^"]+)"', deps) if re.match(rf"{name}\b", d))


def test_torch_floor_has_the_public_fully_shard():
    """``from torch.distributed.fsdp import fully_shard`` (chapter 7's script) first works in torch 2.6
    (pytorch/pytorch#141868 moved FSDP2 there for 2.6); 2.4 had it only under ``_composable``."""
    assert "from torch.distributed.fsdp import fully_shard" in (ROOT / "notebooks/scripts/train_zero.py").read_text()
    assert floor(dependency("torch")) >= (2, 6)


def test_pandas_floor_has_dataframe_map():
    """The chapters call ``DataFrame.map`` (pandas 2.1; it was ``applymap`` before)."""
    assert floor(dependency("pandas")) >= (2, 1)


def test_environment_yml_installs_the_same_pins():
    text = (ROOT / "environment.yml").read_text()
    assert "-e .[book,dev]" in text and "torch" not in text.split("pip:")[1].replace(".[book,dev]", "")


def test_make_can_keep_an_installed_torch():
    """``make VENV_ARGS=--system-site-packages TORCH=torch`` lets the venv see the installed torch, which
    then satisfies ``pip install torch``; README says so."""
    dry = subprocess.run(["make", "-n", "-B", "VENV_ARGS=--system-site-packages", "TORCH=torch", "venv"],
                         cwd=ROOT, capture_output=True, text=True)
    if dry.returncode != 0 and "No rule" in dry.stderr:
        pytest.fail(dry.stderr)
    lines = dry.stdout.splitlines()
    assert any("-m venv --system-site-packages" in line for line in lines), dry.stdout
    assert any(re.search(r'pip install -q "?torch"?$', line) for line in lines), dry.stdout
    readme = (ROOT / "README.md").read_text()
    assert "VENV_ARGS=--system-site-packages TORCH=torch" in readme


def test_peft_floor_imports_with_transformers_5():
    """Colab preinstalls peft 0.17.x, which fails to import under transformers 5 (``HybridCache`` is gone); with a
    floor below 0.18 pip would keep it and every chapter that imports transformers' Trainer through peft breaks."""
    assert floor(dependency("peft")) >= (0, 18)
