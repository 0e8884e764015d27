"""Logits processing and the draw of the next token on the Neuron device (a shared layer, not a plugin).

``generate()`` (the ``generation`` plugin) and continuous batching (the ``serving`` plugin) both pick the
next token of a sampling step here, in a graph compiled with the ``"neuron"`` backend, so only the chosen
ids cross to the host:

- :mod:`.program`: which Transformers logits processors have a device version, read off the processor
  objects of one call into a :class:`~.program.Program` (the graph's structure) and tensors (its values:
  per-row temperature, top-k, top-p, ...; a new value never recompiles);
- :mod:`.ops`: the device math: the full-vocabulary processors, the warpers on a global top-``K``
  candidate set (exact when every row's ``top_k`` is at most ``K``) or on the whole vocabulary without a
  sort (exact for any ``top_k``/``top_p``), and the draw from the device's random number generator;
- :mod:`.step`: one compiled graph per program and shape, with the state a step carries to the next
  (token counts for the repetition penalty, the token history for n-gram and multi-token bans).
"""
