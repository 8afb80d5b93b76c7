"""The house: the import graph of `shared/` keeps the layer order written at the top of
shared/__init__.py (no cycles, no import that points up, no function-level import of pdserve code
inside shared/), the router starts without torch, and the README's layout names only files that exist."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import shared

ROOT = Path(__file__).resolve().parents[1]
FIRST_PARTY = ("shared", "router", "prefill_service", "decode_service")


def layer_order() -> list[str]:
    """The packages of shared/, bottom first, as shared/__init__.py lists them."""
    block = shared.__doc__.split("Layers, bottom to top.")[1]
    return re.findall(r"^    (\w+) {2,}", block, re.MULTILINE)


@dataclass(frozen=True)
class Import:
    source: str  # importing module, dotted
    target: str  # imported first-party module, dotted
    line: int
    top_level: bool  # at module level (not inside a function or class body)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def first_party_imports(path: Path) -> list[Import]:
    """Every import of pdserve code in `path`, with relative imports resolved."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            targets = [base]
        else:
            continue
        is_top = id(node) in top or _inside_top_level_if(tree, node)
        out += [Import(name, t, node.lineno, is_top) for t in targets if t.split(".")[0] in FIRST_PARTY]
    return out


def _inside_top_level_if(tree: ast.Module, node: ast.AST) -> bool:
    """`if TYPE_CHECKING:` / try blocks at module level count as top level."""
    return any(node in ast.walk(stmt) for stmt in tree.body if isinstance(stmt, (ast.If, ast.Try)))


def shared_modules() -> list[Path]:
    return [p for p in sorted((ROOT / "shared").rglob("*.py")) if "/rpc/pdserve/" not in str(p)]


