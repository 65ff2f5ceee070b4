"""The package's modules import one way: no module reaches itself through its
imports (those under `if TYPE_CHECKING:` included), so client -> once and
never the reverse."""

import ast
import pathlib

import idempotency_client

PACKAGE = pathlib.Path(idempotency_client.__file__).parent


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: pathlib.Path, modules: set) -> set:
    """The package's modules that `path` imports; `from . import types`
    imports the module types, not the package."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            names = {f"{base}.{alias.name}" for alias in node.names}
            found.update(names & modules)
            if names - modules:  # a name from the module itself, not a submodule
                found.add(base)
    return {module for module in found if module in modules and module != name}


def test_no_module_imports_itself_through_others():
    paths = [path for path in PACKAGE.rglob("*.py") if "_proto" not in path.parts]
    modules = {module_name(path) for path in paths}
    graph = {module_name(path): imports_of(path, modules) for path in paths}

    def reaches(start: str) -> set:
        seen, todo = set(), list(graph[start])
        while todo:
            module = todo.pop()
            if module not in seen:
                seen.add(module)
                todo.extend(graph[module])
        return seen

    circles = sorted(module for module in graph if module in reaches(module))
    assert circles == []
    assert "idempotency_client._sync.once" in graph["idempotency_client._sync.client"]
    assert "idempotency_client._async.once" in graph["idempotency_client._async.client"]
