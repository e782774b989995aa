"""The shape of the code itself: imports point one way (no cycle, lazy imports included), modules
stay small, and every file name comes from one place."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "reshard"
SCRIPTS = PACKAGE.parent / "scripts"  # scripts/: benchmarks and tools, importing reshard and each other
MAX_LINES = 400


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(*roots: Path) -> dict[str, set[str]]:
    """Module -> the modules under `roots` (default: reshard/) it imports anywhere in its body
    (function-level too)."""
    modules = {_module_name(p): p for root in roots or (PACKAGE,) for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for t in targets:
                if t in modules and t != name:
                    deps.add(t)
        graph[name] = deps
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for d in sorted(graph[n]):
            # a package's __init__ re-exporting its own submodules is not a cycle of concerns
            if d.startswith(n + "."):
                continue
            if state.get(d) == 1:
                return [*stack[stack.index(d) :], d]
            if d not in state and (found := visit(d)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_no_import_cycle():
    assert _cycle(_imports()) is None, f"import cycle: {' -> '.join(_cycle(_imports()) or [])}"


def test_lower_layers_do_not_import_upper_ones():
    graph = _imports()
    low = (
        "reshard.format",
        "reshard.names",
        "reshard.serve",
        "reshard.rules",
        "reshard.errors",
        "reshard.hashing",
        "reshard.checkpoint",
        "reshard.settings",
    )
    high = ("reshard.cli", "reshard.commands", "reshard.save", "reshard.merge", "reshard.verify", "reshard.sources")
    high += ("reshard.vllm_plugin",)  # the vLLM loader plugin: a top layer beside the commands
    for mod, deps in graph.items():
        if mod.startswith(low):
            bad = sorted(d for d in deps if d.startswith(high) or d.startswith(("reshard.plan", "reshard.execute")))
            assert not bad, f"{mod} imports {bad}"
        if mod.startswith("reshard.plan"):
            bad = sorted(d for d in deps if d.startswith((*high, "reshard.execute", "reshard.io")))
            assert not bad, f"{mod} imports {bad}"


def test_store_and_folder_views_sit_below_sources_and_verify():
    """reshard.store (object storage) and reshard.folderview are read by sources and verify, never the other way."""
    above = ("reshard.sources", "reshard.verify", "reshard.commands", "reshard.cli", "reshard.save", "reshard.merge")
    for mod, deps in _imports().items():
        if mod.startswith(("reshard.store", "reshard.folderview")):
            bad = sorted(d for d in deps if d.startswith(above))
            assert not bad, f"{mod} imports {bad}"
        if mod == "reshard.folderview":
            assert not any(d.startswith("reshard.store") for d in deps), deps


def test_modules_stay_small():
    big = {_module_name(p): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, big


def test_no_import_cycle_with_scripts():
    """scripts/ import reshard and each other (a benchmark's sections, its shared helpers): no cycle
    among them either, nor through reshard."""
    graph = _imports(PACKAGE, SCRIPTS)
    script_deps = {d for m, deps in graph.items() if m.startswith("scripts.") for d in deps}
    assert {d.split(".")[0] for d in script_deps} == {"reshard", "scripts"}, "the graph misses scripts' imports"
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph) or [])}"


def test_reshard_and_scripts_stay_small():
    big = {
        _module_name(p): n
        for root in (PACKAGE, SCRIPTS)
        for p in root.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not big, big


def test_file_names_live_in_names():
    """Rank-file, manifest, staging and lock names are spelled only in reshard/names.py."""
    for path in PACKAGE.rglob("*.py"):
        if path.name == "names.py" and path.parent == PACKAGE:
            continue
        text = path.read_text()
        literals = ('"model-rank-', '"model-pp-', '"reshard.json"', "reshard.ranks-", ".reshard-new", ".reshard-old",
                    ".reshard.lock", ".reshard-tmp")  # fmt: skip
        for literal in literals:
            assert literal not in text, f"{path.relative_to(PACKAGE.parent)} spells {literal}"


def test_vllm_plugin_layering():
    """The vLLM loader plugin (issue 13) sits beside the commands: nothing imports it (vLLM does, by its
    entry point), and it uses only the folder's layers (manifest, layout, format, hashing, vllm_versions,
    errors), the object store's client and `reshard.io.direct` (O_DIRECT reads, importing nothing of
    reshard), never the commands, planning, execution or verify."""
    graph = _imports()
    for mod, deps in graph.items():
        if not mod.startswith("reshard.vllm_plugin"):
            assert not any(d.startswith("reshard.vllm_plugin") for d in deps), f"{mod} imports the vLLM plugin"
            continue
        # reshard.store (and the settings of its retries): the plugin reads an output's rank files from a
        # bucket with reshard's own client (`{"weights": "s3://..."}`)
        allowed = ("reshard.vllm_plugin", "reshard.manifest", "reshard.layout", "reshard.names", "reshard.serve",
                   "reshard.format", "reshard.hashing", "reshard.vllm_versions", "reshard.errors",
                   "reshard.store", "reshard.settings", "reshard.io.direct")  # fmt: skip
        bad = sorted(d for d in deps if d != "reshard" and not d.startswith(allowed))
        assert not bad, f"{mod} imports {bad}"


def _top_level_imports(path: Path) -> set[str]:
    """Top-level packages a module imports at module level (not inside functions)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_vllm_imported_only_by_the_plugin_loader():
    """reshard never needs vLLM: only reshard/vllm_plugin/loader.py imports it at module level (vLLM
    imports that module itself, through `register`); the plugin's checks import neither vLLM nor torch."""
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).as_posix()
        if rel == "reshard/vllm_plugin/loader.py":
            continue
        assert "vllm" not in _top_level_imports(path), f"{rel} imports vllm at module level"
    checks = _top_level_imports(PACKAGE / "vllm_plugin" / "checks.py")
    assert not checks & {"vllm", "torch"}, checks


