"""The shape of the code, checked: imports run one way between layers, no import cycles, functions stay
short enough to read at once, and comments explain rather than record measurements (docs/architecture.md
states the rules).

    public entry points (rawinfer/__init__, __main__, server.py)
      -> frontends (options -> server -> bench -> cli)
        -> engine -> exec -> core | backend (cpu | cuda) | convert
          -> shared vocabulary (settings, config, sampling, quant)
"""

from __future__ import annotations

import ast
import io
import os
import re
import tokenize
from collections import defaultdict

import pytest

from conftest import ROOT

PACKAGE = os.path.join(ROOT, "rawinfer")
MAX_FUNCTION_LINES = 60
# Not a design rule (files are split by concern, never to fit): a file past this has become a dumping ground.
MAX_FILE_LINES = 1000
# Functions allowed past MAX_FUNCTION_LINES, each with its reason: hot kernels whose body is one parallel
# loop or one register block, where a split could change the code the compiler generates.
LONG_FUNCTIONS = {
    "rawinfer/backend/cpu/attention.py:_decode_attention_avx2_kernel":
        "Numba decode-attention kernel: one prange over (sequence, kv head) whose two passes share the "
        "raw addresses, the scores buffer and the prefetch schedule of the next work item; inline helpers "
        "would change the IR Numba hands LLVM for the hottest CPU loop",
}

# Which groups a group may import from (its own included). Everything else is a layering error.
ALLOWED = {
    "shared": {"shared"},
    "core": {"shared", "core"},
    "backend": {"shared", "backend"},
    "convert": {"shared", "convert"},
    "exec": {"shared", "core", "backend", "exec"},
    "engine": {"shared", "core", "backend", "exec", "engine"},
    "frontends": {"shared", "core", "backend", "exec", "engine", "convert", "frontends"},
    "public": {"shared", "core", "backend", "exec", "engine", "convert", "frontends", "public"},
}


def group(module: str) -> str:
    parts = module.split(".")
    if module in ("rawinfer", "rawinfer.__main__", "rawinfer.server"):
        return "public"
    if parts[1] in ("config", "settings", "sampling", "quant"):
        return "shared"
    return parts[1]


def unit(module: str) -> str:
    """The sub-package a module belongs to, for the package-level cycle check."""
    parts = module.split(".")
    if len(parts) > 2 and parts[1] == "backend":
        return ".".join(parts[:3])          # base, shapes, select, cpu, cuda
    if len(parts) > 3 and parts[1] == "frontends":
        return ".".join(parts[:3])
    if len(parts) > 2 and parts[1] == "frontends":
        return ".".join(parts[:3])          # frontends.options
    return ".".join(parts[:2])


def module_name(path: str) -> str:
    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    return rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


def source_files() -> list[str]:
    out = []
    for d, _, files in os.walk(PACKAGE):
        out += [os.path.join(d, f) for f in files if f.endswith(".py")]
    return sorted(out)


def imports_of(path: str, modules: set[str]) -> set[str]:
    """rawinfer modules imported anywhere in the file (function-level imports included)."""
    name = module_name(path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.add(sub if sub in modules else base)
    return {m for m in found if m in modules and m != name}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    files = source_files()
    modules = {module_name(f) for f in files}
    return {module_name(f): imports_of(f, modules) for f in files}


def test_imports_run_one_way_between_layers(graph):
    bad = [f"{m} ({group(m)}) imports {d} ({group(d)})"
           for m, deps in graph.items() for d in deps if group(d) not in ALLOWED[group(m)]]
    assert not bad, "\n".join(bad)


def test_the_two_backends_do_not_know_each_other(graph):
    bad = [f"{m} imports {d}" for m, deps in graph.items() for d in deps
           if {unit(m), unit(d)} == {"rawinfer.backend.cpu", "rawinfer.backend.cuda"}]
    assert not bad, "\n".join(bad)


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(edges):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_no_import_cycles_between_modules_or_sub_packages(graph):
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))
    units: dict[str, set[str]] = defaultdict(set)
    for m, deps in graph.items():
        units[unit(m)].update(unit(d) for d in deps if unit(d) != unit(m))
    cycle = _cycle(units)
    assert cycle is None, " -> ".join(cycle)


