"""Inference calls on (simulated) Neuron: bucketed, compiled forwards vs stock upstream, in one run.

Three jobs users run on Trainium/Inferentia, each with stock calls only, over texts whose token lengths are
drawn from a lognormal distribution the defaults were not tuned for (median ``--median`` tokens, sigma 0.9,
clipped to 4-250; each pass draws new texts from its own seed):

- ``embed``: sentence-transformers ``SentenceTransformer(...).encode(texts, batch_size=32)`` (a BERT-style
  encoder, mean pooling, normalisation);
- ``classify``: ``pipeline("text-classification")`` called one text at a time (a chat or moderation service);
- ``rerank``: ``CrossEncoder(...).rank(query, documents)`` with 32 documents per query;
- ``image``: ``pipeline("image-classification", batch_size=8)`` over a pass of images (a ViT, 32x32 images from
  an offline image processor), the pass's size drawn so that its last batch varies;
- ``speech``: a wav2vec2 CTC forward on requests of 1-8 clips of 0.3-0.9 s, each padded by its feature extractor
  to a one-second window (a transcription service batching what arrives).

Images and audio windows have a fixed size per row: only their batch is bucketed, so their padding is counted in
rows (rows computed per real row), where the text jobs count positions.

Each job runs ``--passes`` passes of ``--texts`` texts on a fresh model, Dynamo reset and a cold (memory-only) NEFF
cache, in five scenarios: ``patched`` (accelerate-neuron as installed: an inference call's ``pow2-half`` length
buckets 16, 24, 32, 48, ... 256, two an octave, and a batch's rows grouped by the bucket of their own length),
``patched, pow2`` (``ACCELERATE_NEURON_PROMPT_BUCKETS=pow2``: one bucket an octave, the fewest graphs; the default
before), ``patched, one call per batch`` (``pow2`` and ``ACCELERATE_NEURON_GROUP_ROWS=0``: every row at the longest
row's bucket, the behaviour before grouping), ``patched, fit`` (``ACCELERATE_NEURON_PROMPT_BUCKETS=fit``, fitted
to the sizes an earlier run of the same job on other texts recorded in a scratch NEFF cache folder, with as many
buckets as ``pow2``) and stock (every patch reverted in this process). Per pass:
graphs compiled and eager op signatures compiled (what Neuron compiles), the cost model's compile time on Trainium
(:mod:`accelerate_neuron.costs`), padding overhead (positions the forwards computed per real token: stock pads each
batch to its longest text, patched to a bucket), and the largest difference from the CPU's results.

    python benchmarks/inference.py [--texts 96] [--passes 3] [--median 24] [--seed 7] [--output FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

os.environ.setdefault("ACCELERATE_NEURON_SIMULATE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch
import transformers

import accelerate_neuron
from _common import emit, environment
from accelerate_neuron import activation, costs, simulator, tiny
from accelerate_neuron.builtin.inference import call as inference_call
from accelerate_neuron.builtin.shapes import record
from accelerate_neuron.simulator import neff_cache

WORDS = tiny.CORPUS.split()


def texts(count: int, median: int, seed: int, tokenizer: Any) -> list[str]:
    """``count`` texts whose token counts are lognormal around ``median`` (sigma 0.9, 4-250 tokens)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        want = max(4, min(250, int(rng.lognormvariate(np.log(median), 0.9))))
        words: list[str] = []
        while len(tokenizer(" ".join(words))["input_ids"]) < want:
            words.append(rng.choice(WORDS))
        out.append(" ".join(words))
    return out


class Positions:
    """Real tokens and computed positions of every forward (the caller's shape, or the bucket's when patched)."""

    def __init__(self) -> None:
        self.real = 0
        self.computed = 0

    @contextlib.contextmanager
    def counting(self, patched: bool) -> Iterator[None]:
        """Count through the bucketed call's padding (patched) or every root model call (stock)."""
        counter = self
        if patched:
            original_pad = inference_call.ForwardCall.pad

            def pad(call: Any) -> Any:
                padded = original_pad(call)
                counter.real += (
                    int(call.inputs["attention_mask"].to("cpu").sum())
                    if call.tokens and "attention_mask" in call.inputs
                    else call.rows * max(call.length, 1)
                )
                # the groups' shapes when its rows run in groups; images and audio: rows (their size is fixed)
                counter.computed += call.computed if call.tokens else call.padded_rows
                return padded

            inference_call.ForwardCall.pad = pad
            try:
                yield
            finally:
                inference_call.ForwardCall.pad = original_pad
            return
        inside = []

        def counted(inherited: Callable[..., Any]) -> Callable[..., Any]:
            def call(module: Any, *args: Any, **kwargs: Any) -> Any:
                features = args[0] if args and isinstance(args[0], Mapping) else kwargs
                mask = features.get("attention_mask")
                media = next((features[k] for k in ("pixel_values", "input_values") if k in features), None)
                if not inside and isinstance(media, torch.Tensor):  # images, audio: rows, as the caller gave them
                    counter.real += int(media.shape[0])
                    counter.computed += int(media.shape[0])
                elif not inside and isinstance(mask, torch.Tensor) and mask.dim() == 2:  # a root call, its own shape
                    counter.real += int(mask.to("cpu").sum())  # on the host: no eager op of ours counted
                    counter.computed += mask.numel()
                inside.append(module)
                try:
                    return inherited(module, *args, **kwargs)
                finally:
                    inside.pop()

            return call

        from sentence_transformers.base.model import BaseModel

        roots = (transformers.PreTrainedModel, BaseModel)  # sentence-transformers calls its model's forward
        assert not any("__call__" in cls.__dict__ for cls in roots), "stock means no accelerate-neuron patch"
        for cls in roots:
            cls.__call__ = counted(torch.nn.Module.__call__)
        try:
            yield
        finally:
            for cls in roots:
                del cls.__call__

    @property
    def overhead(self) -> float:
        return self.computed / self.real if self.real else float("nan")


