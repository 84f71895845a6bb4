"""Every MPITRAIN_* variable is read by mpitrain/runtime/env.py with one grammar: a table of
every declared variable with a good value, each boolean spelling for every boolean variable, and
a garbage value that is a one-line ValueError naming the variable and the value. No other module
reads os.environ for an MPITRAIN_* name."""
import ast
import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mpitrain.train import cli
from mpitrain.runtime import threads
from mpitrain.train import config as cfg
from mpitrain.comm.settings import CommSettings
from mpitrain.data.locate import env_data_dir
from mpitrain.runtime import env

REPO = Path(__file__).resolve().parents[2]
WORDS = {"1": True, "true": True, "yes": True, "on": True,
         "0": False, "false": False, "no": False, "off": False}

# The comm layer's variables (mt.init): variable -> (good value, CommSettings field, its value).
COMM = {
    "MPITRAIN_ALLREDUCE": ("Ring", "algorithm", "ring"),
    "MPITRAIN_RING_THRESHOLD": ("1024", "ring_threshold_bytes", 1024),
    "MPITRAIN_RING_SUBCHUNK": ("4096", "ring_subchunk_bytes", 4096),
    "MPITRAIN_CHECK": ("off", "check", False),
    "MPITRAIN_STALL_WARNING": ("2.5", "stall_warning_s", 2.5),
    "MPITRAIN_STALL_SHUTDOWN": ("0", "stall_shutdown_s", 0.0),
    "MPITRAIN_FUSION_THRESHOLD": ("123", "fusion_threshold_bytes", 123),
    "MPITRAIN_NODE_SIZE": ("2", "local_size", 2),
    "MPITRAIN_LOCAL_SIZE": ("3", "local_size", 3),
    "MPITRAIN_DEVICE_COMM": ("HOST", "device_comm", "host"),
    "MPITRAIN_CUDA_AWARE_MPI": ("yes", "cuda_aware_mpi", True),
    "MPITRAIN_HIERARCHICAL_ALLREDUCE": ("true", "hierarchical", True),
    "MPITRAIN_AUTOTUNE": ("on", "autotune", True),
    "MPITRAIN_AUTOTUNE_LOG": ("tune.csv", "autotune_log", "tune.csv"),
    "MPITRAIN_AUTOTUNE_STEPS": ("5", "autotune_steps", 5),
    "MPITRAIN_AUTOTUNE_WARMUP_STEPS": ("0", "autotune_warmup_steps", 0),
}
# The text a field's variable takes when the field has a grammar of its own (flag_type).
CUSTOM = {"hidden": ("8,4", (8, 4)), "lr_milestones": ("2,3", (2, 3)),
          "augment": ("flip,crop", "crop,flip"), "preempt_signals": ("usr1,sigterm", "TERM,USR1"),
          "betas": ("0.9,0.99", (0.9, 0.99))}


def _config_table():
    """The CLI's variables (one per Config field): variable -> (good value, field, its value)."""
    table = {}
    for f in cfg.fields():
        kind, choices = cfg.field_type(f), f.metadata.get("choices")
        if f.name in CUSTOM:
            text, value = CUSTOM[f.name]
        elif choices:
            text, value = choices[-1].upper(), choices[-1]
        elif kind is bool:
            text, value = "Yes", True
        elif kind is int:
            text, value = "7", 7
        elif kind is float:
            text, value = "0.5", 0.5
        else:
            text, value = "some/path", "some/path"
        table[cfg.env_name(f.name)] = (text, f.name, value)
    return table


CONFIG = _config_table()
# a flag's "off" twin (--no-progress) has its variable too: MPITRAIN_NO_PROGRESS=1 is progress off
OFF = {cfg.env_name(f.metadata["off_flag"]): f.name for f in cfg.fields()
       if f.metadata.get("off_flag")}
# the data layer's older name of MPITRAIN_DATA_DIR; the relaunch count mpitrainrun sets
OTHER = ("MPITRAIN_DATA", "MPITRAIN_RESTART_COUNT", "MPITRAIN_CHECKPOINT_PROBE")
BOOLEANS = [name for name, (_, _, value) in {**COMM, **CONFIG}.items()
            if isinstance(value, bool)]
TEXT = {name for name, (text, _, value) in {**COMM, **CONFIG}.items() if text == value}


def _read_all(environ):
    """Every reader of the environment: mt.init's, the CLI's, the thread budget's, the data's."""
    return (CommSettings.from_env(environ), cfg.from_env(environ), threads.from_env(environ),
            env_data_dir(environ))


def _mixed_case(word):
    return "".join(c.upper() if i % 2 else c.lower() for i, c in enumerate(word))


def test_the_table_covers_every_declared_variable():
    assert sorted({*COMM, *CONFIG, *OFF, *OTHER}) == env.known()


@pytest.mark.parametrize("word", sorted(WORDS))
@pytest.mark.parametrize("name", sorted(OFF))
def test_an_off_flag_variable_reads_inverted(name, word):
    assert getattr(cfg.from_env({name: word}), OFF[name]) is (not WORDS[word])


