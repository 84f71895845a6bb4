"""This folder is mpitrain's repository; the package is its ``mpitrain/`` subfolder.

A script saved beside a clone named ``mpitrain`` (the natural layout) would otherwise import this
folder as an empty namespace package, which shadows the installed package: ``mt.init()`` then
fails with "module 'mpitrain' has no attribute 'init'". Imported under that name, this file
loads the package inside the folder in its place; under any other name it does nothing.
"""
import importlib.util
import os
import sys

if __name__ == "mpitrain":
    _inner = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mpitrain")
    _spec = importlib.util.spec_from_file_location(
        "mpitrain", os.path.join(_inner, "__init__.py"), submodule_search_locations=[_inner])
    _package = importlib.util.module_from_spec(_spec)
    sys.modules["mpitrain"] = _package       # what the import statement returns
    _spec.loader.exec_module(_package)
