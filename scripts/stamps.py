#!/usr/bin/env python3
"""Content-aware execution stamps: what a chapter's committed outputs depend on, as hashes.

A chapter's outputs depend on its code cells, on the ``helpers`` code it reaches and on the launched scripts
(``notebooks/scripts/``) it names. The stamp (notebook metadata ``gpubook.execution``, written by
scripts/execute_notebooks.py and refreshed by ``scripts/gpu_check.py --restamp``) records a sha256 for each
of them, and the hygiene check (scripts/check_notebooks.py) compares them with today's sources:

- **Code cells**, keyed by nbformat cell id (moving a cell changes nothing; adding or removing a code cell
  does), each hashed after a *full-profile projection*: ``prof.pick(tiny=a, full=b)`` is rewritten to ``b``,
  so an edit to a tiny-profile value only (CPU CI's sizes) does not touch the hash. Comments, docstrings of
  functions and classes defined in the cell, and blank lines do not count; IPython magics do (as text).
- **helpers units**, keyed ``module.name`` (``measure.peak``, ``plan.core.predict``) and ``module`` for the
  module's other top-level code (imports of other helpers modules run it): each top-level function, class,
  assignment and imported name of a helpers module, hashed as its AST without docstrings (comments are not in
  the AST). Only the units the chapter *reaches* are recorded: the names its cells use from helpers,
  transitively through the names those units use, statically (``timing.time_it`` reaches ``timing.Timed``
  because its body names it). A module used other than by attribute (passed around, ``globals()`` inside it)
  counts whole. So a new function, a new module, a docstring or a comment changes no chapter's stamp, and
  an edit to a function only chapter 9 calls makes only chapter 9 stale. ``helpers/x.py`` and the package
  ``helpers/x/`` (``__init__.py`` keyed ``x.__init__``, submodules ``x.sub``) are both handled.
- **Launched scripts**: a file of ``notebooks/scripts/`` whose name appears in a string of a code cell, hashed
  byte for byte (a chapter may show a script's source), and the helpers units it reaches.
- **Shown helpers**: a unit or module a chapter passes to ``inspect.getsource``/``getdoc``/``help`` or
  reads ``__doc__`` of, also as written (key ``module.name#source``): its docstring is then an output.
- **Data files** inside helpers/ (anything but ``.py``), byte for byte, keyed by path (``plan/gpus.json``), for
  every chapter that imports their package.

The AST is serialised by this module (node type and non-empty fields), not by ``ast.dump``, whose output
changes between Python versions: a stamp written by the GPU machine's Python compares equal on CI's.

Only the standard library is used.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORMAT = 2
UNVERIFIED = "unverified"  # a hash the migration could not establish: always differs, so always reported
DYNAMIC = {"globals", "eval", "exec", "__import__"}  # in a helpers module: its names looked up at run time
SHOWN = {"getsource", "getsourcelines", "getdoc", "getcomments", "help"}  # they show a unit's text
MAGIC = re.compile(r"^(\s*)([%!].*)$")
MODULE_STRING = re.compile(r"^helpers(?:\.\w+)+$")
DASH_M = re.compile(r"-m\s+(helpers(?:\.\w+)*)")


def sha256(text: str | bytes) -> str:
    return hashlib.sha256(text.encode("utf-8") if isinstance(text, str) else text).hexdigest()


# ---------------------------------------------------------------------------------------------------------------
# Canonical text of an AST: stable across Python versions, blind to docstrings and comments.

def canon(node) -> str:
    """A version-stable serialisation of an AST: node type and its non-empty fields, positions left out.

    Keyword arguments are sorted by name (``**kwargs`` last, in their order).
    """
    if isinstance(node, ast.AST):
        parts = []
        for name in node._fields:
            value = getattr(node, name, None)
            if isinstance(node, ast.Call) and name == "keywords":  # f(a=1, b=2) is f(b=2, a=1)
                value = sorted(value, key=lambda k: (k.arg is None, k.arg or ""))
            if value is None or (isinstance(value, list) and not value) or name in ("type_comment", "kind"):
                continue
            parts.append(f"{name}={canon(value)}")
        return f"{type(node).__name__}({', '.join(parts)})"
    if isinstance(node, list):
        return "[" + ", ".join(canon(v) for v in node) + "]"
    return repr(node)


def _is_string_statement(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)


class _StripDocstrings(ast.NodeTransformer):
    """Drop string statements (docstrings, no-op strings) from every body; a module's own only when told.

    A notebook cell's last top-level expression is displayed, so a cell's top level keeps its strings.
    """

    def __init__(self, module_level: bool):
        self.module_level = module_level

    def generic_visit(self, node):
        super().generic_visit(node)
        if isinstance(node, ast.Module) and not self.module_level:
            return node
        for name in ("body", "orelse", "finalbody"):
            value = getattr(node, name, None)
            if isinstance(value, list) and value and all(isinstance(s, ast.stmt) for s in value):
                kept = [s for s in value if not _is_string_statement(s)]
                setattr(node, name, kept or ([ast.Pass()] if name == "body" else []))
        return node


class _FullProfile(ast.NodeTransformer):
    """``x.pick(tiny=a, full=b)`` -> ``b``: the value the GPU run (full profile) uses."""

    def visit_Call(self, node: ast.Call):
        if isinstance(node.func, ast.Attribute) and node.func.attr == "pick":
            full = [k.value for k in node.keywords if k.arg == "full"]
            if len(full) == 1 and all(k.arg in ("tiny", "full") for k in node.keywords) and not node.args:
                return self.visit(full[0])
        return self.generic_visit(node)


def _magics_as_calls(source: str) -> str:
    """IPython line magics and shell escapes (``%pip ...``, ``!git ...``) as calls, so the cell parses."""
    return "\n".join(f"{m.group(1)}__magic__({m.group(2)!r})" if (m := MAGIC.match(line)) else line
                     for line in source.splitlines())


def parse_cell(source: str) -> ast.Module | None:
    """A code cell's AST in its full-profile projection, or None when it does not parse (a cell magic)."""
    try:
        tree = ast.parse(_magics_as_calls(source))
    except SyntaxError:
        return None
    return _FullProfile().visit(_StripDocstrings(module_level=False).visit(tree))