@pytest.mark.parametrize("name", sorted(COMM))
def test_a_good_comm_value(name):
    text, field, value = COMM[name]
    assert getattr(CommSettings.from_env({name: text}), field) == value
    assert CommSettings.from_env({name: "  "}) == CommSettings()      # blank = the default


@pytest.mark.parametrize("name", sorted(CONFIG))
def test_a_good_cli_value(name):
    text, field, value = CONFIG[name]
    assert getattr(cfg.from_env({name: text}), field) == value
    assert cfg.from_env({name: ""}) == cfg.Config()


def test_the_variables_that_two_layers_read_mean_the_same_in_both():
    assert threads.from_env({"MPITRAIN_THREADS": "3"}) == cfg.from_env(
        {"MPITRAIN_THREADS": "3"}).threads == 3
    for name in ("MPITRAIN_DATA_DIR", "MPITRAIN_DATA"):
        assert env_data_dir({name: "d"}) == (name, "d")
        assert cfg.from_env({name: "d"}).data_dir == "d"
    assert env_data_dir({"MPITRAIN_DATA_DIR": "a", "MPITRAIN_DATA": "b"}) == \
        ("MPITRAIN_DATA_DIR", "a")
    both = {"MPITRAIN_FUSION_THRESHOLD": "1024", "MPITRAIN_FUSION_THRESHOLD_BYTES": "2048"}
    assert cfg.from_env(both).fusion_threshold_bytes == 2048
    assert CommSettings.from_env(both).fusion_threshold_bytes == 1024


@pytest.mark.parametrize("word", sorted(WORDS))
@pytest.mark.parametrize("name", BOOLEANS)
def test_every_boolean_spelling(name, word):
    read, field = (CommSettings.from_env, COMM[name][1]) if name in COMM else \
        (cfg.from_env, CONFIG[name][1])
    for text in (word, word.upper(), f" {_mixed_case(word)} "):
        assert getattr(read({name: text}), field) is WORDS[word]


@pytest.mark.parametrize("name", sorted({*COMM, *CONFIG, *OFF} - TEXT))   # text: any is good
def test_garbage_is_one_line_naming_the_variable_and_the_value(name):
    with pytest.raises(ValueError) as info:
        _read_all({name: "garbage"})
    message = str(info.value)
    assert message.startswith(f"{name}='garbage'") and "\n" not in message, message


def test_a_boolean_error_lists_the_spellings():
    with pytest.raises(ValueError, match=r"^MPITRAIN_CHECK='maybe': expected 1/0, true/false, "
                                         r"yes/no or on/off$"):
        CommSettings.from_env({"MPITRAIN_CHECK": "maybe"})


def test_a_bad_variable_is_exit_2_with_one_line_in_the_cli(monkeypatch, capsys):
    monkeypatch.setenv("MPITRAIN_SYNC_BN", "maybe")
    assert cli.run_cli([]) == cli.EXIT_USAGE
    assert capsys.readouterr().err == ("mpitrain: error: MPITRAIN_SYNC_BN='maybe': expected "
                                       "1/0, true/false, yes/no or on/off\n")


def test_check_false_turns_the_check_off_and_cuda_aware_true_forces_it():
    """Through mt.init, as a user's job would: the settings reach the World and device.py."""
    code = ("import mpitrain as mt\n"
            "from mpitrain.comm import device, world\n"
            "mt.init(threads=None)\n"
            "print(world.current().agreement.enabled, device.cuda_aware_mpi())\n")
    for check, cuda_aware, expect in (("false", "true", "False True"),
                                      ("On", "OFF", "True False"),
                                      ("0", "1", "False True")):
        environ = {k: v for k, v in os.environ.items() if not k.startswith("MPITRAIN_")}
        environ.update(MPITRAIN_CHECK=check, MPITRAIN_CUDA_AWARE_MPI=cuda_aware)
        out = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True,
                             text=True, timeout=120, cwd=REPO)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split() == expect.split(), (check, cuda_aware, out.stdout)


def test_the_environment_page_lists_each_variable_once():
    """docs/environment.md: one row per variable; the flags' own variables share the row
    MPITRAIN_<FLAG>, except those that mt.init() and mpitrain.data read too."""
    page = (REPO / "docs" / "environment.md").read_text()
    rows = [line.split(" | ")[0] for line in page.splitlines()
            if line.startswith("| `MPITRAIN_")]
    listed = re.findall(r"`(MPITRAIN_[A-Z_<>]+)`", "\n".join(rows))
    flags_only = {*CONFIG, *OFF} - {"MPITRAIN_THREADS", "MPITRAIN_DATA_DIR"}
    assert sorted(listed) == sorted({*env.known(), "MPITRAIN_<FLAG>"} - flags_only)


def test_settings_are_the_dataclass_defaults_when_nothing_is_set():
    assert CommSettings.from_env({}) == CommSettings()
    assert dataclasses.asdict(cfg.from_env({})) == dataclasses.asdict(cfg.Config())