def _env_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) of every environment access whose variable is RESHARD_* or not a literal, and of
    every string literal that is a RESHARD_* name (however it reaches the environment)."""

    def is_environ(node: ast.AST) -> bool:
        return (isinstance(node, ast.Name) and node.id == "environ") or (
            isinstance(node, ast.Attribute) and node.attr == "environ"
        )

    def key_ok(key: ast.AST | None) -> bool:
        return isinstance(key, ast.Constant) and isinstance(key.value, str) and not key.value.startswith("RESHARD_")

    found = []
    for node in ast.walk(tree):
        key: ast.AST | None = None
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"RESHARD_\w+", node.value):
            found.append((node.lineno, f"the name {node.value!r}"))
            continue
        if isinstance(node, ast.Call):
            f = node.func
            getenv = (isinstance(f, ast.Name) and f.id == "getenv") or (
                isinstance(f, ast.Attribute) and f.attr == "getenv"
            )
            on_environ = isinstance(f, ast.Attribute) and is_environ(f.value) and f.attr in ("get", "setdefault", "pop")
            if not (getenv or on_environ):
                continue
            key = node.args[0] if node.args else None
        elif isinstance(node, ast.Subscript) and is_environ(node.value):
            key = node.slice
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            key = node.left
        else:
            continue
        if not key_ok(key):
            found.append((node.lineno, f"an environment read of {ast.unparse(key) if key else '?'}"))
    return found


def test_reshard_environment_is_read_only_in_settings():
    """Every RESHARD_* variable is declared, validated and read in reshard/settings.py (issue 23);
    elsewhere the environment is read only by literal names that are not reshard's."""
    bad = []
    for path in PACKAGE.rglob("*.py"):
        if path == PACKAGE / "settings.py":
            continue
        bad += [
            f"{path.relative_to(PACKAGE.parent)}:{line}: {what}"
            for line, what in _env_reads(ast.parse(path.read_text()))
        ]
    assert not bad, bad


def test_env_read_finder_finds_them():
    code = (
        "import os\nfrom os import environ, getenv\n"
        "a = os.environ.get('RESHARD_X', '1')\nb = os.getenv('RESHARD_Y')\nc = environ['RESHARD_Z']\n"
        "d = 'RESHARD_W' in os.environ\nk = 'HOME'\ne = os.environ[k]\nf = getenv(k)\n"
        "ok = os.environ.get('WORLD_SIZE', '1')\ntext = 'set RESHARD_DEBUG=1 to see it'\n"
    )
    assert sorted({line for line, _ in _env_reads(ast.parse(code))}) == [3, 4, 5, 6, 8, 9]


# every top-level key of reshard.json (reshard.manifest.schema) and of its layout object
MANIFEST_KEYS = {"format", "format_version", "reshard_version", "checksum", "run_id", "created", "source", "layout",
                 "vllm_versions", "total_bytes", "files", "copied", "copied_files", "source_tensors", "serve",
                 "serve_reshard", "notes", "ranks", "all_files", "vllm_layout", "architecture",
                 "pp_layer_partition", "moe_backend_pinned"}  # fmt: skip


def _raw_manifest_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """`manifest["layout"]`, `m.get("files")`, `lay["tp"]`...: a key read by name off a variable that
    holds a manifest or its layout (named manifest, m, lay or layout, or `x.manifest`)."""

    def holder(node: ast.AST) -> bool:
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
        return "manifest" in name.lower() or name in ("m", "lay", "layout")

    found = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Subscript) and holder(node.value) and isinstance(node.slice, ast.Constant):
            key = node.slice.value
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and holder(node.func.value)
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            key = node.args[0].value
        if isinstance(key, str) and (key in MANIFEST_KEYS or key in ("tp", "pp", "ep", "dtype")):
            found.append((node.lineno, key))
    return found


def test_manifest_keys_are_read_only_in_the_manifest_package():
    """The manifest is parsed (and validated) into typed records in one place, reshard/manifest/; the
    rest of reshard reads their attributes, never a key of the JSON."""
    for path in PACKAGE.rglob("*.py"):
        if path.parent.name == "manifest" and path.parent.parent == PACKAGE:
            continue
        reads = _raw_manifest_reads(ast.parse(path.read_text()))
        assert not reads, f"{path.relative_to(PACKAGE.parent)} reads manifest keys at lines {reads}"


def test_raw_manifest_read_finder_finds_them():
    code = 'a = manifest["layout"]\nb = m.get("files")\nc = folder.manifest["run_id"]\nd = lay["tp"]\ne = cfg["tp"]\n'
    assert [k for _, k in _raw_manifest_reads(ast.parse(code))] == ["layout", "files", "run_id", "tp"]


def test_note_lines_are_printed_only_by_console_note():
    """A `note:` line goes through reshard.console.note, which prints it on stderr or, under --json, keeps it for
    the command's JSON object (`notes`): one printed elsewhere reached stderr beside the object and was missing
    from it."""
    bad = []
    for path in PACKAGE.rglob("*.py"):
        if path == PACKAGE / "console.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("note: "):
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not bad, bad
