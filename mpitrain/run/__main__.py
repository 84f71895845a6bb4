"""python -m mpitrain.run -np N [-H a:4,b:4] COMMAND ...: same as mpitrainrun."""
import sys

from mpitrain.run.cli import main

sys.exit(main())