#: A job: how to build its model on a device, what one pass does with it (the results to compare), and, for the
#: image and speech jobs, the inputs of pass ``i`` (the text jobs take the shared texts).
Job = (
    tuple[Callable[[str], Any], Callable[[Any, list[Any]], Any]]
    | tuple[Callable[[str], Any], Callable[[Any, list[Any]], Any], Callable[[int], list[Any]]]
)


#: The patched scenarios: their settings, and whether they run on buckets fitted to an earlier run of the job.
SCENARIOS = {
    "patched": ({}, False),
    # One bucket an octave: fewer graphs for more padding.
    "patched, pow2": ({"ACCELERATE_NEURON_PROMPT_BUCKETS": "pow2"}, False),
    "patched, one call per batch": (
        {"ACCELERATE_NEURON_PROMPT_BUCKETS": "pow2", "ACCELERATE_NEURON_GROUP_ROWS": "0"},
        False,
    ),
    "patched, fit": ({"ACCELERATE_NEURON_PROMPT_BUCKETS": "fit", "ACCELERATE_NEURON_BATCH_BUCKETS": "fit"}, True),
}


def run_scenario(name: str, job: Job, passes: list[list[str]], history: list[list[str]], scenario: str) -> dict:
    """A patched scenario; ``fit`` first runs ``history`` (an earlier run of the job, on pow2) to record its sizes."""
    values, fitted = SCENARIOS[scenario]
    if not fitted:
        with environment(values):
            return {**run_job(name, job, passes, True), "scenario": scenario}
    folder = tempfile.mkdtemp(prefix="inference-records-")
    try:
        with environment({"TORCH_NEURONX_NEFF_CACHE_DIR": folder}):
            record.reset()
            run_job(name, job, history, True)
            record.flush()
            record.reset()
            with environment(values):
                return {**run_job(name, job, passes, True), "scenario": scenario}
    finally:
        record.reset()
        shutil.rmtree(folder, ignore_errors=True)


def run_job(name: str, job: Job, passes: list[list[str]], patched: bool) -> dict[str, Any]:
    build, work = job[:2]
    if len(job) == 3:
        passes = [job[2](i) for i in range(len(passes))]
    torch._dynamo.reset()
    neff_cache.use(None)  # cold, memory-only: counts that do not depend on earlier runs
    reference = build("cpu")
    model = build("neuron")
    positions = Positions()
    rows = []
    context = contextlib.nullcontext() if patched else activation.unpatched()
    with context, positions.counting(patched):
        for batch in passes:
            simulator.reset_stats()
            started = time.perf_counter()
            got = work(model, batch)
            seconds = time.perf_counter() - started
            st = simulator.stats()
            want = work(reference, batch)
            rows.append(
                {
                    "graphs": st["compiles"],
                    "eager": st["eager_signatures"],
                    "seconds": seconds,
                    "diff": float(np.abs(np.asarray(got, dtype=np.float64) - np.asarray(want, dtype=np.float64)).max()),
                }
            )
    graphs = sum(r["graphs"] for r in rows)
    eager = sum(r["eager"] for r in rows)
    return {
        "job": name,
        "scenario": "patched" if patched else "stock",
        "passes": rows,
        "graphs": graphs,
        "eager": eager,
        "estimate": costs.estimate(graphs, eager)["seconds"],
        "last_pass_estimate": costs.estimate(rows[-1]["graphs"], rows[-1]["eager"])["seconds"],
        "overhead": positions.overhead,
        "diff": max(r["diff"] for r in rows),
        "seconds": sum(r["seconds"] for r in rows),
    }


