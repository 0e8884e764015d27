"""Used by tests/test_precompile.py: one epoch of a stock Trainer with torch_compile, then evaluate and save.

    python precompile_train.py OUTPUT_DIR

Samples of 8 to 150 tokens: the plugin pads batches to the length buckets 64, 128, 256. Each rank prints one
JSON line with the simulator's counts, the graphs' cache keys, the loss and the weights' checksum.
"""

from __future__ import annotations

import json
import random
import sys

from accelerate import PartialState
from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

from accelerate_neuron import simulator, tiny


def main() -> None:
    out = sys.argv[1]
    rng = random.Random(0)
    lengths = [rng.choice([10, 40, 70, 100, 150]) for _ in range(24)]
    train = [{"input_ids": [rng.randrange(3, 500) for _ in range(n)]} for n in lengths]
    evaluation = train[:6]
    args = TrainingArguments(
        output_dir=out,
        torch_compile=True,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        num_train_epochs=1,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        seed=0,
    )
    model = tiny.model("llama", max_position_embeddings=256)
    before = sum(float(p.double().sum()) for p in model.parameters())
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=train,
        eval_dataset=evaluation,
        data_collator=DataCollatorForLanguageModeling(tiny.tokenizer(), mlm=False),
    )
    result = trainer.train()
    metrics = trainer.evaluate()
    trainer.save_model()
    st = simulator.stats()
    line = json.dumps(
        {
            "compiles": st["compiles"],
            "compile_cache_hits": st["compile_cache_hits"],
            "eager_compiles": st["eager_compiles"],
            "eager_cache_hits": st["eager_cache_hits"],
            "eager_signatures": st["eager_signature_list"],
            "graph_keys": sorted({g["cache_key"] for g in st["graphs"]}),
            "missed": [[g["kind"], g["inputs"][:1]] for g in st["graphs"] if g["cache"] == "miss"],
            "steps": result.global_step,
            "eval_loss": metrics.get("eval_loss"),
            "weights_before": before,
            "weights_after": sum(float(p.detach().cpu().double().sum()) for p in model.parameters()),
            "device": str(args.device),
        }
    )
    # Ranks share the launcher's stdout, and a line longer than PIPE_BUF written by two processes at once can
    # interleave: each rank prints in turn.
    state = PartialState()
    for rank in range(state.num_processes):
        if rank == state.process_index:
            print(line, flush=True)
        state.wait_for_everyone()


if __name__ == "__main__":
    main()
