"""The compile cache shared by a fleet: a remote tier behind the local NEFF cache, and the keys that mean one graph.

- :mod:`.urls`: the ``remote_cache`` URL (``file://``, ``s3://``, ``hf://``), checked without importing a backend;
- :mod:`.keys`: what makes a NEFF differ besides its graph (compiler version, ``NEURON_CC_FLAGS``, target, LNC);
- :mod:`.remote`: one remote opened through fsspec: entries as a manifest plus a content-addressed blob, fetched and
  verified before use, published atomically;
- :mod:`.tier`: this process's remote tier (fetch on a local miss, publish in the background, say once when it is
  down), which the simulated NEFF cache calls;
- :mod:`.local`: the entries of a local cache folder (the simulator's or torch-neuronx's), for ``accelerate-neuron
  cache``;
- :mod:`.outcomes`: how many graphs this process compiled, fetched and loaded (precompile's progress).

Nothing here imports torch, and fsspec and its backends only when a remote is used.
"""
