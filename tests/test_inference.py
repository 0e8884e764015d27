"""Inference calls on Neuron see few shapes: bucketed, compiled forwards for encoders, pipelines, embeddings, rerankers.

Each test runs a stock call (``model(**batch)`` under ``torch.no_grad()``, a ``pipeline``, sentence-transformers'
``encode`` / ``predict`` / ``rank``) on the simulated device and on the CPU, over inputs of many lengths:

- outputs equal the CPU's (float32: max abs difference <= 1e-5 at every position the caller's attention mask keeps;
  labels, spans and rankings identical) and have the unpadded call's shapes, on the model's device;
- graphs <= one per (length bucket, batch bucket) touched; after the first call of a bucket, a new length adds
  0 eager op signatures and 0 graphs;
- ``ACCELERATE_NEURON_BUCKET_FORWARDS=0`` and ``disable_bucketing(model)`` give upstream's behaviour back.
"""

from __future__ import annotations

import copy
import itertools
import logging
import random
from typing import Any

import numpy as np
import pytest
import torch
import transformers

import accelerate_neuron
from accelerate_neuron import simulator, tiny
from accelerate_neuron.builtin import shapes
from helpers import run_python

TOLERANCE = 1e-5
WORDS = tiny.CORPUS.split()
#: Texts of 3 to 38 words: lengths in the 32 and 64 buckets of the tiny tokenizer.
TEXTS = [" ".join(WORDS[i % 5 : i % 5 + n]) for i, n in enumerate(range(3, 40, 5))]
IS_5X = int(transformers.__version__.split(".")[0]) >= 5


def lognormal_sentences(count: int, seed: int) -> list[str]:
    """``count`` sentences with lognormal word counts (median 10, long tail to ~60), from the tiny corpus."""
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=min(60, int(rng.lognormvariate(2.3, 0.7)) + 1))) for _ in range(count)]


def pair(model: Any) -> tuple[Any, Any]:
    """(the CPU reference, a copy on neuron:0)."""
    return model, copy.deepcopy(model).to("neuron")


def graphs() -> int:
    """Graphs Dynamo traced since the last reset (compiled now or loaded from the NEFF cache)."""
    return len(simulator.stats()["graphs"])


def close(a: Any, b: Any, mask: torch.Tensor | None = None) -> float:
    """Max abs difference of two model outputs (tensors, tuples, ModelOutputs), at the positions ``mask`` keeps."""
    if isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and a.shape == b.shape, (getattr(a, "shape", a), b.shape)
        a = a.detach().to("cpu").float()
        b = b.detach().float()
        if mask is not None and b.dim() >= 2 and b.shape[:2] == mask.shape:
            keep = mask.bool()
            a, b = a[keep], b[keep]
        return (a - b).abs().max().item() if b.numel() else 0.0
    if isinstance(b, dict):
        assert list(a.keys()) == list(b.keys()), (list(a.keys()), list(b.keys()))
        return max((close(a[k], b[k], mask) for k in b.keys()), default=0.0)
    if isinstance(b, (list, tuple)):
        assert len(a) == len(b)
        return max((close(x, y, mask) for x, y in zip(a, b, strict=True)), default=0.0)
    if hasattr(b, "layers"):  # a KV cache
        assert a.get_seq_length() == b.get_seq_length()
        return max(close(x.keys, y.keys) for x, y in zip(a.layers, b.layers, strict=True))
    return 0.0