def floor_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_the_layer_order_is_written_down_and_covers_every_package():
    order = layer_order()
    packages = {p.parent.name if p.name == "__init__.py" else p.stem
                for p in (ROOT / "shared").iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    assert set(order) == packages - {"shared"}, f"order {order} vs packages {sorted(packages)}"


def test_no_import_in_shared_points_up_or_outside():
    order = {name: i for i, name in enumerate(layer_order())}
    bad = []
    for path in shared_modules():
        for imp in first_party_imports(path):
            where = f"{path.relative_to(ROOT)}:{imp.line} imports {imp.target}"
            if not imp.target.startswith("shared"):
                bad.append(f"{where} (shared/ never imports a service or the router)")
                continue
            src, dst = floor_of(imp.source), floor_of(imp.target)
            if not src or not dst:
                continue  # the package root holds only the layer description
            if order[dst] > order[src]:
                bad.append(f"{where} ({dst} is above {src})")
            elif not imp.top_level:
                bad.append(f"{where} (a function-level import of pdserve code: import at the top)")
    assert not bad, "\n".join(bad)


def test_services_are_shells_over_shared():
    """A service imports its own package and shared/ only (never the router or the other service),
    at the top of its files."""
    bad = []
    for service in ("prefill_service", "decode_service"):
        for path in sorted((ROOT / service).rglob("*.py")):
            for imp in first_party_imports(path):
                where = f"{path.relative_to(ROOT)}:{imp.line} imports {imp.target}"
                if imp.target.split(".")[0] not in (service, "shared"):
                    bad.append(where)
                elif not imp.top_level:
                    bad.append(f"{where} (function-level)")
    assert not bad, "\n".join(bad)


def test_no_import_cycles_among_first_party_modules():
    graph: dict[str, set[str]] = {}
    files = [p for pkg in FIRST_PARTY for p in sorted((ROOT / pkg).rglob("*.py")) if "/rpc/pdserve/" not in str(p)]
    names = {module_name(p) for p in files}
    for path in files:
        for imp in first_party_imports(path):
            target = imp.target
            while target and target not in names:
                target = target.rpartition(".")[0]
            if target and target != imp.source:
                graph.setdefault(imp.source, set()).add(target)
    # Tarjan's strongly connected components: any with two or more modules is a cycle
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(names):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


ROUTER_PROCESS = ["router.server", "router.cli", "router.deploy", "router.policy", "router.perf", "router.planner"]


def test_the_router_imports_no_torch():
    """The front door (its server and the `pdserve` command line) loads without torch: in a fresh
    interpreter, importing them leaves torch out of sys.modules."""
    code = (f"import sys\nfor m in {ROUTER_PROCESS!r}:\n    __import__(m)\n"
            "heavy = sorted(k for k in sys.modules if k.split('.')[0] in ('torch', 'numpy', 'safetensors'))\n"
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"the router pulled in: {out.stdout.strip()[:300]}"


def test_a_service_process_loads_no_compiler_stack():
    """The services and the engine load without torch's compiler stack (dynamo, inductor): importing it costs
    2-3 s of every process start (each service runs two: its gRPC front end and its engine core), and only
    `--compile` uses it. llguidance.torch imported it with a torch.compile kernel the engine never calls."""
    code = ("import sys\nfor m in ('prefill_service.server', 'decode_service.server', 'shared.engine'):\n"
            "    __import__(m)\n"
            "print(','.join(k for k in ('torch._dynamo', 'torch._inductor') if k in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"a service process pulled in: {out.stdout.strip()}"


def layout_entries(block: str) -> list[tuple[str, str, str]]:
    """(parent, path, text) per entry of the layout block: an entry starts with a path at column 0 (a
    top-level folder) or 2 (inside the last top-level one); deeper-indented lines continue its text."""
    entries: list[list[str]] = []
    top = ""
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip())
        if not line.strip():
            continue
        if indent in (0, 2):
            path, _, text = line.strip().partition(" ")
            if indent == 0:
                top = path
            entries.append([top if indent else "", path, text])
        else:
            entries[-1][2] += " " + line.strip()
    return [(parent, path, text) for parent, path, text in entries]


def test_the_readme_layout_names_only_files_that_exist():
    """Each entry of the README's layout block is `path  item (why) · item (why) ...`: the path and every
    item (a module, package or file of that path) exist, so the layout cannot name what is gone."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Repository layout", 1)[1].split("```", 2)[1]
    missing = []
    entries = layout_entries(block)
    assert len(entries) > 15
    for parent, path, text in entries:
        where = ROOT / parent / path
        if not where.exists():
            missing.append(f"{parent}{path}")
            continue
        while re.search(r"\([^()]*\)", text):
            text = re.sub(r"\([^()]*\)", "", text)  # (why) remarks, nested ones too
        text = text.split(" — ")[0]
        for item in text.split("·"):
            name = item.strip().split(" ")[0] if item.strip() else ""
            if not re.fullmatch(r"[a-z_][a-z0-9_]*", name) or not where.is_dir():
                continue
            if not ((where / name).exists() or list(where.glob(f"{name}.*"))):
                missing.append(f"{parent}{path}{name}")
    assert not missing, f"the README layout names what does not exist: {missing}"


PRODUCT = ("shared", "prefill_service", "decode_service", "router")
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80


def product_modules() -> list[Path]:
    """The product's Python files: the packages a deployment runs, generated protobuf modules aside (the
    kernels' C sources under shared/model/csrc are not Python, so they are aside too)."""
    return [p for pkg in PRODUCT for p in sorted((ROOT / pkg).rglob("*.py"))
            if "/rpc/pdserve/" not in str(p) and "_pb2" not in p.name]


def test_no_product_file_is_over_500_lines():
    """A file a reader can hold: past 500 lines a module is two modules (split it, the import path kept)."""
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in product_modules()
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
    assert not long, f"product files over {MAX_FILE_LINES} lines:\n" + "\n".join(long)


def test_no_function_is_over_80_lines():
    """A function a reader can hold: every def (methods and nested ones too), measured from its `def` line to
    its last line, is at most 80 lines."""
    long = []
    for path in product_modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                span = node.end_lineno - node.lineno + 1
                if span > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {span} lines")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


LEDGER = ROOT / "shared" / "kvcache" / "ledger.py"
# BlockAllocator's ways blocks go back
BLOCK_RELEASES = {"free", "_release_blocks", "_queue_block_release", "_drain_block_releases"}


def test_only_the_ledger_frees_kv_blocks():
    """One owner per KV block: nothing but shared/kvcache/ledger.py gives blocks back (a `.free(` call, or
    the allocator's release, its queued release or its drain), so who frees a block never depends on the
    thread or the phase (shared.kvcache.ledger)."""
    outside = []
    for package in FIRST_PARTY:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == LEDGER:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr in BLOCK_RELEASES):
                    outside.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.func.attr}(")
    assert not outside, f"KV blocks freed outside the ledger: {outside}"
