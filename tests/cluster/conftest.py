"""Hosts in network namespaces for the cluster tests (tests/support/netns_hosts.py).

One cluster of two hosts serves the whole session and is removed at its end, also after a
failure. Where the machine cannot build one (not root, namespaces forbidden, no iproute2),
every test here skips with that one line.
"""
import pytest

from tests.support import netns_hosts


@pytest.fixture(scope="session")
def cluster():
    why = netns_hosts.unavailable()
    if why:
        pytest.skip(f"no namespace hosts: {why}")
    with netns_hosts.Cluster(2) as c:
        yield c


@pytest.fixture
def link(cluster):
    """The cluster with its link unshaped before and after the test."""
    cluster.shape()
    yield cluster
    cluster.shape()