def cell_hash(source: str) -> str:
    """sha256 of a code cell's full-profile projection, docstrings and comments left out."""
    tree = parse_cell(source)
    if tree is None:
        return sha256("unparsed\n" + "\n".join(line.rstrip() for line in source.strip().splitlines()))
    return sha256(canon(tree))


def cell_key(cell: dict, index: int) -> str:
    """A cell's id (nbformat 4.5), or its position among the code cells when it has none."""
    return cell.get("id") or f"code-{index}"


def code_cells(nb: dict) -> list[tuple[str, str]]:
    """(key, source) of each code cell, in order."""
    cells = [c for c in nb.get("cells", []) if c.get("cell_type") == "code"]
    return [(cell_key(c, i), "".join(c.get("source", ""))) for i, c in enumerate(cells, start=1)]


# ---------------------------------------------------------------------------------------------------------------
# The helpers package as units.

@dataclass
class Module:
    key: str                      # "measure", "plan.__init__", "plan.core", "__init__"
    dotted: str                   # "helpers.measure", "helpers.plan", "helpers.plan.core", "helpers"
    is_package: bool
    path: str = ""                # inside helpers/: "measure.py", "plan/__init__.py"
    units: dict[str, list[ast.stmt]] = field(default_factory=dict)
    body: list[ast.stmt] = field(default_factory=list)
    body_names: set[str] = field(default_factory=set)
    body_imports: dict[str, tuple] = field(default_factory=dict)  # name bound by an import inside try/if
    parsed: bool = True
    text: str = ""                # the source as written (for a unit the chapter shows: inspect.getsource)


def _bound_names(stmt: ast.stmt) -> list[str] | None:
    """The names a simple top-level statement binds, or None when it is not one unit's definition."""
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [stmt.name]
    targets = (stmt.targets if isinstance(stmt, ast.Assign)
               else [stmt.target] if isinstance(stmt, (ast.AnnAssign, ast.AugAssign)) else None)
    if targets is None:
        return None
    names = []
    for target in targets:
        elts = target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]
        if not all(isinstance(e, ast.Name) for e in elts):
            return None
        names.extend(e.id for e in elts)
    return names


