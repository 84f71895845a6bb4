"""Collectives over MPI. mpitrain/__init__.py exports the public names (its ``__all__``: the one
list); docs/architecture.md draws the layers.

Bottom to top (each module imports only those before it): abort, watchdog, settings,
join_policy (what a rank that has joined can serve: no imports), check,
handles (the comm thread of non-blocking collectives), world (init/shutdown and the
per-communicator World), process_sets, build_info (what can run here), ops, ring, tree,
hierarchical, buckets, fusion, engine, host, overlap, device, collectives (the public API: host
or device, chosen in one place), join (a rank out of data serving the others).
"""
