"""The import graph follows DESIGN.md's layers: nothing imports upward, and no module imports
itself back through a cycle. Every import counts, the lazy ones inside functions and the
`TYPE_CHECKING` ones too (a cycle hidden by either is still a cycle); nothing is allowed by name."""

from __future__ import annotations

import ast
from pathlib import Path

import shardwise

SOURCE = Path(shardwise.__file__).parent
LAYERS = (
    {"shardwise", "__main__", "cli"},
    {"launch", "manymodel", "plan", "run"},
    {"trainer"},
    {"checkpoint", "tracking", "fault"},
    {"parallel", "comm"},
    {"models", "data", "job_names"},
    {"config"},
    {"common", "training"},
)
"""DESIGN.md's import direction, top to bottom: a module may import its own layer's (without a
cycle) and the layers below. A module of training/ is placed by its subpackage (training.trainer
is "trainer"); the package `shardwise.training` itself holds nothing and sits with the floor."""


def _modules() -> dict[str, Path]:
    found = {}
    for path in SOURCE.rglob("*.py"):
        parts = ("shardwise", *path.relative_to(SOURCE).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project's modules that `name` imports anywhere in its text."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    named: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            named |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([base] if base else [])])
            for alias in node.names:  # a module by its name, else the one it comes from
                full = f"{base}.{alias.name}"
                named.add(full if full in modules else base)
    found = set()
    for target in named:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _layer(module: str) -> int:
    parts = module.split(".")[1:] or [module]
    top = parts[1] if parts[0] == "training" and len(parts) > 1 else parts[0]
    for index, names in enumerate(LAYERS):
        if top in names:
            return index
    raise AssertionError(f"{module} is in no layer of DESIGN.md: place it there and here")


def test_nothing_imports_upward():
    graph = _graph()
    upward = [
        f"{name} -> {target}"
        for name, targets in sorted(graph.items())
        for target in sorted(targets)
        if _layer(target) < _layer(name)
    ]
    assert not upward, upward


def test_no_module_imports_itself_back():
    graph = _graph()
    cycles = [sorted(c) for c in _strongly_connected(graph) if len(c) > 1]
    assert not cycles, cycles


def test_the_planner_never_imports_the_training_loop():
    """The planner may read the trainer's leaf modules (memory accounting; calibration imports
    the step's modules for the memory baseline a worker has), never the loop."""
    graph = _graph()
    reached = {t for name, ts in graph.items() if name.startswith("shardwise.plan") for t in ts}
    assert "shardwise.training.trainer.loop" not in reached


def test_many_models_and_training_use_only_the_floor_of_each_other():
    """The products share only `common/`: many-models imports nothing of training, the planner or
    the model zoo, and training imports nothing of many-models or the planner."""
    graph = _graph()
    crossing = [
        f"{name} -> {target}"
        for name, targets in sorted(graph.items())
        for target in sorted(targets)
        if (
            name.startswith("shardwise.manymodel")
            and target.startswith(("shardwise.training", "shardwise.plan", "shardwise.models"))
        )
        or (
            name.startswith(("shardwise.training", "shardwise.models"))
            and target.startswith(("shardwise.manymodel", "shardwise.plan"))
        )
    ]
    assert not crossing, crossing


def test_the_graph_is_read_whole():
    """A lazy import and a TYPE_CHECKING import are edges like any other (a cycle hidden by
    either is still a cycle)."""
    graph = _graph()
    assert "shardwise.manymodel.run.runner" in graph["shardwise.cli"]  # imported inside a function
    assert len(graph) > 100


def _strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm, iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                found.append(component)
    return found


def _imported(statements: str, prefixes: tuple[str, ...]) -> list[str]:
    """The modules under `prefixes` a fresh interpreter has imported after `statements`, run
    from the repository's root."""
    import json
    import subprocess
    import sys

    found = f"sorted(m for m in sys.modules if m.startswith({prefixes!r}))"
    probe = f"import json, sys\n{statements}\nprint(json.dumps({found}))"
    done = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True, text=True, check=True, timeout=120, cwd=SOURCE.parents[1],
    )  # fmt: skip
    return json.loads(done.stdout)


def test_a_rank_imports_pipelining_only_for_a_pipeline():
    """torch.distributed.pipelining imports TorchDynamo: half a second of every rank's start,
    which a run without a pipeline never uses (parallel/stage.py)."""
    statements = (
        "import shardwise.training.launch.worker, shardwise.training.trainer.loop, "
        "shardwise.training.trainer.dry_run"
    )
    assert _imported(statements, ("torch.distributed.pipelining", "torch._dynamo")) == []


def test_a_data_parallel_launcher_imports_neither_dtensor_nor_the_trainer():
    """The launcher checks the job on the meta device and reads rank 0's summary: for a
    data-parallel job neither needs DTensor (which DCP, the pipeline and the tensor-parallel
    code import: 0.5 s) or the trainer (0.5 s), which every `shardwise train` paid before
    starting its ranks."""
    statements = (
        "import pickle\n"
        "from shardwise.training.config.load import load_config\n"
        "from shardwise.training.run import check_job\n"
        "from shardwise.training.trainer.train_summary import TrainSummary\n"
        "check_job(load_config('examples/digits.toml'), 2, 2)\n"
        "pickle.loads(pickle.dumps(TrainSummary(1, {}, None, 'runs/x', None, 1.0)))"
    )
    heavy = (
        "torch.distributed.tensor",
        "torch.distributed.checkpoint",
        "shardwise.training.trainer.loop",
    )
    assert _imported(statements, heavy) == []


def test_the_commands_parser_imports_no_products_code():
    """Every `shardwise` command builds the whole parser first: it imports the options' light
    modules only, not the training launcher or a job file's schema (0.1 s of every command,
    many-models' included, before the launcher's options moved to launch_arguments.py)."""
    statements = "import shardwise.cli\nshardwise.cli.build_parser()"
    heavy = ("shardwise.training.config", "shardwise.training.launch.targets", "torch")
    assert _imported(statements, heavy) == []
