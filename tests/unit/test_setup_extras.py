"""setup.py's extras: CuPy for CUDA 12 and 13, under names the set-up and GPU pages give."""
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def extras():
    """setup.py's extras_require, read from its source (importing it would run setup())."""
    tree = ast.parse((REPO / "setup.py").read_text())
    [found] = [kw.value for node in ast.walk(tree) if isinstance(node, ast.Call)
               for kw in node.keywords if kw.arg == "extras_require"]
    return ast.literal_eval(found)


def test_cuda_extras_install_cupy_for_cuda_12_and_13():
    got = extras()
    assert got["cuda12"] == ["cupy-cuda12x"]
    assert got["cuda13"] == ["cupy-cuda13x"]
    assert got["cuda"] == got["cuda12"]                 # the older name still installs CUDA 12


def test_the_set_up_and_gpu_pages_name_the_cuda_extras():
    for page in ("install.md", "gpu.md"):
        text = (REPO / "docs" / page).read_text()
        for name in ("cuda12", "cuda13"):
            assert f"'.[{name}]'" in text or f"`.[{name}]`" in text, (page, name)
            assert name in extras()