def test_the_ring_threshold_is_1_mib_between_two_ranks_and_32_mib_from_three():
    default = CommSettings.from_env({})
    assert [default.ring_threshold(n) for n in (2, 3, 4, 64)] == [1 << 20] + 3 * [32 << 20]
    chosen = CommSettings.from_env({"MPITRAIN_RING_THRESHOLD": "4096"})
    assert [chosen.ring_threshold(n) for n in (2, 3)] == [4096, 4096]      # the setting wins


# --- one reader -----------------------------------------------------------------------------

def _is_environ(node):
    return (isinstance(node, ast.Attribute) and node.attr in ("environ", "environb")) or \
        (isinstance(node, ast.Name) and node.id == "environ")


def _names(node, scope, module):
    """The strings a key expression can be: a constant, a name bound to one, or the target of a
    ``for`` (or comprehension) over a tuple of constants, written there or bound at module
    level; None when it cannot be told."""
    def constants(expr):
        if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
            return [expr.value]
        if isinstance(expr, (ast.Tuple, ast.List)) and all(
                isinstance(e, ast.Constant) and isinstance(e.value, str) for e in expr.elts):
            return [e.value for e in expr.elts]
        if isinstance(expr, ast.Name):
            bound = [n.value for n in module.body if isinstance(n, ast.Assign)
                     and [getattr(t, "id", None) for t in n.targets] == [expr.id]]
            return constants(bound[0]) if len(bound) == 1 else None
        return None

    if isinstance(node, ast.Constant):
        return constants(node)
    if isinstance(node, ast.Name):
        for n in ast.walk(scope):
            if isinstance(n, (ast.For, ast.comprehension)) \
                    and getattr(n.target, "id", None) == node.id:
                return constants(n.iter)
            if isinstance(n, ast.Assign) and [getattr(t, "id", None) for t in n.targets] == \
                    [node.id]:
                return constants(n.value)
    return None


def _environ_problems(tree):
    """Lines where a module reads the environment outside runtime/env.py's readers: a key that
    is an MPITRAIN_* name or cannot be told, or os.environ handed on (other than kept as a
    function's ``environ = os.environ if environ is None else environ``)."""
    parent = {id(c): n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}
    problems, read = [], set()

    def visit(node, scope):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            scope = node
        key, mapping = False, None
        if isinstance(node, ast.Subscript) and _is_environ(node.value):
            key, mapping = node.slice, node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and (
                _is_environ(node.func.value) and node.func.attr in ("get", "pop", "setdefault")
                or node.func.attr == "getenv"):
            key, mapping = (node.args[0] if node.args else None), node.func.value
        elif isinstance(node, ast.Compare) and len(node.comparators) == 1 \
                and _is_environ(node.comparators[0]):
            key, mapping = node.left, node.comparators[0]
        if key is not False:
            read.add(id(mapping))
            names = None if key is None else _names(key, scope, tree)
            if names is None or any(n.startswith(env.PREFIX) for n in names):
                problems.append(node.lineno)
        for child in ast.iter_child_nodes(node):
            visit(child, scope)

    visit(tree, tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "environb") \
                and id(node) not in read:
            up = parent.get(id(node))
            kept = isinstance(up, ast.IfExp) and isinstance(parent.get(id(up)), ast.Assign) \
                and [getattr(t, "id", None) for t in parent[id(up)].targets] == ["environ"]
            if not kept:
                problems.append(node.lineno)
    return sorted(problems)


def test_no_module_but_runtime_env_reads_an_mpitrain_variable():
    problems = []
    for path in sorted([*(REPO / "mpitrain").rglob("*.py"), *(REPO / "kernels").rglob("*.py")]):
        if path != REPO / "mpitrain" / "runtime" / "env.py":
            tree = ast.parse(path.read_text(), str(path))
            problems += [f"{path.relative_to(REPO)}:{n}" for n in _environ_problems(tree)]
    assert not problems, "read MPITRAIN_* variables with mpitrain.runtime.env: " + \
        ", ".join(problems)


def test_the_scan_finds_every_way_of_reading_a_variable():
    code = ("import os\n"
            "NAMES = ('MPITRAIN_V', 'HOME')\n"
            "def a():\n    return os.environ.get('MPITRAIN_X')\n"
            "def b():\n    return os.getenv('MPITRAIN_Y')\n"
            "def c():\n    name = 'MPITRAIN_Z'\n    return os.environ[name]\n"
            "def d():\n    return 'MPITRAIN_W' in os.environ\n"
            "def e():\n    return [os.environ.get(k) for k in NAMES]\n"
            "def f(key):\n    return os.environ[key]\n"
            "def g():\n    return dict(os.environ)\n"
            "def h(environ=None):\n"
            "    return (os.environ if environ is None else environ).get('MPITRAIN_U')\n"
            "def fine(environ=None):\n"
            "    environ = os.environ if environ is None else environ\n"
            "    for key in ('PMI_RANK', 'HOME'):\n"
            "        os.environ[key] = environ.get(key, '') + os.environ.get('USER', '')\n"
            "    return [environ.get(k) for k in ('HOME', 'USER')]\n")
    assert _environ_problems(ast.parse(code)) == [4, 6, 9, 11, 13, 15, 17, 19]