def jobs(folder: str, reranker: str, vit: str, seed: int) -> dict[str, Job]:
    from sentence_transformers import CrossEncoder, SentenceTransformer
    from sentence_transformers.sentence_transformer import modules

    def embedder(device: str) -> Any:
        transformer = modules.Transformer(folder)
        return SentenceTransformer(
            modules=[transformer, modules.Pooling(64, "mean"), modules.Normalize()], device=device
        )

    def classifier(device: str) -> Any:
        model = transformers.AutoModelForSequenceClassification.from_pretrained(reranker).to(device)
        return transformers.pipeline(
            "text-classification", model=model, tokenizer=tiny.encoder_tokenizer(), device=device
        )

    def embed(model: Any, batch: list[str]) -> Any:
        return model.encode(batch, batch_size=32)

    def classify(pipe: Any, batch: list[str]) -> Any:
        return [pipe(text)[0]["score"] for text in batch]

    def rerank(model: Any, batch: list[str]) -> Any:
        scores = []
        for start in range(0, len(batch), 33):
            query, *documents = batch[start : start + 33]
            ranked = sorted(model.rank(query, documents), key=lambda r: r["corpus_id"])
            scores += [r["score"] for r in ranked]
        return scores

    def image_classifier(device: str) -> Any:
        return transformers.pipeline("image-classification", model=vit, device=device)

    def classify_images(pipe: Any, images: list[Any]) -> Any:
        return [p[0]["score"] for p in pipe(images, batch_size=8)]

    def images(i: int) -> list[Any]:
        return tiny.images(random.Random(seed + i).randint(17, 40), seed=seed + i)

    extractor = tiny.feature_extractor("wav2vec2")

    def ctc(device: str) -> Any:
        return tiny.speech_model("wav2vec2").to(device)

    def transcribe(model: Any, requests: list[Any]) -> Any:
        scores = []
        for clips in requests:
            batch = extractor(
                clips, sampling_rate=tiny.SAMPLING_RATE, padding="max_length", max_length=tiny.SAMPLING_RATE,
                return_tensors="pt",
            )  # fmt: skip
            device = next(model.parameters()).device
            with torch.no_grad():
                logits = model(**{k: v.to(device) for k, v in batch.items()}).logits
            scores += logits.to("cpu").amax(-1).flatten().tolist()
        return scores

    def requests(i: int) -> list[Any]:
        rng = random.Random(seed + i)
        return [tiny.audio(rng.randint(1, 8), seed=seed + 100 * i + n) for n in range(12)]

    return {
        "embed": (embedder, embed),
        "classify": (classifier, classify),
        "rerank": (lambda device: CrossEncoder(reranker, device=device), rerank),
        "image": (image_classifier, classify_images, images),
        "speech": (ctc, transcribe, requests),
    }


def _minutes(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes} min {secs:02d} s" if minutes else f"{secs} s"


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        f"### Transformers {transformers.__version__} (torch {torch.__version__.split('+')[0]}, "
        f"accelerate-neuron {accelerate_neuron.__version__})",
        "",
        f"`python benchmarks/inference.py --texts {args.texts} --passes {args.passes} --median {args.median} "
        f"--seed {args.seed}`: {args.passes} passes of {args.texts} new texts each, token lengths lognormal "
        f"(median {args.median}, sigma 0.9, 4-250); a 2-layer BERT-style encoder (hidden 64, 256 positions). "
        "image: 17-40 images per pass, a 2-layer ViT; speech: 12 requests of 1-8 clips per pass, a 2-layer wav2vec2 "
        "CTC; their padding is rows computed per real row.",
        "",
        "| job | scenario | graphs | eager signatures | est. compile on Trainium | last pass alone | positions per "
        "real token (rows per row) | max diff vs CPU | CPU wall |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        per_pass = " + ".join(f"{p['graphs']}g/{p['eager']}e" for p in r["passes"])
        lines.append(
            f"| {r['job']} | {r['scenario']} | {r['graphs']} | {r['eager']} ({per_pass}) | {_minutes(r['estimate'])} "
            f"| {_minutes(r['last_pass_estimate'])} | {r['overhead']:.2f} | {r['diff']:.1e} | {r['seconds']:.1f} s |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=96)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--median", type=int, default=24)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--only", choices=("embed", "classify", "rerank", "image", "speech"))
    parser.add_argument("--output", help="append the markdown section to this file")
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="accelerate-neuron-bench-")
    folder = str(tiny.save_encoder(os.path.join(workdir, "encoder"), "bert", "AutoModel"))
    reranker = str(
        tiny.save_encoder(os.path.join(workdir, "reranker"), "bert", "AutoModelForSequenceClassification", num_labels=1)
    )
    vit = str(tiny.save_vision(os.path.join(workdir, "vit"), "vit"))
    tokenizer = tiny.encoder_tokenizer()
    passes = [texts(args.texts, args.median, args.seed + i, tokenizer) for i in range(args.passes)]
    history = [texts(args.texts, args.median, args.seed + 100 + i, tokenizer) for i in range(args.passes)]
    results = []
    for name, job in jobs(folder, reranker, vit, args.seed).items():
        if args.only and name != args.only:
            continue
        for scenario in (*SCENARIOS, "stock"):
            if scenario == "stock":
                result = run_job(name, job, passes, False)
            else:
                result = run_scenario(name, job, passes, history, scenario)
            results.append(result)
            print(
                f"{name:9} {result['scenario']:8} graphs={result['graphs']} eager={result['eager']} "
                f"overhead={result['overhead']:.2f} diff={result['diff']:.1e}",
                file=sys.stderr,
                flush=True,
            )
    emit(report(results, args) + "\n", args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
