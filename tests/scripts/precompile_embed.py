"""Used by tests/test_precompile.py: a stock embedding + classification script over texts of many lengths.

    python precompile_embed.py ENCODER_DIR CLASSIFIER_DIR

Nothing here knows about precompile. It prints one JSON line: the simulator's counts, the cache keys of the
graphs this run handed to the compiler, and a checksum of what it computed.
"""

from __future__ import annotations

import json
import sys

from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer import modules
from transformers import AutoModelForSequenceClassification, pipeline

from accelerate_neuron import simulator, tiny

WORDS = tiny.CORPUS.split()
#: Word counts: token lengths in the 32 and 64 buckets, batches of 4 (one short last batch of 2).
SIZES = [3, 9, 14, 22, 30, 5, 17, 26, 8, 12]


def main() -> None:
    encoder, classifier = sys.argv[1], sys.argv[2]
    texts = [" ".join(WORDS[i : i + n]) for i, n in enumerate(SIZES)]
    transformer = modules.Transformer(encoder)
    model = SentenceTransformer(modules=[transformer, modules.Pooling(64, "mean")], device="neuron")
    embeddings = model.encode(texts, batch_size=4)
    classify = pipeline(
        "text-classification",
        model=AutoModelForSequenceClassification.from_pretrained(classifier).to("neuron"),
        tokenizer=tiny.encoder_tokenizer(),
        device="neuron",
    )
    scores = [classify(text)[0]["score"] for text in texts]
    st = simulator.stats()
    print(
        json.dumps(
            {
                "compiles": st["compiles"],
                "compile_cache_hits": st["compile_cache_hits"],
                "eager_compiles": st["eager_compiles"],
                "graph_keys": sorted({g["cache_key"] for g in st["graphs"]}),
                "shape": list(embeddings.shape),
                "checksum": float(abs(embeddings).sum()) + sum(scores),
            }
        )
    )


if __name__ == "__main__":
    main()
