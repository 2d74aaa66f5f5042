"""Hot-load clients: make an inference deployment serve a snapshot the publisher wrote.

- ``contract``: the ``HotLoader`` protocol, ``HotLoadResult`` and the errors every client raises;
- ``protocol``: names of the CoreWeave ``v1alpha1`` hot-load API (shared/spec/hotload-api.md),
  shared with the reference server (``posttrain.serve``);
- ``hotload``: ``HotLoadConfig`` and ``CoreWeaveHotLoader``, the client of that API.

Importing this package loads nothing heavy.
"""