class Package:
    """The helpers package's modules, split into units, and what a chapter reaches in it."""

    def __init__(self, files: dict[str, str]):
        """``files``: path inside helpers/ (``measure.py``, ``plan/core.py``) -> source text."""
        self.modules: dict[str, Module] = {}
        self.by_dotted: dict[str, Module] = {}
        for path, text in sorted(files.items()):
            if not path.endswith(".py"):
                continue
            parts = path[:-3].split("/")
            is_package = parts[-1] == "__init__"
            dotted = ".".join(["helpers", *(parts[:-1] if is_package else parts)])
            module = Module(".".join(parts), dotted, is_package, path)
            self._split(module, text)
            self.modules[module.key] = module
            self.by_dotted[dotted] = module
        self._hashes: dict[str, str] = {}

    def _split(self, module: Module, text: str) -> None:
        module.text = text
        try:
            tree = _FullProfile().visit(_StripDocstrings(module_level=True).visit(ast.parse(text)))
        except SyntaxError:
            module.parsed = False
            module.body = [ast.Expr(ast.Constant(text))]
            return
        for stmt in tree.body:
            if isinstance(stmt, (ast.Import, ast.ImportFrom)) and not (
                    isinstance(stmt, ast.ImportFrom) and stmt.module == "__future__") and \
                    not any(a.name == "*" for a in stmt.names):
                for alias in stmt.names:  # one unit per bound name: adding a name to an import changes no other
                    single = (ast.Import(names=[alias]) if isinstance(stmt, ast.Import)
                              else ast.ImportFrom(module=stmt.module, names=[alias], level=stmt.level))
                    name = alias.asname or (alias.name.split(".")[0] if isinstance(stmt, ast.Import) else alias.name)
                    module.units.setdefault(name, []).append(single)
                continue
            names = _bound_names(stmt)
            if names is None:
                module.body.append(stmt)
                for node in ast.walk(stmt):
                    if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                        module.body_names.add(node.id)
                    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        module.body_names.add(node.name)
                    elif isinstance(node, (ast.Import, ast.ImportFrom)):
                        for alias in node.names:
                            bound = alias.asname or (alias.name.split(".")[0] if isinstance(node, ast.Import)
                                                     else alias.name)
                            module.body_names.add(bound)
                            module.body_imports[bound] = (node, alias)
            else:
                for name in names:
                    module.units.setdefault(name, []).append(stmt)

    def file_of(self, key: str) -> str:
        """The file inside helpers/ that holds a unit or module key."""
        module_key = key if key in self.modules else key.rsplit(".", 1)[0]
        module = self.modules.get(module_key)
        return module.path if module is not None else key  # a data file's key is its path

    # -- hashes -------------------------------------------------------------------------------------------------
    def source_hash(self, key: str) -> str:
        """sha256 of a unit's or module's source as written, docstrings and comments included."""
        if key in self.modules:
            return sha256(self.modules[key].text)
        module_key, name = key.rsplit(".", 1)
        module = self.modules[module_key]
        lines = module.text.splitlines()
        spans = []
        for stmt in module.units[name]:  # whole lines, decorators included, as inspect.getsource shows them
            if getattr(stmt, "end_lineno", None) is None:  # one name of an import statement
                spans.append(canon(stmt))
                continue
            first = min([stmt.lineno, *(d.lineno for d in getattr(stmt, "decorator_list", []))])
            spans.append("\n".join(lines[first - 1:stmt.end_lineno]))
        return sha256("\n".join(spans))

    def unit_hash(self, key: str) -> str:
        """sha256 of a unit (``module.name``) or of a module's other top-level code (``module``)."""
        if key not in self._hashes:
            if key in self.modules:
                statements = self.modules[key].body
            else:
                module_key, name = key.rsplit(".", 1)
                statements = self.modules[module_key].units[name]
            self._hashes[key] = sha256("\n".join(canon(s) for s in statements))
        return self._hashes[key]

    # -- imports ------------------------------------------------------------------------------------------------
    def resolve_import(self, module: Module | None, node: ast.ImportFrom) -> str | None:
        """The absolute module named by an ``ImportFrom`` (relative ones resolved inside helpers)."""
        if not node.level:
            return node.module
        if module is None:
            return None
        package = module.dotted if module.is_package else module.dotted.rsplit(".", 1)[0]
        for _ in range(node.level - 1):
            package = package.rsplit(".", 1)[0]
        return f"{package}.{node.module}" if node.module else package


