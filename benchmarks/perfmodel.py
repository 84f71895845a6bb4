"""Performance model: fit our ring's alpha/beta/gamma, predict step time and efficiency to N=1024.
The model: benchmarks/perfmodel_lib (and docs/benchmarks.md); the flags: --help."""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]    # perfmodel_lib, benchdeps; mpitrain uninstalled
from perfmodel_lib.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
