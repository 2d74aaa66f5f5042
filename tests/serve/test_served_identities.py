"""``CoreWeaveHotLoader.served_identities`` against the reference server: what the deployment's
replicas serve, read through its newest hot-load operation."""

from __future__ import annotations


def test_served_identities_follow_the_hot_loads(chain, make_server, make_client):
    server = make_server(replicas=2)
    client = make_client(server)
    assert client.served_identities() == set()  # never hot-loaded: the boot model, no snapshot
    client.hot_load(chain.full)
    assert client.served_identities() == {chain.full}
    client.hot_load(chain.d1, base_identity=chain.full)
    assert client.served_identities() == {chain.d1}
