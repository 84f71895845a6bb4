"""The test suites share code only through tests/support: no test file imports another test
file or a sibling helper by bare name, and none edits sys.path."""
import ast
import pathlib

TESTS = pathlib.Path(__file__).resolve().parents[1]


def _imports(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module


def _sys_path_edits(tree):
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Attribute)
                and node.func.value.attr == "path"
                and isinstance(node.func.value.value, ast.Name)
                and node.func.value.value.id == "sys"):
            yield node.lineno


def test_tests_share_code_only_through_tests_support():
    local = {p.stem for p in TESTS.rglob("*.py") if "support" not in p.parts}
    problems = []
    for path in sorted(TESTS.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        rel = path.relative_to(TESTS.parent)
        for name in _imports(tree):
            top = name.split(".")[0]
            if top in local or (top == "tests" and not name.startswith("tests.support")):
                problems.append(f"{rel}: imports {name}")
        problems += [f"{rel}:{line}: edits sys.path" for line in _sys_path_edits(tree)]
    assert not problems, "\n".join(problems)