def _single(node: ast.Import | ast.ImportFrom, alias: ast.alias) -> ast.Import | ast.ImportFrom:
    """The import statement of one of a statement's names."""
    if isinstance(node, ast.Import):
        return ast.Import(names=[alias])
    return ast.ImportFrom(module=node.module, names=[alias], level=node.level)


def _bound(node: ast.Import | ast.ImportFrom, alias: ast.alias) -> str:
    return alias.asname or (alias.name.split(".")[0] if isinstance(node, ast.Import) else alias.name)


def _is_helpers(dotted: str | None) -> bool:
    return bool(dotted) and (dotted == "helpers" or dotted.startswith("helpers."))


class Reach:
    """The units a set of code roots reaches in a Package (the walk behind ``fingerprint``).

    A target is ``("mod", Module)`` (a helpers module as a value), ``("unit", Module, name)`` or None
    (anything else: a local variable, torch, a builtin).
    """

    def __init__(self, package: Package):
        self.package = package
        self.reached: set[str] = set()
        self.shown: set[str] = set()  # units or modules whose source text a chapter shows (getsource, __doc__)
        self._pending: list[tuple[list[ast.AST], Module | None]] = []

    def import_module(self, dotted: str) -> Module | None:
        """Import a helpers module: its parents' and its own top-level code run (and what they import)."""
        parts = dotted.split(".")
        found = None
        for i in range(1, len(parts) + 1):
            module = self.package.by_dotted.get(".".join(parts[:i]))
            if module is None:
                return None
            found = module
            self._run_module(module)
        return found

    def _run_module(self, module: Module) -> None:
        if module.key in self.reached:
            return
        self.reached.add(module.key)
        if not module.parsed:
            self.everything(module)
            return
        self._visit(module.body, module)
        for statements in list(module.units.values()):  # its top-level imports of helpers modules run too
            for stmt in statements:
                if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                    self._import_side_effects(stmt, module)

    def _import_side_effects(self, stmt: ast.Import | ast.ImportFrom, module: Module | None) -> None:
        if isinstance(stmt, ast.Import):
            for alias in stmt.names:
                if _is_helpers(alias.name):
                    self.import_module(alias.name)
            return
        base = self.package.resolve_import(module, stmt)
        if not _is_helpers(base):
            return
        parent = self.import_module(base)
        for alias in stmt.names:
            if alias.name == "*":
                if parent is not None:
                    self.everything(parent)
            elif f"{base}.{alias.name}" in self.package.by_dotted:
                self.import_module(f"{base}.{alias.name}")

    def everything(self, module: Module) -> None:
        """A module used whole (passed around, dynamic lookups): all its units count."""
        self._run_module(module)
        for name in list(module.units):
            self.unit(module, name)

    def unit(self, module: Module, name: str):
        """Reach one unit; return its target (what an imported name names, else the unit)."""
        key = f"{module.key}.{name}"
        statements = module.units[name]
        if key not in self.reached:
            self.reached.add(key)
            self._visit(statements, module)
        if all(isinstance(s, (ast.Import, ast.ImportFrom)) for s in statements):
            return self._import_target(statements[-1], module)
        return ("unit", module, name)

    def _import_target(self, stmt: ast.Import | ast.ImportFrom, module: Module | None):
        """What the (single-name) import statement binds, when it is in helpers."""
        alias = stmt.names[0]
        if isinstance(stmt, ast.Import):
            if not _is_helpers(alias.name):
                return None
            self.import_module(alias.name)
            target = self.package.by_dotted.get(alias.name if alias.asname else "helpers")
            return ("mod", target) if target else None
        base = self.package.resolve_import(module, stmt)
        if not _is_helpers(base) or alias.name == "*":
            return None
        parent = self.import_module(base)
        return self.attribute(("mod", parent), alias.name) if parent is not None else None

    def attribute(self, target, attr: str):
        """``target.attr`` for a helpers module target: a submodule, a unit, or (unknown) the whole module."""
        if target is None or target[0] != "mod":
            return None
        module = target[1]
        sub = self.package.by_dotted.get(f"{module.dotted}.{attr}")
        if sub is not None:
            self.import_module(sub.dotted)
            return ("mod", sub)
        if attr in module.units:
            return self.unit(module, attr)
        if attr in module.body_imports:
            return self._import_target(_single(*module.body_imports[attr]), module)
        if attr in module.body_names or (attr.startswith("__") and attr.endswith("__")):
            return None  # bound by the module's other top-level code, which runs on import anyway
        self.everything(module)  # an attribute this analysis cannot place: count the whole module
        return None

    def _bindings(self, statements: Iterable[ast.AST], module: Module | None) -> dict:
        """Names bound by the helpers imports anywhere in ``statements`` (a function's local imports too)."""
        bindings = {}
        for stmt in statements:
            for node in ast.walk(stmt):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    for alias in node.names:
                        if alias.name != "*":
                            target = self._import_target(_single(node, alias), module)
                            if target is not None:
                                bindings[_bound(node, alias)] = target
        return bindings

    def resolve(self, name: str, module: Module | None, bindings: dict):
        """A bare name: a local helpers import, else (in helpers) a unit or a name bound on import."""
        target = bindings.get(name)
        if module is not None:
            if name in module.units:
                unit = self.unit(module, name)
                target = target or unit
            elif name in module.body_imports and target is None:
                target = self._import_target(_single(*module.body_imports[name]), module)
            elif name in DYNAMIC:
                self.everything(module)
        return target

    def _visit(self, statements: list[ast.AST], module: Module | None) -> None:
        """Queue code to read (a worklist, not recursion: a long call chain cannot exhaust the stack)."""
        self._pending.append((statements, module))

    def _drain(self) -> None:
        while self._pending:
            statements, module = self._pending.pop()
            bindings = self._bindings(statements, module)
            for stmt in statements:
                self._refs(stmt, module, bindings)

    def _target(self, node: ast.AST, module: Module | None, bindings: dict, whole: bool = True):
        """What a name or attribute chain names in helpers (reached on the way); ``whole``: a module named
        as a value counts whole."""
        chain, base = [], node
        while isinstance(base, ast.Attribute):
            chain.append(base.attr)
            base = base.value
        if not isinstance(base, ast.Name):
            self._refs(base, module, bindings)
            return None
        target = self.resolve(base.id, module, bindings)
        for attr in reversed(chain):
            if target is not None and target[0] == "unit" and attr == "__doc__":
                self.shown.add(f"{target[1].key}.{target[2]}")
            if target is None or target[0] != "mod":
                return None
            if attr == "__doc__":
                self.shown.add(target[1].key)
            target = self.attribute(target, attr)
        if whole and target is not None and target[0] == "mod":
            self.everything(target[1])
        return target

    def _refs(self, node: ast.AST, module: Module | None, bindings: dict) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            self._import_side_effects(node, module)
            return
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], (ast.Name, ast.Attribute)) and (
                getattr(node.func, "id", None) in SHOWN or getattr(node.func, "attr", None) in SHOWN):
            target = self._target(node.args[0], module, bindings)  # inspect.getsource(x), help(x): x's text
            if target is not None:
                self.shown.add(target[1].key if target[0] == "mod" else f"{target[1].key}.{target[2]}")
            for child in [node.func, *node.args[1:], *node.keywords]:
                self._refs(child, module, bindings)
            return
        if isinstance(node, ast.Attribute):
            self._target(node, module, bindings)
            return
        if isinstance(node, ast.Name):
            if isinstance(node.ctx, ast.Load):
                target = self.resolve(node.id, module, bindings)
                if target is not None and target[0] == "mod":
                    self.everything(target[1])  # a module used as a value: any of its functions may run
            return
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            self._strings(node.value, root=module is None)
            return
        for child in ast.iter_child_nodes(node):
            self._refs(child, module, bindings)

    def _strings(self, text: str, root: bool) -> None:
        """``"helpers.x"`` (importlib) and, in a chapter or script, ``-m helpers.x`` (a subprocess): whole."""
        names = [text] if MODULE_STRING.match(text) else DASH_M.findall(text) if root else []
        for dotted in names:
            for name in (dotted, f"{dotted}.__main__"):  # ``python -m package`` runs its __main__
                module = self.import_module(name)
                if module is not None:
                    self.everything(module)

    def root(self, tree: ast.Module | None) -> None:
        """A chapter's cells (or a launched script) as one namespace whose helpers imports bind names."""
        if tree is None:  # code this analysis cannot read: everything it could use counts
            for module in list(self.package.modules.values()):
                self.everything(module)
        else:
            self._visit([tree], None)
        self._drain()