def test_the_checks_themselves_catch_a_bad_import():
    assert group("rawinfer.core.scheduler") == "core" and group("rawinfer.quant") == "shared"
    assert "backend" not in ALLOWED["core"] and "engine" not in ALLOWED["exec"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    assert unit("rawinfer.frontends.cli.main") == "rawinfer.frontends.cli"
    assert unit("rawinfer.frontends.options") == "rawinfer.frontends.options"
    assert unit("rawinfer.backend.cpu.kernels") == "rawinfer.backend.cpu"
    for diary in ("rope 1.0 vs 0.27 ms", "0.92-1.00x the time", "64 sequences 90 vs 101", "~10 us fault"):
        assert MEASUREMENT.search(diary), diary
    for prose in ("x[T, C] float32", "2 MiB pages", "int8 x int8 products", "version 1"):
        assert not MEASUREMENT.search(prose), prose


def function_lengths(src: str) -> dict[str, int]:
    """{qualified name (Class.method, outer.inner): lines} of every function and method of a source: from
    its `def` line to its last line (decorators left out), less the lines of its docstring, so that
    explaining a function never counts against it. A nested function counts on its own and in its outer."""
    out: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = child.end_lineno - child.lineno + 1
                if ast.get_docstring(child, clean=False) is not None:
                    n -= child.body[0].end_lineno - child.body[0].lineno + 1
                out[prefix + child.name] = n
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(src), "")
    return out


def test_no_function_is_longer_than_a_screen():
    lengths = {f"{os.path.relpath(f, ROOT)}:{name}": n for f in source_files()
               for name, n in function_lengths(open(f, encoding="utf-8").read()).items()}
    long = [f"{name}: {n} lines" for name, n in lengths.items()
            if n > MAX_FUNCTION_LINES and name not in LONG_FUNCTIONS]
    assert not long, (f"split these by concern into helpers of at most {MAX_FUNCTION_LINES} lines:\n"
                      + "\n".join(long))
    stale = [name for name in LONG_FUNCTIONS if lengths.get(name, 0) <= MAX_FUNCTION_LINES]
    assert not stale, "no longer over the cap (or gone): take them off LONG_FUNCTIONS:\n" + "\n".join(stale)


def test_the_function_check_counts_code_and_not_docstrings():
    def body(indent: int) -> str:
        return "".join(f"{' ' * indent}x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    src = (f'class A:\n    @property\n    def short(self):\n        """One.\n\n        Two."""\n{body(8)}'
           f"\n\ndef outer():\n    def inner():\n        pass\n{body(4)}")
    lengths = function_lengths(src)
    assert lengths["A.short"] == MAX_FUNCTION_LINES + 1          # def line + body; the 3-line docstring left out
    assert lengths["outer"] == MAX_FUNCTION_LINES + 3 and lengths["outer.inner"] == 2


def test_no_source_file_is_a_dumping_ground():
    long = [f"{os.path.relpath(f, ROOT)}: {n} lines" for f in source_files()
            if (n := sum(1 for _ in open(f, encoding="utf-8"))) > MAX_FILE_LINES]
    assert not long, "\n".join(long)


# A measurement quoted in prose: a time, a rate or a ratio with a number ("0.3 vs 1.4 ms", "2.1x").
MEASUREMENT = re.compile(r"\d(\.\d+)?\s?(ms|us|µs|ns|GB/s|GFLOP/s|tokens/s)\b|\d\.\d+x\b|\b\d+(\.\d+)?\s?vs\.?\s?\d")


def comment_text(path: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring of a file."""
    out = []
    src = open(path, encoding="utf-8").read()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                out.append((node.body[0].lineno, doc))
    return out


def cuda_comment_text(path: str) -> list[tuple[int, str]]:
    """(line, text) of every // and /* */ comment of a CUDA source."""
    src = open(path, encoding="utf-8").read()
    return [(src.count("\n", 0, m.start()) + 1, m.group(0)) for m in re.finditer(r"//[^\n]*|/\*.*?\*/", src, re.S)]


def test_comments_explain_and_leave_measurements_to_docs():
    tools = os.path.join(ROOT, "tools")
    python = source_files() + sorted(os.path.join(tools, f) for f in os.listdir(tools) if f.endswith(".py"))
    cuda = sorted(os.path.join(ROOT, "cuda", f) for f in os.listdir(os.path.join(ROOT, "cuda")) if ".cu" in f)
    texts = [(f, line, text) for f in python for line, text in comment_text(f)]
    texts += [(f, line, text) for f in cuda for line, text in cuda_comment_text(f)]
    found = [f"{os.path.relpath(f, ROOT)}:{line}: {m.group(0)!r}" for f, line, text in texts
             for m in MEASUREMENT.finditer(text)]
    assert len(texts) > 500
    assert not found, "measurements belong in docs/ (with their command and date):\n" + "\n".join(found)
