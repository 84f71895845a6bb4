"""The test suites share code only through tests/support: no test file imports another test
file or a sibling helper by bare name, and none edits sys.path. A child process a rank starts
is not a rank of that rank's job."""
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


def test_a_child_process_is_never_a_rank_of_the_job_around_it(monkeypatch):
    from tests.support.launch import child_env
    job = {"PMI_RANK": "1", "PMI_FD": "7", "PMIX_RANK": "1", "PMIX_NAMESPACE": "prterun-1",
           "OMPI_COMM_WORLD_RANK": "1", "OMPI_MCA_ess_base_jobid": "42", "MPI_LOCALNRANKS": "2"}
    user = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "HOME": "/h"}
    settings = {"MPITRAIN_CHECK": "0", "HYDRA_DEBUG": "1"}
    for k, v in {**job, **user, **settings}.items():
        monkeypatch.setenv(k, v)
    kept = child_env(settings=True)
    assert not set(job) & set(kept)
    assert all(kept[k] == v for k, v in {**user, **settings}.items())
    plain = child_env()
    assert not (set(job) | set(settings)) & set(plain) and set(user) <= set(plain)
    # outside an Open MPI job its OMPI_* variables are the user's settings
    for k in job:
        monkeypatch.delenv(k)
    monkeypatch.setenv("OMPI_MCA_btl", "self,vader")
    assert child_env(settings=True)["OMPI_MCA_btl"] == "self,vader"
    assert "OMPI_MCA_btl" not in child_env()


def _calls_subprocess(tree):
    return any(isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
               and node.value.id == "subprocess" for node in ast.walk(tree))


def test_suites_run_under_mpiexec_start_children_outside_the_job():
    """tests/mpi and tests/gpu run as ranks: a child process they start gets child_env()."""
    problems = []
    for folder in ("mpi", "gpu"):
        for path in sorted((TESTS / folder).rglob("*.py")):
            text = path.read_text()
            if _calls_subprocess(ast.parse(text, str(path))) and "child_env" not in text:
                problems.append(str(path.relative_to(TESTS.parent)))
    assert not problems, "start children with tests.support.launch.child_env(): " + \
        ", ".join(problems)