# ---------------------------------------------------------------------------------------------------------------
# Sources: the working tree or a commit.

class Sources:
    """helpers/ (recursively, .py files) and the launched scripts, from a folder or a git commit."""

    def __init__(self, helpers: dict[str, str], scripts: dict[str, bytes], data: dict[str, bytes] | None = None):
        """``data``: helpers' other files (a table a module reads), by path inside helpers/."""
        self.helpers_files = helpers
        self.scripts = scripts
        self.data = data or {}
        self.package = Package(helpers)

    @classmethod
    def from_dirs(cls, helpers: Path, scripts: Path | None) -> Sources:
        every = [p for p in sorted(helpers.rglob("*")) if p.is_file() and "__pycache__" not in p.parts
                 and p.suffix != ".pyc"]
        files = {p.relative_to(helpers).as_posix(): p.read_text(encoding="utf-8") for p in every if p.suffix == ".py"}
        data = {p.relative_to(helpers).as_posix(): p.read_bytes() for p in every if p.suffix != ".py"}
        found = ({p.name: p.read_bytes() for p in sorted(scripts.iterdir()) if p.is_file()}
                 if scripts is not None and scripts.is_dir() else {})
        return cls(files, found, data)

    @classmethod
    def from_git(cls, root: Path, commit: str, scripts: str = "notebooks/scripts") -> Sources:
        listing = git(root, "ls-tree", "-r", "--name-only", commit, "--", "helpers", scripts).splitlines()
        helpers = {p[len("helpers/"):]: git_show(root, commit, p).decode("utf-8")
                   for p in listing if p.startswith("helpers/") and p.endswith(".py")}
        data = {p[len("helpers/"):]: git_show(root, commit, p)
                for p in listing if p.startswith("helpers/") and not p.endswith(".py")}
        found = {p.rsplit("/", 1)[1]: git_show(root, commit, p) for p in listing
                 if p.startswith(scripts + "/") and p.count("/") == scripts.count("/") + 1}
        return cls(helpers, found, data)


