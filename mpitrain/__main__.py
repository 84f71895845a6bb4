"""``python -m mpitrain``: train with the flags of train/cli.py (``--help`` lists them).

An uncaught exception on any rank must end the whole job: the other ranks would otherwise wait
forever in their next collective (ChainerMN's except hook explains why Python MPI jobs hang). The
comm layer's abort hook prints the failing rank's traceback and calls MPI Abort. Bad input is not
such an exception: cli.run_cli turns it into one line on rank 0 and exit code 2 on every rank.
"""
from mpitrain.train.cli import main

if __name__ == "__main__":
    main()
