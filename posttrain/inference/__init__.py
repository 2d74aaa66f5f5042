"""Hot-load clients: make an inference deployment serve a snapshot the publisher wrote.

- ``contract``: the ``HotLoader`` protocol, ``HotLoadResult`` and the errors every client raises;
- ``protocol``: names of the CoreWeave ``v1alpha1`` hot-load API (docs/hotload-api.md),
  shared with the reference server (``posttrain.serve``);
- ``config``: ``HotLoadConfig``, where the service is and how patiently to talk to it;
- ``http``: ``HotLoadHTTP``, the retrying HTTP layer (auth, backoff, error decoding, scrubbing);
- ``hotload``: ``CoreWeaveHotLoader``, the client of that API (the hot-load operations).

Importing this package loads nothing heavy.
"""
