"""Used by tests/test_precompile.py: a stock embedding + classification script over texts of many lengths.

    python precompile_embed.py ENCODER_DIR CLASSIFIER_DIR

Nothing here knows about precompile. It prints one JSON line: the simulator's counts, the cache keys of the
graphs this run handed to the compiler, and a checksum of what it computed.
"""

from __future__ import annotations

import sys

from _precompile_report import print_report
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer import modules
from transformers import AutoModelForSequenceClassification, pipeline

from accelerate_neuron import tiny

WORDS = tiny.CORPUS.split()
#: Word counts: token lengths from 16 to 64 (an inference call's buckets 16, 24, 32, 48, 64), batches of 4 (one
#: short last batch of 2).
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
    print_report(
        lambda g: g["inputs"][:1], shape=list(embeddings.shape), checksum=float(abs(embeddings).sum()) + sum(scores)
    )


if __name__ == "__main__":
    main()
