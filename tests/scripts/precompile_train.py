"""Used by tests/test_precompile.py: one epoch of a stock Trainer with torch_compile, then evaluate and save.

    python precompile_train.py OUTPUT_DIR

Samples of 8 to 150 tokens: the plugin pads batches to the length buckets 64, 128, 256. Each rank prints one
JSON line with the simulator's counts, the graphs' cache keys, the loss and the weights' checksum.
"""

from __future__ import annotations

import random
import sys

from _precompile_report import print_report
from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

from accelerate_neuron import tiny


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
    print_report(
        lambda g: [g["kind"], g["inputs"][:1]],
        steps=result.global_step,
        eval_loss=metrics.get("eval_loss"),
        weights_before=before,
        weights_after=sum(float(p.detach().cpu().double().sum()) for p in model.parameters()),
        device=str(args.device),
    )


if __name__ == "__main__":
    main()