def batch(rows: int, length: int, seed: int, left: int = 0, right: int = 0) -> dict[str, torch.Tensor]:
    """Random token ids with row 1's first ``left`` / last ``right`` positions masked (the caller's own padding)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 500, (rows, length), generator=g)
    mask = torch.ones_like(ids)
    if rows > 1:
        mask[1, :left] = 0
        mask[1, length - right :] = 0
    return {"input_ids": ids, "attention_mask": mask}


# ------------------------------------------------------------------ model(**batch) under no_grad


HEADS = (
    "AutoModelForSequenceClassification",
    "AutoModelForTokenClassification",
    "AutoModelForMaskedLM",
    "AutoModelForQuestionAnswering",
)
#: Every family with its bare model and two of the heads, in turn: each head on half of the families (4 of 8),
#: each family's attention and output fields seen, at 3/5 of the cost of every family with every head.
FAMILY_HEADS = {
    family: ("AutoModel", HEADS[i % len(HEADS)], HEADS[(i + 1) % len(HEADS)]) for i, family in enumerate(tiny.ENCODERS)
}


@pytest.mark.parametrize("family", tiny.ENCODERS)
def test_encoder_heads_run_bucketed_and_equal_the_cpu(sim: Any, family: str) -> None:
    for head in FAMILY_HEADS[family]:
        cpu, dev = pair(tiny.encoder(family, head))
        with torch.no_grad():  # ModernBERT (4.57) sets config.reference_compile in its first forward: one recompile
            dev(**{k: v.to("neuron") for k, v in batch(2, 20, seed=99).items()})
        simulator.reset_stats()
        seen = {}
        for step, length in enumerate((20, 21, 23, 26, 31)):  # buckets 24 and 32, new lengths in each
            inputs = batch(2, length, seed=step, right=2)
            with torch.no_grad():
                got = dev(**{k: v.to("neuron") for k, v in inputs.items()})
                want = cpu(**inputs)
            assert type(got) is type(want)
            assert close(got, want, inputs["attention_mask"]) <= TOLERANCE, (family, head, length)
            assert all(v.device.type == "neuron" for v in got.values() if isinstance(v, torch.Tensor))
            bucket = shapes.resolve_policy(None, purpose="forward").prompt_bucket(length)
            counts = (graphs(), simulator.stats()["eager_signatures"])
            # The first call of a bucket compiles it (a graph, or a few where Dynamo breaks the graph); every other
            # length in it adds neither graphs nor eager op signatures.
            assert seen.setdefault(bucket, counts) == counts, (family, head, length, seen, counts)
        assert sorted(seen) == [24, 32], seen  # an inference call's built-in buckets: pow2-half
        pieces = seen[32][0] - seen[24][0]  # bucket 24 was compiled by the first call above
        assert 1 <= pieces <= 3 and seen[24][0] <= 1, (family, head, seen)  # <= 1: ModernBERT's one recompile


def test_rows_of_very_different_lengths_run_in_groups_and_equal_the_cpu(sim: Any) -> None:
    """One long text no longer pads five short ones to its bucket: each group of rows runs at its own bucket."""
    tok = tiny.encoder_tokenizer()
    texts = [" ".join(WORDS[:90])] + [" ".join(WORDS[i : i + n]) for i, n in enumerate((2, 3, 1, 4, 5))]
    enc = tok(texts, return_tensors="pt", padding=True)
    lengths = enc["attention_mask"].sum(dim=1).tolist()
    assert 64 < lengths[0] <= 128 and max(lengths[1:]) <= 16
    for head in ("AutoModel", "AutoModelForTokenClassification", "AutoModelForSequenceClassification"):
        cpu, dev = pair(tiny.encoder("bert", head))
        accelerate_neuron.reset_padding_stats()
        simulator.reset_stats()
        with torch.no_grad():
            got = dev(**{k: v.to("neuron") for k, v in enc.items()}, output_hidden_states=True)
            want = cpu(**enc, output_hidden_states=True)
        assert close(got, want, enc["attention_mask"]) <= TOLERANCE, head
        # The long row alone at 128 columns, the five short ones at 16 as 4 + 1 rows (cheaper than 8 with 3 dummy rows,
        # even counting one more launch): not 8 rows x 128.
        assert accelerate_neuron.padding_stats()["forward"] == {"computed": 128 + 4 * 16 + 16, "real": sum(lengths)}
        shapes_run = {
            tuple(x["shape"])
            for g in simulator.stats()["graphs"]
            for x in g["dynamo_inputs"]
            if x["name"].endswith("['input_ids']")
        }
        assert (1, 128) in shapes_run and not {(8, 128), (8, 64)} & shapes_run, (head, shapes_run)
        compiles = simulator.stats()["compiles"]
        other = tok(
            [" ".join(WORDS[3:95])] + [" ".join(WORDS[i : i + n]) for i, n in enumerate((4, 1, 2, 6, 3))],
            return_tensors="pt",
            padding=True,
        )
        with torch.no_grad():
            got = dev(**{k: v.to("neuron") for k, v in other.items()}, output_hidden_states=True)
            assert close(got, cpu(**other, output_hidden_states=True), other["attention_mask"]) <= TOLERANCE
        later = {
            tuple(x["shape"])
            for g in simulator.stats()["graphs"]
            for x in g["dynamo_inputs"]
            if x["name"].endswith("['input_ids']")
        }
        # New lengths: a graph only for a group shape not seen before (never a recompile of a shape already run).
        assert simulator.stats()["compiles"] - compiles == len(later - shapes_run), (head, shapes_run, later)


@pytest.mark.parametrize("head", ["AutoModel", "AutoModelForCausalLM", "AutoModelForSequenceClassification"])
def test_decoder_only_models_called_for_scores_and_embeddings(sim: Any, head: str) -> None:
    torch.manual_seed(0)
    cpu, dev = pair(getattr(transformers, head).from_config(tiny.config("qwen3")).eval())
    for step, length in enumerate((25, 27, 29, 31)):
        inputs = batch(3, length, seed=step, left=2)  # a left-padded row, as decoder tokenizers pad
        with torch.no_grad():
            got = dev(**{k: v.to("neuron") for k, v in inputs.items()})
            want = cpu(**inputs)
        # The KV cache a decoder returns by default holds the caller's rows and positions, not the bucket's.
        assert close(got, want, inputs["attention_mask"]) <= TOLERANCE, (head, length)
        if step == 0:
            first = simulator.stats()["eager_signatures"]
    assert graphs() == 1  # one bucket (32) x one batch bucket (4)
    assert simulator.stats()["eager_signatures"] == first


def test_tuple_outputs_positional_inputs_and_the_callers_tensors(sim: Any) -> None:
    cpu, dev = pair(tiny.encoder("bert", "AutoModelForSequenceClassification"))
    inputs = batch(3, 9, seed=1, right=3)
    on_device = {k: v.to("neuron") for k, v in inputs.items()}
    kept = {k: v.clone() for k, v in on_device.items()}
    with torch.no_grad():
        got = dev(on_device["input_ids"], on_device["attention_mask"], return_dict=False, output_hidden_states=True)
        want = cpu(inputs["input_ids"], inputs["attention_mask"], return_dict=False, output_hidden_states=True)
    assert isinstance(got, tuple) and len(got) == len(want)
    assert close(got, want, inputs["attention_mask"]) <= TOLERANCE
    # Transformers 5 records hidden states with forward hooks, where Dynamo breaks the graph: two pieces.
    compiles = simulator.stats()["compiles"]
    assert 1 <= compiles <= 2
    with torch.no_grad():
        dev(
            on_device["input_ids"][:, :5],
            on_device["attention_mask"][:, :5],
            return_dict=False,
            output_hidden_states=True,
        )
    assert simulator.stats()["compiles"] == compiles  # another length, the same bucket
    for name, value in on_device.items():  # the caller's tensors are never modified
        assert value.shape == kept[name].shape and torch.equal(value.cpu(), kept[name].cpu())


def test_attentions_are_cut_on_both_sequence_dimensions(sim: Any) -> None:
    cpu, dev = pair(tiny.encoder("bert", "AutoModel", attn_implementation="eager"))
    inputs = batch(2, 7, seed=2)
    with torch.no_grad():
        got = dev(**{k: v.to("neuron") for k, v in inputs.items()}, output_attentions=True)
        want = cpu(**inputs, output_attentions=True)
    assert [a.shape for a in got.attentions] == [a.shape for a in want.attentions]
    assert close(got.attentions, want.attentions) <= TOLERANCE


# ------------------------------------------------------------------ pipelines


def _pipeline_outputs_equal(a: Any, b: Any) -> bool:
    """Pipeline outputs equal: same labels, words, spans; scores within the tolerance."""
    if isinstance(b, dict):
        return a.keys() == b.keys() and all(_pipeline_outputs_equal(a[k], b[k]) for k in b)
    if isinstance(b, list):
        return len(a) == len(b) and all(_pipeline_outputs_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(b, float | np.floating):
        return abs(float(a) - float(b)) <= TOLERANCE
    if isinstance(b, np.ndarray) or hasattr(b, "shape"):
        return np.allclose(np.asarray(a), np.asarray(b), atol=TOLERANCE)
    return a == b


PIPELINES = [
    ("text-classification", "AutoModelForSequenceClassification", lambda t: (t,)),
    ("token-classification", "AutoModelForTokenClassification", lambda t: (t,)),
    ("fill-mask", "AutoModelForMaskedLM", lambda t: (t + " <|mask|>",)),
    ("feature-extraction", "AutoModel", lambda t: (t,)),
    ("zero-shot-classification", "AutoModelForSequenceClassification", lambda t: (t, ["cache", "memory"])),
]
if not IS_5X:  # Transformers 5 removed the question-answering pipeline (the model-level QA head is tested above)
    PIPELINES.append(("question-answering", "AutoModelForQuestionAnswering", lambda t: ()))


@pytest.mark.parametrize(("task", "head", "args"), PIPELINES, ids=[p[0] for p in PIPELINES])
def test_text_pipelines_compile_once_per_bucket(sim: Any, task: str, head: str, args: Any) -> None:
    overrides: dict[str, Any] = {}
    if task == "zero-shot-classification":
        overrides = {"num_labels": 3, "label2id": {"entailment": 0, "neutral": 1, "contradiction": 2}}
        overrides["id2label"] = {v: k for k, v in overrides["label2id"].items()}
    cpu, dev = pair(tiny.encoder("bert", head, **overrides))
    tok = tiny.encoder_tokenizer()
    on_neuron = transformers.pipeline(task, model=dev, tokenizer=tok, device=dev.device)
    reference = transformers.pipeline(task, model=cpu, tokenizer=tok, device=torch.device("cpu"))

    def ask(p: Any, text: str) -> Any:
        if task == "question-answering":
            return p(question="what runs the graph", context=text)
        return p(*args(text))

    counts = []
    for text in TEXTS:
        assert _pipeline_outputs_equal(ask(on_neuron, text), ask(reference, text)), (task, text)
        counts.append((graphs(), simulator.stats()["eager_signatures"]))
    lengths = [len(tok(t)["input_ids"]) for t in TEXTS]
    buckets = {shapes.resolve_policy(256, purpose="forward").prompt_bucket(n) for n in lengths}
    assert counts[-1][0] <= len(buckets) * (2 if task == "zero-shot-classification" else 1), (counts, lengths)
    # After the first text, a new length adds no eager op signature (the pipeline's own host-side work has none).
    assert {s for _, s in counts} == {counts[0][1]}, counts

    if task not in ("question-answering", "zero-shot-classification"):  # a list of texts, batched by the pipeline
        texts = [args(t)[0] for t in TEXTS[:5]]
        assert _pipeline_outputs_equal(on_neuron(texts, batch_size=4), reference(texts, batch_size=4))


# ------------------------------------------------------------------ sentence-transformers


@pytest.fixture(scope="module")
def encoder_folder(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return tiny.save_encoder(tmp_path_factory.mktemp("bert"), "bert", "AutoModel")


@pytest.fixture(scope="module")
def reranker_folder(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return tiny.save_encoder(
        tmp_path_factory.mktemp("bert-rerank"), "bert", "AutoModelForSequenceClassification", num_labels=1
    )


def _sentence_transformer(folder: Any, device: str) -> Any:
    st = pytest.importorskip("sentence_transformers")
    from sentence_transformers.sentence_transformer import modules

    transformer = modules.Transformer(str(folder))
    pooling = modules.Pooling(64, "mean")
    return st.SentenceTransformer(modules=[transformer, pooling, modules.Normalize()], device=device)


def test_sentence_transformer_encode_stops_compiling(sim: Any, encoder_folder: Any, monkeypatch: Any) -> None:
    # The bucket grid itself, one call per batch: grouped rows add a graph per (group rows, bucket) shape, which
    # test_rows_of_very_different_lengths_run_in_groups_and_equal_the_cpu counts. The user's `pow2` wins over the
    # built-in `pow2-half` of inference calls: one bucket an octave, reached by 64 texts.
    monkeypatch.setenv("ACCELERATE_NEURON_GROUP_ROWS", "0")
    monkeypatch.setenv("ACCELERATE_NEURON_PROMPT_BUCKETS", "pow2")
    cpu = _sentence_transformer(encoder_folder, "cpu")
    dev = _sentence_transformer(encoder_folder, "neuron")
    first, second = lognormal_sentences(64, seed=1), lognormal_sentences(64, seed=2)
    got = dev.encode(first, batch_size=16)
    assert np.abs(got - cpu.encode(first, batch_size=16)).max() <= TOLERANCE
    after_first = simulator.stats()
    got = dev.encode(second, batch_size=16)
    assert np.abs(got - cpu.encode(second, batch_size=16)).max() <= TOLERANCE
    after_second = simulator.stats()
    assert after_first["eager_signatures"] == 0  # pooling and normalisation run inside the compiled call
    assert after_second["eager_signatures"] == 0 and after_second["compiles"] == after_first["compiles"]
    assert len(after_second["graphs"]) <= 3  # lengths up to 64+ tokens: buckets 32, 64, 128 at batch 16
    tokens = dev.encode(first[:3], output_value="token_embeddings")
    assert [t.shape for t in tokens] == [t.shape for t in cpu.encode(first[:3], output_value="token_embeddings")]
    tensors = dev.encode(first[:5], convert_to_tensor=True)
    assert tensors.device.type == "neuron" and tensors.shape == (5, 64)


def test_cross_encoder_predict_and_rank_equal_the_cpu(sim: Any, reranker_folder: Any, monkeypatch: Any) -> None:
    st = pytest.importorskip("sentence_transformers")
    cpu = st.CrossEncoder(str(reranker_folder), device="cpu")
    dev = st.CrossEncoder(str(reranker_folder), device="neuron")
    sentences = lognormal_sentences(41, seed=3)
    pairs = list(itertools.pairwise(sentences))
    assert np.abs(dev.predict(pairs, batch_size=8) - cpu.predict(pairs, batch_size=8)).max() <= TOLERANCE
    ranked, reference = dev.rank(sentences[0], sentences[1:21]), cpu.rank(sentences[0], sentences[1:21])
    assert [r["corpus_id"] for r in ranked] == [r["corpus_id"] for r in reference]
    monkeypatch.setenv("ACCELERATE_NEURON_GROUP_ROWS", "0")  # the bucket grid, one call per batch (see above)
    monkeypatch.setenv("ACCELERATE_NEURON_PROMPT_BUCKETS", "pow2")  # one bucket an octave (see above)
    dev.predict(pairs, batch_size=8)
    compiles = simulator.stats()["compiles"]
    dev.predict(list(zip(lognormal_sentences(40, seed=4), sentences[1:], strict=True)), batch_size=8)
    assert simulator.stats()["compiles"] == compiles  # new pairs, new lengths: the same buckets


# ------------------------------------------------------------------ left alone on purpose, and the opt-outs


def test_calls_that_padding_would_show_are_left_alone_and_still_equal_the_cpu(sim: Any, caplog: Any) -> None:
    """Labels, inputs_embeds, an encoder-decoder: the call itself runs as upstream (reason at debug level); a backbone
    it calls (a model of its own) may still be bucketed, which the results must not show either."""
    cpu, dev = pair(tiny.encoder("bert", "AutoModelForSequenceClassification"))
    inputs = batch(2, 9, seed=5)
    on_device = {k: v.to("neuron") for k, v in inputs.items()}
    labels = torch.tensor([0, 1])
    with torch.no_grad(), caplog.at_level(logging.DEBUG, logger="accelerate_neuron"):
        got = dev(**on_device, labels=labels.to("neuron"))
        want = cpu(**inputs, labels=labels)
        assert close(got, want) <= TOLERANCE
        embeds = cpu.get_input_embeddings()(inputs["input_ids"])
        got = dev(inputs_embeds=embeds.to("neuron"), attention_mask=on_device["attention_mask"])
        assert close(got, cpu(inputs_embeds=embeds, attention_mask=inputs["attention_mask"])) <= TOLERANCE
        t5_cpu, t5 = pair(tiny.model("t5"))
        decoder = inputs["input_ids"][:, :2]
        got = t5(**on_device, decoder_input_ids=decoder.to("neuron"))
        assert close(got.logits, t5_cpu(**inputs, decoder_input_ids=decoder).logits) <= TOLERANCE
    reasons = [r.getMessage() for r in caplog.records if "inference calls run unpadded" in r.getMessage()]
    assert any("BertForSequenceClassification" in r and "'labels'" in r for r in reasons), reasons
    assert any("no 2-D token ids" in r for r in reasons), reasons
    assert any("T5ForConditionalGeneration" in r and "encoder-decoder" in r for r in reasons), reasons
    simulator.reset_stats()
    with torch.no_grad():
        dev.train()
        dev(**on_device)  # training mode
        dev.eval()
    dev(**on_device)  # gradients on
    assert simulator.stats()["compiles"] == 0


def test_opt_outs_restore_upstream(sim: Any, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    _, dev = pair(tiny.encoder("bert", "AutoModel"))

    def run_lengths() -> tuple[int, int]:
        simulator.reset_stats()
        for step, length in enumerate((5, 9, 13)):
            with torch.no_grad():
                dev(**{k: v.to("neuron") for k, v in batch(1, length, seed=step).items()})
        st = simulator.stats()
        return st["compiles"], st["eager_signatures"]

    with caplog.at_level(logging.WARNING, logger="accelerate_neuron"):
        bucketed = run_lengths()
    announced = [r.getMessage() for r in caplog.records if "inference calls on Neuron" in r.getMessage()]
    assert len(announced) == 1 and "ACCELERATE_NEURON_BUCKET_FORWARDS=0" in announced[0]
    assert bucketed == (1, 0)
    monkeypatch.setenv("ACCELERATE_NEURON_BUCKET_FORWARDS", "0")
    stock = run_lengths()
    assert stock[0] == 0 and stock[1] > 2 * 10  # every new length: a new set of eager op compiles
    monkeypatch.delenv("ACCELERATE_NEURON_BUCKET_FORWARDS")
    assert run_lengths() == (0, 0)  # the bucket's graph is compiled already
    accelerate_neuron.disable_bucketing(dev)
    assert run_lengths() == stock
    accelerate_neuron.disable_bucketing(dev, False)
    assert run_lengths() == (0, 0)


def test_a_bucket_that_does_not_fit_in_memory_runs_the_call_unpadded() -> None:
    proc = run_python(
        """
        import torch
        from accelerate_neuron import tiny
        cpu = tiny.encoder("bert", "AutoModel")
        dev = tiny.encoder("bert", "AutoModel").to("neuron")
        ids = torch.randint(3, 500, (2, 9))
        with torch.no_grad():
            got = dev(input_ids=ids.to("neuron")).last_hidden_state.cpu()
            want = cpu(input_ids=ids).last_hidden_state
        assert got.shape == want.shape and (got - want).abs().max() <= 1e-5
        """,
        ACCELERATE_NEURON_SIMULATE="1",
        ACCELERATE_NEURON_SIM_HBM="1MiB",  # the weights and an unpadded call fit; 256 rows of 256 tokens do not
        ACCELERATE_NEURON_PROMPT_BUCKETS="256",
        ACCELERATE_NEURON_BATCH_BUCKETS="256",
    )
    assert "ran out of Neuron memory; it runs unpadded instead" in proc.stderr, proc.stderr[-3000:]


def test_generate_keeps_its_own_buckets(sim: Any) -> None:
    cpu, dev = pair(tiny.model("qwen3"))
    tok = tiny.tokenizer()
    enc = tok(["the neuron core runs"], return_tensors="pt")
    out = dev.generate(**{k: v.to("neuron") for k, v in enc.items()}, max_new_tokens=4, do_sample=False)
    assert torch.equal(out.cpu(), cpu.generate(**enc, max_new_tokens=4, do_sample=False))
    ids = [
        next(x["shape"] for x in g["dynamo_inputs"] if x["name"].endswith("['input_ids']"))
        for g in simulator.stats()["graphs"]
    ]
    # generate()'s own graphs: one prefill at the prompt bucket (4.x prefills all but the last token there) and
    # one decode step; its forwards are not padded a second time.
    assert sorted(ids) == [[1, 1], [1, 15 if not IS_5X else 16]], ids