def provenance(notebooks: list[Path], commit: str | None = None, root: Path = ROOT) -> tuple[str, list[str]]:
    """(commit to record, what differs from it) for a run of ``notebooks`` from ``root``.

    In a git checkout: HEAD, and the paths under helpers/, notebooks/scripts/ and the given notebooks that
    differ from it (``git status``). Without git: ``commit`` or $GPUBOOK_COMMIT, else "unknown", and nothing.
    A ``commit`` that is not HEAD in a checkout is reported as a difference.
    """
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=root, capture_output=True, text=True,
                             check=True).stdout.strip()
        in_git = Path(top).resolve() == root.resolve()
    except (OSError, subprocess.CalledProcessError):
        in_git = False
    if not in_git:
        return commit or os.environ.get("GPUBOOK_COMMIT") or "unknown", []
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                          check=True).stdout.strip()
    inside = []
    for path in notebooks:
        try:
            inside.append(str(path.resolve().relative_to(root.resolve())))
        except ValueError:
            pass  # a notebook outside the checkout: only its helpers are checked
    status = subprocess.run(["git", "status", "--porcelain", "--", "helpers", "notebooks/scripts", *inside],
                            cwd=root, capture_output=True, text=True, check=True).stdout
    dirty = [line[3:] for line in status.splitlines() if line.strip()]
    if commit and not head.startswith(commit):
        dirty.insert(0, f"--commit {commit} is not HEAD ({head[:10]})")
    return head, dirty


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout


def git_show(root: Path, commit: str, path: str) -> bytes:
    return subprocess.run(["git", "show", f"{commit}:{path}"], cwd=root, capture_output=True, check=True).stdout


# ---------------------------------------------------------------------------------------------------------------
# The fingerprint of a chapter.

def scripts_named(trees_and_sources: Iterable[tuple[ast.AST | None, str]], scripts: dict[str, bytes]) -> list[str]:
    """The launched scripts a chapter names in its strings (``SCRIPTS / "train_zero.py"``, ``"scripts/x.py"``)."""
    names = set()
    for tree, source in trees_and_sources:
        texts = ([n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
                 if tree is not None else [source])
        for text in texts:
            names |= {name for name in scripts if re.search(rf"(?<![\w.-]){re.escape(name)}(?![\w-])", text)}
    return sorted(names)


def fingerprint(cells: list[tuple[str, str]], sources: Sources) -> dict:
    """The content hashes of a chapter: ``{"cells": {id: sha}, "helpers": {unit: sha}, "scripts": {name: sha}}``.

    ``cells`` are (key, source) of its code cells in order (``code_cells(nb)``).
    """
    trees = [(parse_cell(source), source) for _, source in cells]
    named = scripts_named(trees, sources.scripts)
    reach = Reach(sources.package)
    if any(tree is None for tree, _ in trees):
        reach.root(None)
    # One namespace: the setup cell's imports bind the names every later cell uses.
    reach.root(ast.Module(body=[s for tree, _ in trees if tree is not None for s in tree.body], type_ignores=[]))
    seen = set(named)
    todo = list(named)
    while todo:  # a launched script may name another one
        name = todo.pop()
        try:
            tree = ast.parse(sources.scripts[name].decode("utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue  # not Python (a config file): hashed, nothing to follow
        reach.root(tree)
        for other in scripts_named([(tree, "")], sources.scripts):
            if other not in seen:
                seen.add(other)
                todo.append(other)
    helpers = {key: sources.package.unit_hash(key) for key in reach.reached}
    helpers.update({f"{key}#source": sources.package.source_hash(key) for key in reach.shown})
    for path, content in sources.data.items():  # a data file counts where its package is imported
        package = ".".join([*path.split("/")[:-1], "__init__"])
        if package in reach.reached:
            helpers[path] = sha256(content)
    return {
        "cells": {key: cell_hash(source) for key, source in cells},
        "helpers": dict(sorted(helpers.items())),
        "scripts": {name: sha256(sources.scripts[name]) for name in sorted(seen)},
    }


def differences(then: dict, now: dict) -> list[tuple[str, str, str, str | None]]:
    """What changed between a stamp's hashes and today's: (kind, key, what, new sha256).

    kind is "cell", "helpers" or "script"; what is "changed", "added" or "removed" (cells only: a helpers unit
    no longer reached, or newly reached, is not itself a change: the cell or unit that reaches it changed).
    """
    found = []
    then_cells, now_cells = then.get("cells", {}), now["cells"]
    for key, sha in now_cells.items():
        if key not in then_cells:
            found.append(("cell", key, "added", sha))
        elif then_cells[key] != sha:
            found.append(("cell", key, "changed", sha))
    found += [("cell", key, "removed", "removed") for key in then_cells if key not in now_cells]
    for kind, field_name in (("helpers", "helpers"), ("script", "scripts")):
        old = then.get(field_name, {})
        for key, sha in now[field_name].items():
            if key in old and old[key] != sha:
                found.append((kind, key, "changed", sha))
    return found


def is_current(stamp: dict | None) -> bool:
    return bool(stamp) and stamp.get("stamp_format") == FORMAT


def dumps_notebook(nb: dict) -> str:
    """A notebook as nbformat writes it (so rewriting only its metadata leaves every other byte as it was)."""
    return json.dumps(nb, sort_keys=True, indent=1, ensure_ascii=False) + "\n"


# ---------------------------------------------------------------------------------------------------------------
# Migration of a format-1 stamp (sha256 per helpers/*.py file and per code-cell position).

def migrate(path: Path, root: Path) -> str:
    """Rewrite an old-format stamp as content hashes computed from the sources at its recorded commit.

    A helpers file counts as verified when its text at that commit has the sha256 the stamp recorded; a code
    cell when the cell at its position (at that commit, or today when no cell was added or removed since) has
    the recorded sha256. The units of an unverified file and an unverified cell get the hash "unverified", so
    the hygiene check keeps reporting them until the chapter is re-executed. Returns what it did, in words.
    """
    nb = json.loads(path.read_text(encoding="utf-8"))
    stamp = nb.get("metadata", {}).get("gpubook", {}).get("execution")
    if not stamp:
        return "not stamped: nothing to migrate"
    if is_current(stamp):
        return "already in the content-hash format"
    recorded = str(stamp.get("commit", ""))
    commit = recorded.split("+")[0]
    try:
        git(root, "cat-file", "-e", f"{commit}^{{commit}}")
        rel = path.resolve().relative_to(root.resolve()).as_posix()
    except (OSError, ValueError, subprocess.CalledProcessError):
        return f"commit {recorded!r} is not in this repository: left as it is (re-execute the chapter)"
    then = Sources.from_git(root, commit)
    old_files = stamp.get("helpers_files_sha256", {})
    verified_files = {name for name, sha in old_files.items()
                      if name in then.helpers_files and sha256(then.helpers_files[name]) == sha}
    try:
        then_cells = code_cells(json.loads(git_show(root, commit, rel)))
    except (subprocess.CalledProcessError, json.JSONDecodeError):
        then_cells = []
    now_cells = code_cells(nb)
    old_cells = stamp.get("code_cells_sha256", [])
    cells: dict[str, str] = {}
    roots: list[tuple[str, str]] = []
    for i, sha in enumerate(old_cells):
        candidates = [c for c, ok in ((then_cells[i] if i < len(then_cells) else None, True),
                                      (now_cells[i] if i < len(now_cells) else None, len(now_cells) == len(old_cells)))
                      if c is not None and ok]
        match = next((c for c in candidates if sha256(c[1]) == sha), None)
        if match is not None:
            cells[match[0]] = cell_hash(match[1])
            roots.append(match)
        else:
            key = candidates[0][0] if candidates else f"code-{i + 1}"
            cells[key] = UNVERIFIED
            roots += [c for c in now_cells if c[0] == key]  # today's text, only to find what it reaches
    fp = fingerprint(roots, then)
    helpers = {key: (sha if then.package.file_of(key) in verified_files else UNVERIFIED)
               for key, sha in fp["helpers"].items()}
    dirty = recorded != commit
    scripts = {name: (UNVERIFIED if dirty else sha) for name, sha in fp["scripts"].items()}
    n_cells = sum(v != UNVERIFIED for v in cells.values())
    files_used = {then.package.file_of(key) for key in helpers}
    record = {
        "stamp_format": FORMAT,
        "commit": recorded,
        "cells": cells,
        "helpers": helpers,
        "scripts": scripts,
        **{k: stamp[k] for k in ("gpu", "torch", "profile", "date", "wall_s") if k in stamp},
        "migrated": (f"from a format-1 stamp by scripts/check_notebooks.py --migrate-stamps: {n_cells} of "
                     f"{len(cells)} code cells and {len(files_used & verified_files)} of {len(files_used)} helpers "
                     f"files it uses verified at commit {commit[:10]}"),
    }
    nb["metadata"]["gpubook"]["execution"] = record
    path.write_text(dumps_notebook(nb), encoding="utf-8")
    return "migrated " + record["migrated"].split(": ", 1)[1]
